"""CPU offload (`--cpu-offload`): diffusers' own mechanisms on a loaded pipeline; runner.py calls `apply_offload` once.

- model: `enable_model_cpu_offload` (accelerate's hooks): each component (text encoders, each denoiser,
  the VAE) moves to the GPU when it is called and the one before it moves back to the CPU.
- layerwise: diffusers' group offloading. A denoiser's repeated blocks wait in pinned CPU memory and move
  in one at a time (block level), the next prefetched on a side stream while this one runs (CUDA); its other
  weights move in for its forward and out after. The other components are offloaded layer by layer (leaf
  level): the pipelines call their methods (`vae.decode`, not `forward`), which a block-level group's hook
  on the top module would never see.

Both move weights between phases, so the runner captures no CUDA graphs under them; compiled blocks
stay (the hooks run outside the compiled block's forward). Under SP every rank offloads its own replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def apply_offload(pipe: Any, mode: str, device: torch.device, denoisers: Mapping[str, torch.nn.Module]) -> None:
    """Offload the pipeline's components by `mode` ("none": nothing changes) onto `device` when they run."""
    if mode == "none":
        return
    if mode == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif mode == "layerwise":
        from diffusers.hooks import apply_group_offloading

        for name, component in pipe.components.items():
            if not isinstance(component, torch.nn.Module):
                continue
            if name in denoisers:
                level = {"offload_type": "block_level", "num_blocks_per_group": 1}
            else:
                level = {"offload_type": "leaf_level"}
            # use_stream: prefetch the next group on a side stream while this one runs (pinned CPU memory).
            apply_group_offloading(component, device, torch.device("cpu"), use_stream=device.type == "cuda", **level)
    else:
        raise ValueError(f"cpu_offload must be none, model or layerwise, got {mode!r}")
    logger.info("CPU offload %s: weights wait on the CPU between their phases; no CUDA graphs", mode)
