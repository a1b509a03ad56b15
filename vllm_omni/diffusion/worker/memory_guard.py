"""What a rank does about device memory around its requests: tell an out-of-memory error apart, free what
a failed request held, and read the allocator's figures. The worker (worker.py) and the runner call it.
"""

from __future__ import annotations

import gc

import torch


class GroupOutOfMemory(RuntimeError):
    """`error`, an out-of-memory error, raised on every rank of an SP group at one point they all reached
    (the prompt encoding's broadcast, runner._with_shared_text): no rank was left inside a collective."""

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
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory_figures(device: torch.device) -> tuple[int | None, int | None, int | None]:
    """(peak allocated since the last call, allocated, reserved) bytes on CUDA; Nones elsewhere.

    Resets the peak, so that each request reports its own."""
    if device.type != "cuda":
        return None, None, None
    peak = torch.cuda.max_memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    return peak, torch.cuda.memory_allocated(device), torch.cuda.memory_reserved(device)
