"""CPU offload (`--cpu-offload`): diffusers' own mechanisms on a loaded pipeline; runner.py calls `apply_offload` once.

- model: one component (a text encoder, a denoiser, the VAE) on the GPU at a time, moved in when it is called
  (`ModelOffload`: accelerate's hook, placed as diffusers' `enable_model_cpu_offload` places it). Its weights wait
  in pinned CPU memory, and moving it out drops the GPU copy: served weights do not change, so nothing is copied
  back. diffusers' own copies them back with `.to("cpu")` into new pageable memory: 1.2 GB/s on an H100 against
  55 GB/s pinned (benchmarks/offload_copies.py; docs/serving.md has what it cost a request). Weights of a tensor
  subclass (FP8) move as accelerate moves them.
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
from accelerate.hooks import ModelHook, add_hook_to_module
from accelerate.utils import send_to_device

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
) -> ModelOffload | None:
    """Offload the pipeline's components by `mode` ("none": nothing changes) onto `device` when they run;
    under layerwise, `resident[name]` of a denoiser's blocks stay on `device` (MemoryPlan.resident_blocks).
    Under model offload, the ModelOffload (its `release()` ends a request with every weight on the CPU)."""
    model_offload = None
    if mode == "none":
        return None
    if mode == "model":
        model_offload = ModelOffload(device)
        model_offload.install(pipe)
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
    return model_offload


class ModelOffload:
    """`--cpu-offload model` (module doc): the component called last is on `device`, every other waits on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        # id(component) -> (module, name, CPU tensor) of each of its parameters and buffers; absent: a component with
        # weights of a tensor subclass (FP8), moved whole with `.to`.
        self.homes: dict[int, list[tuple[torch.nn.Module, str, torch.Tensor]]] = {}
        self.resident: torch.nn.Module | None = None

    def install(self, pipe: Any) -> None:
        for component in pipe.components.values():
            if isinstance(component, torch.nn.Module):
                component.to("cpu")
                self._pin(component)
                add_hook_to_module(component, ComponentOnload(self), append=True)

    def _pin(self, component: torch.nn.Module) -> None:
        homes = []
        for module in component.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    if type(tensor.data) is not torch.Tensor:
                        return  # a tensor subclass: `.to` moves it (its wrapper and inner tensors together)
                    home = tensor.data.pin_memory() if self.device.type == "cuda" else tensor.data
                    tensor.data = home
                    homes.append((module, name, home))
        self.homes[id(component)] = homes

    def onload(self, component: torch.nn.Module) -> None:
        """`component` onto the device, the one there before back to its CPU copy."""
        if self.resident is component:
            return
        if self.resident is not None:
            self._move(self.resident, onto_device=False)
        self._move(component, onto_device=True)
        self.resident = component

    def release(self) -> None:
        """The component on the device back to the CPU (between requests: its copy is dropped, no transfer)."""
        if self.resident is not None:
            self._move(self.resident, onto_device=False)
            self.resident = None

    def _move(self, component: torch.nn.Module, onto_device: bool) -> None:
        homes = self.homes.get(id(component))
        if homes is None:
            component.to(self.device if onto_device else torch.device("cpu"))
            return
        for module, name, home in homes:
            tensor = module._parameters[name] if name in module._parameters else module._buffers[name]
            # From pinned memory the copy is asynchronous; the kernels that read it queue behind it on the stream.
            tensor.data = home.to(self.device, non_blocking=True) if onto_device else home


class ComponentOnload(ModelHook):
    """accelerate's hook on a component: its forward (and diffusers' `vae.decode`/`encode`, which call the hook's
    `pre_forward`) moves it onto the device first. `execution_device` is what diffusers' pipelines read as their
    device (`DiffusionPipeline._execution_device`)."""

    def __init__(self, offload: ModelOffload) -> None:
        super().__init__()
        self.offload = offload
        self.execution_device = offload.device

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.offload.onload(module)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def _resident_blocks(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """`count` of the blocks of `model`'s block lists (the ModuleList children group offloading streams), spread
    evenly over the forward's order."""
    blocks = [b for child in model.children() if isinstance(child, torch.nn.ModuleList) for b in child]
    total, count = len(blocks), min(count, len(blocks))
    return [block for i, block in enumerate(blocks) if (i + 1) * count // total > i * count // total]
