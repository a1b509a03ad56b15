"""CPU offload (`--cpu-offload`): diffusers' own mechanisms on a loaded pipeline; runner.py calls `apply_offload` once.

- model: `enable_model_cpu_offload` (accelerate's hooks): each component (text encoders, each denoiser,
  the VAE) moves to the GPU when it is called and the one before it moves back to the CPU.
- layerwise: diffusers' group offloading. A denoiser's repeated blocks wait in pinned CPU memory and move
  in one at a time (block level), the next prefetched on a side stream while this one runs (CUDA); its other
  weights move in for its forward and out after. The other components are offloaded layer by layer (leaf
  level): the pipelines call their methods (`vae.decode`, not `forward`), which a block-level group's hook
  on the top module would never see. The memory plan's spare room keeps some of a denoiser's blocks on
  the GPU for good (`resident`, spread evenly: each streamed block's transfer overlaps the blocks before it):
  their group hooks are removed (diffusers has no option to leave blocks out of its groups).

Both move weights between phases, so the runner captures no CUDA graphs under them; compiled blocks
stay (the hooks run outside the compiled block's forward). Under SP every rank offloads its own replica.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from vllm_omni.logger import init_logger

logger = init_logger(__name__)
GROUP_OFFLOADING = "group_offloading"  # the name diffusers registers a block's group offloading hook under
# With streams, diffusers also puts a tracker on every offloaded group (its lazy prefetch learns the order from
# them at the first forward, then links each group's hook to the next): a resident block loses both.
LAYER_EXECUTION_TRACKER = "layer_execution_tracker"


def apply_offload(
    pipe: Any,
    mode: str,
    device: torch.device,
    denoisers: Mapping[str, torch.nn.Module],
    resident: Mapping[str, int] | None = None,
) -> None:
    """Offload the pipeline's components by `mode` ("none": nothing changes) onto `device` when they run;
    under layerwise, `resident[name]` of a denoiser's blocks stay on `device` (MemoryPlan.resident_blocks)."""
    if mode == "none":
        return
    if mode == "model":
        pipe.enable_model_cpu_offload(device=device)
    elif mode == "layerwise":
        from diffusers.hooks import HookRegistry, apply_group_offloading

        for name, component in pipe.components.items():
            if not isinstance(component, torch.nn.Module):
                continue
            if name in denoisers:
                level = {"offload_type": "block_level", "num_blocks_per_group": 1}
            else:
                level = {"offload_type": "leaf_level"}
            # use_stream: prefetch the next group on a side stream while this one runs (pinned CPU memory).
            stream = device.type == "cuda"
            apply_group_offloading(component, device, torch.device("cpu"), use_stream=stream, **level)
            kept = _resident_blocks(component, (resident or {}).get(name, 0)) if name in denoisers else []
            for block in kept:
                # Its group's hook removed before any forward, the prefetch order (traced at the first forward)
                # never includes it: it stays where it is moved, and no other group waits for it.
                registry = HookRegistry.check_if_exists_or_initialize(block)
                for hook in (GROUP_OFFLOADING, LAYER_EXECUTION_TRACKER):
                    if registry.get_hook(hook) is not None:
                        registry.remove_hook(hook, recurse=False)
                block.to(device)
            if kept:
                logger.info("CPU offload layerwise: %d of %s's blocks stay on %s", len(kept), name, device)
    else:
        raise ValueError(f"cpu_offload must be none, model or layerwise, got {mode!r}")
    logger.info("CPU offload %s: weights wait on the CPU between their phases; no CUDA graphs", mode)


def _resident_blocks(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """`count` of the blocks of `model`'s block lists (the ModuleList children group offloading streams), spread
    evenly over the forward's order."""
    blocks = [b for child in model.children() if isinstance(child, torch.nn.ModuleList) for b in child]
    total, count = len(blocks), min(count, len(blocks))
    return [block for i, block in enumerate(blocks) if (i + 1) * count // total > i * count // total]
