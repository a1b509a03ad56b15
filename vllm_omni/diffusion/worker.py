"""One worker process per rank: join the process groups, load the pipeline, serve requests.

Started by the executor (executor.py) with the spawn method. Every rank runs the whole
pipeline on the same request and seed; the transformer splits its work over the SP group.
Rank 0 sends the images back; every rank reports done / cancelled / error, so the executor
can tell a request that failed everywhere (bad input: the engine goes on) from one that left
ranks stuck in a collective (the executor restarts the workers).
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

from vllm_omni.diffusion.data import DiffusionRequest, OmniDiffusionConfig, RequestCancelled
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def _cpu_threads(world_size: int) -> int:
    if "VLLM_OMNI_CPU_THREADS" in os.environ:
        return max(1, int(os.environ["VLLM_OMNI_CPU_THREADS"]))
    return max(1, (os.cpu_count() or 1) // world_size)


def worker_main(
    rank: int,
    config: OmniDiffusionConfig,
    model_path: str,
    init_method: str,
    request_queue: Any,
    result_queue: Any,
    cancel_token: Any,
) -> None:
    try:
        runner, device = _load(rank, config, model_path, init_method)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, which raises it
        result_queue.put(("load_error", rank, None, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    result_queue.put(("ready", rank, None, None))
    _serve(rank, config, runner, device, request_queue, result_queue, cancel_token)


def _load(rank: int, config: OmniDiffusionConfig, model_path: str, init_method: str):
    import torch

    from vllm_omni.diffusion.attention.backends import configure_attention_backend
    from vllm_omni.diffusion.distributed.parallel_state import initialize_parallel_state
    from vllm_omni.diffusion.loader import read_pipeline_spec
    from vllm_omni.diffusion.runner import PipelineRunner

    start = time.perf_counter()
    parallel = config.parallel_config
    if config.device == "cuda":
        torch.cuda.set_device(rank)
        device = torch.device("cuda", rank)
    else:
        torch.set_num_threads(_cpu_threads(parallel.world_size))
        device = torch.device("cpu")
    initialize_parallel_state(parallel, rank, init_method, device)
    configure_attention_backend(config.attention_backend, parallel.mask_sp_padding)

    spec = read_pipeline_spec(Path(model_path))
    dtype = getattr(torch, config.dtype)
    runner = PipelineRunner(model_path, spec, device, dtype, rank, enforce_eager=config.enforce_eager)
    heads = runner.num_attention_heads
    if heads % parallel.ulysses_degree:
        divisors = [d for d in range(1, heads + 1) if heads % d == 0]
        raise ValueError(
            f"ulysses_degree={parallel.ulysses_degree} does not divide the model's {heads} attention heads; "
            f"use one of {divisors}"
        )
    logger.info(
        "Worker rank %d loaded %s (%s, %s) in %.1f s",
        rank,
        model_path,
        device,
        config.dtype,
        time.perf_counter() - start,
    )
    return runner, device


def _serve(rank, config, runner, device, request_queue, result_queue, cancel_token) -> None:
    import torch
    import torch.distributed as dist

    world_size = config.parallel_config.world_size
    while True:
        request: DiffusionRequest | None = request_queue.get()
        if request is None:
            break

        def on_step_end(step: int, request: DiffusionRequest = request) -> None:
            # All ranks must stop at the same step, or the others would wait in a collective forever.
            flag = torch.tensor([int(cancel_token.value == request.cancel_token)], device=device)
            if world_size > 1:
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                raise RequestCancelled(f"request {request.request_id} cancelled at step {step + 1}")

        start = time.perf_counter()
        try:
            images = runner.run(request, on_step_end)
        except RequestCancelled as exc:
            logger.info("%s", exc)
            result_queue.put(("cancelled", rank, request.request_id, str(exc)))
            continue
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
            logger.warning("Request %s failed on rank %d: %s: %s", request.request_id, rank, type(exc).__name__, exc)
            result_queue.put(("error", rank, request.request_id, f"{type(exc).__name__}: {exc}"))
            continue
        if rank == 0:
            logger.info(
                "Request %s: %d step(s) in %.2f s",
                request.request_id,
                request.num_inference_steps,
                time.perf_counter() - start,
            )
        result_queue.put(("done", rank, request.request_id, images if rank == 0 else None))
    from vllm_omni.diffusion.distributed.parallel_state import destroy_parallel_state

    destroy_parallel_state()
