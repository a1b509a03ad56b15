"""CPU offload (`--cpu-offload`): diffusers' own mechanisms on a loaded pipeline; runner.py calls `apply_offload` once.

- model: `enable_model_cpu_offload` (accelerate's hooks): each component (text encoders, each denoiser,
  the VAE) moves to the GPU when it is called and the one before it moves back to the CPU.
- layerwise: `enable_group_offload` at block level: every component's repeated blocks wait in pinned CPU
  memory and move in one at a time, the next prefetched on a side stream while this one runs (CUDA); its
  other weights move in for its forward and out after.

Both move weights between phases, so the runner captures no CUDA graphs under them; compiled blocks
stay (the hooks run outside the compiled block's forward). Under SP every rank offloads its own replica.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def apply_offload(pipe: Any, mode: str, device: torch.device) -> None:
    """Offload the pipeline's components by `mode` ("none": nothing changes) onto `device` when they run."""
    if mode == "none":
        return
    if mode == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif mode == "layerwise":
        pipe.enable_group_offload(
            onload_device=device,
            offload_device=torch.device("cpu"),
            offload_type="block_level",
            num_blocks_per_group=1,
            use_stream=device.type == "cuda",  # prefetch the next block while this one runs
        )
    else:
        raise ValueError(f"cpu_offload must be none, model or layerwise, got {mode!r}")
    logger.info("CPU offload %s: weights wait on the CPU between their phases; no CUDA graphs", mode)
