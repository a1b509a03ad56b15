"""CPU offload (`--cpu-offload`): diffusers' own mechanisms on a loaded pipeline; runner.py calls `apply_offload` once.

- model: `enable_model_cpu_offload` (accelerate's hooks): each component (text encoders, each denoiser,
  the VAE) moves to the GPU when it is called and the one before it moves back to the CPU.
- layerwise: diffusers' group offloading. A denoiser's repeated blocks wait in pinned CPU memory and move
  in one at a time (block level), the next prefetched on a side stream while this one runs (CUDA); its other
  weights move in for its forward and out after. The other components are offloaded layer by layer (leaf
  level): the pipelines call their methods (`vae.decode`, not `forward`), which a block-level group's hook
  on the top module would never see. The memory plan's spare room keeps some of a denoiser's blocks on
  the GPU for good (`resident`, spread evenly: each streamed block's transfer overlaps the blocks before it).

Both move weights between phases, so the runner captures no CUDA graphs under them; compiled blocks
stay (the hooks run outside the compiled block's forward). Under SP every rank offloads its own replica.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from vllm_omni.logger import init_logger

logger = init_logger(__name__)


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
        from diffusers.hooks import apply_group_offloading

        for name, component in pipe.components.items():
            if not isinstance(component, torch.nn.Module):
                continue
            if name in denoisers:
                level = {"offload_type": "block_level", "num_blocks_per_group": 1}
            else:
                level = {"offload_type": "leaf_level"}
            kept = _resident_blocks(component, (resident or {}).get(name, 0)) if name in denoisers else []
            # use_stream: prefetch the next group on a side stream while this one runs (pinned CPU memory).
            stream = device.type == "cuda"
            with _hidden(component, kept):
                apply_group_offloading(component, device, torch.device("cpu"), use_stream=stream, **level)
            for block in kept:
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


@contextlib.contextmanager
def _hidden(model: torch.nn.Module, kept: list[torch.nn.Module]) -> Iterator[None]:
    """While diffusers places its groups: `model`'s block lists without the `kept` blocks, so none of their
    weights joins a group (diffusers has no option to leave blocks out). The lists are restored after."""
    lists = {name: child for name, child in model.named_children() if isinstance(child, torch.nn.ModuleList)}
    keep = {id(block) for block in kept}
    try:
        for name, blocks in lists.items():
            if keep:
                setattr(model, name, torch.nn.ModuleList([b for b in blocks if id(b) not in keep]))
        yield
    finally:
        for name, blocks in lists.items():
            setattr(model, name, blocks)
