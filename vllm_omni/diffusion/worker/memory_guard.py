"""What a rank does about device memory around its requests: tell an out-of-memory error apart, free what
a failed request held, and read the allocator's figures. The worker (worker.py) and the runner call it.
"""

from __future__ import annotations

import gc
from collections.abc import Callable

import torch

# What an allocation of a measured peak is planned with beyond it: the allocator's rounding and fragmentation.
# Measured on an H200: a video VAE's untiled decode at 848x480x121 (an 83 GiB peak) after a compiled and
# graphed denoising ran out under a 125.8 GiB cap with 92 GiB to spare, 29 GiB of it reserved in fragments.
ALLOCATION_MARGIN = 1.3


class GroupOutOfMemory(RuntimeError):
    """`error`, an out-of-memory error, raised on every rank of an SP group at one point they all reached
    (the prompt encoding's broadcast, runner._shared_embeddings): no rank was left inside a collective."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def is_out_of_memory(exc: BaseException) -> bool:
    """True for torch's OutOfMemoryError and for a CUDA "out of memory" RuntimeError (a kernel's launch)."""
    if isinstance(exc, (torch.OutOfMemoryError, GroupOutOfMemory)):
        return True
    return isinstance(exc, RuntimeError) and "out of memory" in str(exc).lower()


def release_memory(device: torch.device) -> None:
    """Free what a failed request left: the tensors its exception's frames kept (reference cycles) and,
    on CUDA, the allocator's cached blocks; the next request's peak starts afresh."""
    release_cached_memory(device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def release_cached_memory(device: torch.device) -> None:
    """Free what a failed attempt left (its exception's frames) and, on CUDA, the allocator's cached blocks."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def memory_figures(device: torch.device) -> tuple[int | None, int | None, int | None]:
    """(peak allocated since the last call, allocated, reserved) bytes on CUDA; Nones elsewhere.

    Resets the peak, so that each request reports its own."""
    if device.type != "cuda":
        return None, None, None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)


def allocation_check(device: torch.device, simulated: tuple[int, int] | None = None) -> Callable[[int], bool] | None:
    """`fits(nbytes)`: whether the rank can allocate `nbytes` more now, within its cap (--gpu-memory-utilization,
    the per-process fraction the worker sets) and what the device has free, blocks the allocator caches unused
    counted after releasing them (a CUDA graph's private pool stays held). None on a CPU (nothing to judge),
    unless a simulated device's (total, free) bytes stand in (the rank's hooks): then its free bytes are the room."""
    if simulated is not None:
        return lambda nbytes: nbytes * ALLOCATION_MARGIN <= simulated[1]
    if device.type != "cuda":
        return None

    def room() -> int:
        free, total = torch.cuda.mem_get_info(device)
        fraction = torch.cuda.get_per_process_memory_fraction(device)  # the worker set it
        return min(int(fraction * total) - torch.cuda.memory_reserved(device), free)

    def fits(nbytes: int) -> bool:
        if nbytes * ALLOCATION_MARGIN <= room():
            return True
        torch.cuda.empty_cache()  # what is cached unused counts once released
        return nbytes * ALLOCATION_MARGIN <= room()

    return fits
