"""`vllm-omni plan MODEL [--gpu-memory GIB] [engine options]`: would this deploy start on that GPU, and what would
it admit? The memory plan a server's rank 0 makes at start (worker/memory_plan.py, engine/admission.py), printed
without a GPU and without reading a weight: the weights per component (safetensors headers, or for a folder of
configs alone the modules built on the meta device), one step at the request the deploy must admit, the placement,
and the envelope, or the refusal with the settings that would fit. Exit status 0: it starts; 1: it is refused.
Called by cli/main.py.
"""

from __future__ import annotations

import argparse

from vllm_omni.entrypoints.cli.serve import add_engine_args, engine_args_from_cli


def add_plan_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    parser.add_argument(
        "--gpu-memory",
        type=float,
        default=None,
        metavar="GIB",
        help="the GPU to plan for, in GiB, all of it free (default: this machine's first GPU)",
    )


def local_gpu_bytes() -> int | None:
    import torch

    return torch.cuda.get_device_properties(0).total_memory if torch.cuda.is_available() else None


def cmd_plan(args: argparse.Namespace) -> int:
    from vllm_omni.diffusion.engine.admission import plan_deploy

    engine, _ = engine_args_from_cli(args)
    if args.gpu_memory is not None and args.gpu_memory <= 0:
        raise ValueError(f"--gpu-memory must be a positive number of GiB, got {args.gpu_memory:g}")
    gpu_bytes = int(args.gpu_memory * 2**30) if args.gpu_memory is not None else local_gpu_bytes()
    if gpu_bytes is None:
        raise ValueError("this machine has no GPU: give the one to plan for with --gpu-memory GIB")
    plan = plan_deploy(engine, gpu_bytes)
    print("\n".join(plan.lines()), flush=True)
    return 0 if plan.starts else 1
