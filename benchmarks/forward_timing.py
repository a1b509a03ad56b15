"""Shared by the per-model SP benchmarks (sp_forward.py for Qwen-Image and FLUX.2, hunyuan_video_sp.py).

`init_parallel` joins a torchrun NCCL world or acts as rank 0 of a simulated Ulysses group on
one GPU; `time_variants` times forward variants interleaved (a new random order each round,
CUDA events on each rank, median of the timed rounds); `agreement` compares two bf16 outputs.
"""

from __future__ import annotations

import dataclasses
import math
import os
import random
import statistics
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist

from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.parallel_state import (
    ParallelState,
    initialize_parallel_state,
    initialize_simulated_parallel_state,
    use_parallel_state,
)


@dataclasses.dataclass
class ParallelSetup:
    rank: int
    device: torch.device
    state: ParallelState  # the Ulysses-N state; variants copy it with their padding mode
    simulated: bool
    description: str


def init_parallel(simulate: bool, degree: int | None = None) -> ParallelSetup:
    """torchrun: every process joins one NCCL group of WORLD_SIZE ranks. Simulated: rank 0 of a U`degree` group."""
    if simulate:
        degree = degree or 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        state = initialize_simulated_parallel_state(DiffusionParallelConfig(ulysses_degree=degree))
        setup = f"one GPU, simulated U{degree} rank (all-to-alls are local copies: no communication cost)"
        return ParallelSetup(0, device, state, True, setup)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if degree is not None and degree != world:
        raise SystemExit(f"--degree {degree} needs torchrun --nproc_per_node {degree} (got {world} processes)")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=600), device_id=device)
    state = initialize_parallel_state(DiffusionParallelConfig(ulysses_degree=world), rank, "env://", device)
    names = {1: "one GPU", 2: "two GPUs"}
    return ParallelSetup(rank, device, state, False, f"{names.get(world, f'{world} GPUs')}, real NCCL all-to-alls")


def with_padding_mode(state: ParallelState, **flags) -> ParallelState:
    """`state` with its config's padding flags replaced (mask_sp_padding / trim_sp_padding)."""
    return dataclasses.replace(state, config=state.config.replace(**flags))


def time_variants(
    name_to_variant: dict, inputs: dict, iters: int, warmup: int, rank: int, keep_outputs: bool = False
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Median ms (or an error string) per variant, and each variant's last output if `keep_outputs`.

    A variant is (callable taking the forward's keyword arguments, parallel state or None).
    """
    timings: dict[str, list[float]] = {name: [] for name in name_to_variant}
    errors: dict[str, str] = {}
    outputs: dict[str, torch.Tensor] = {}
    names = list(name_to_variant)
    order = random.Random(0)  # same shuffle on every rank
    for i in range(warmup + iters):
        order.shuffle(names)  # a new order each round: no variant always follows the same one
        for name in names:
            if name in errors:
                continue
            model, state = name_to_variant[name]
            if dist.is_initialized():
                dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            try:
                with use_parallel_state(state), torch.inference_mode():
                    start.record()
                    out = model(**inputs)
                    end.record()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - recorded in the results (e.g. a variant that rejects a size)
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                if rank == 0:
                    traceback.print_exc()
                continue
            if keep_outputs:
                outputs[name] = out[0] if isinstance(out, tuple) else out.sample
            if i >= warmup:
                timings[name].append(start.elapsed_time(end))
    return {name: errors.get(name) or statistics.median(times) for name, times in timings.items()}, outputs


def agreement(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Max abs difference and PSNR (dB, peak = the expected output's max abs value), in fp32."""
    actual, expected = actual.float(), expected.float()
    diff = (actual - expected).abs()
    mse = diff.pow(2).mean().item()
    peak = expected.abs().max().item()
    psnr = math.inf if mse == 0 else 10 * math.log10(peak**2 / mse)
    return {"max_abs_diff": diff.max().item(), "psnr_db": psnr, "finite": bool(torch.isfinite(actual).all())}
