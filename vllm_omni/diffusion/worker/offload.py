"""CPU offload (`--cpu-offload`): diffusers' own mechanisms on a loaded pipeline; runner.py calls `apply_offload` once.

- model: one component (a text encoder, a denoiser, the VAE) on the GPU at a time, moved in when it is called
  (`ModelOffload`: accelerate's hook, placed as diffusers' `enable_model_cpu_offload` places it). Its weights wait
  in pinned CPU memory, and moving it out drops the GPU copy: served weights do not change, so nothing is copied
  back. diffusers' own copies them back with `.to("cpu")` into new pageable memory: 1.2 GB/s on an H100 against
  55 GB/s pinned (benchmarks/offload_copies.py; docs/serving.md has what it cost a request). Weights of a tensor
  subclass (torchao's FP8) wait with their parts pinned and move in part by part, as asynchronously. With two
  denoisers (two experts) the idle one waits: the other moves in once, at the boundary step. Each request
  reports the seconds its weights took to move in (`ModelOffload.moved`: the step log's `onload`).
- encoders: the same, but the denoisers stay on the GPU: only the text encoders and the VAE wait, and calling a
  denoiser moves the one that ran before out. Nothing moves during the denoising loop, so CUDA graphs stay.
- layerwise: diffusers' group offloading. A denoiser's repeated blocks wait in pinned CPU memory and move
  in one at a time (block level), the next prefetched on a side stream while this one runs (CUDA; a block's
  memory goes back to the allocator when the compute stream has passed it, `record_stream`); its other
  weights move in for its forward and out after. The other components are offloaded layer by layer (leaf
  level): the pipelines call their methods (`vae.decode`, not `forward`), which a block-level group's hook
  on the top module would never see. The memory plan's spare room keeps some of a denoiser's blocks on
  the GPU for good (`resident`, spread evenly: each streamed block's transfer overlaps the blocks before it):
  their group hooks are removed (diffusers has no option to leave blocks out of its groups).

Model and layerwise move weights between steps, so the runner captures no CUDA graphs under them; compiled blocks
stay (the hooks run outside the compiled block's forward). Under SP every rank offloads its own replica.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from accelerate.hooks import ModelHook, add_hook_to_module
from accelerate.utils import send_to_device

from vllm_omni.diffusion.worker.quantization import stored_bytes
from vllm_omni.logger import init_logger

logger = init_logger(__name__)
# What `cpu_offload="auto"` says it chose a placement for (worker.py): what did not fit, and what the placement does.
AUTO_PLACEMENT_REASONS = {
    "encoders": (
        "every weight resident",
        "the text encoders and the VAE wait in pinned CPU memory between their phases, the denoisers stay on the GPU "
        "(CUDA graphs too)",
    ),
    "model": (
        "the denoisers resident",
        "each component, each denoiser too (of two experts, the idle one waits), moves in from pinned memory for "
        "its phase",
    ),
    "layerwise": (
        "one whole component at a time",
        "the denoisers' blocks stream in from pinned memory at every step, the next prefetched beside the running one",
    ),
}
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
    if mode in ("model", "encoders"):
        model_offload = ModelOffload(device, stay=frozenset(denoisers) if mode == "encoders" else frozenset())
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
            # record_stream: a group leaving the GPU marks its weights as used by the compute stream, so the
            # allocator reuses them once that stream has passed. Without it diffusers waits on the host for the
            # compute stream at every group's end, and the GPU idles while the next group's kernels launch.
            stream = device.type == "cuda"
            apply_group_offloading(
                component, device, torch.device("cpu"), use_stream=stream, record_stream=stream, **level
            )
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
        raise ValueError(f"cpu_offload must be none, encoders, model or layerwise, got {mode!r}")
    logger.info("CPU offload %s: weights wait on the CPU between their phases; no CUDA graphs", mode)
    return model_offload


class ModelOffload:
    """`--cpu-offload model` and `encoders` (module doc): the component called last is on `device`, every other waits
    on the CPU, but for those named in `stay` (the denoisers, under encoders), which stay on `device`; calling one of
    them moves the other component out."""

    def __init__(self, device: torch.device, stay: frozenset[str] = frozenset()) -> None:
        self.device = device
        self.stay = stay
        self._staying: set[int] = set()  # id(component) of those in `stay`
        # id(component) -> (module, name, CPU home) of each of its parameters and buffers, pinned; a tensor subclass
        # (torchao's FP8) is pinned part by part and its home is the Parameter itself (`_pinned`).
        self.homes: dict[int, list[tuple[torch.nn.Module, str, torch.Tensor]]] = {}
        self.resident: torch.nn.Module | None = None
        self.names: dict[int, str] = {}  # id(component) -> its name in the pipeline
        self._moves: list[tuple[str, int, Any, Any]] = []  # (component, bytes, start, end event) of each move in
        self.last_moves: dict[str, tuple[int, float]] = {}  # component -> (bytes, seconds) moved in, as of `moved()`

    def install(self, pipe: Any) -> None:
        for name, component in pipe.components.items():
            if not isinstance(component, torch.nn.Module):
                continue
            self.names[id(component)] = name
            if name in self.stay:
                component.to(self.device)
                self._staying.add(id(component))
            else:
                component.to("cpu")
                self._pin(component)
            # Every component hooked, the staying ones too: diffusers' pipelines read their device off the hooks.
            add_hook_to_module(component, ComponentOnload(self), append=True)

    def _pin(self, component: torch.nn.Module) -> None:
        homes = []
        for module in component.modules():
            for table in (module._parameters, module._buffers):
                for name, tensor in table.items():
                    if tensor is None:
                        continue
                    if type(tensor.data) is torch.Tensor:
                        home = tensor.data = self._pinned(tensor.data)
                    else:  # a tensor subclass: its parts pinned, the Parameter (or buffer) itself the home
                        home = table[name] = _as_held(tensor, _rebuilt(tensor.data, self._pinned))
                    homes.append((module, name, home))
        self.homes[id(component)] = homes

    def _pinned(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.pin_memory() if self.device.type == "cuda" else tensor

    def onload(self, component: torch.nn.Module) -> None:
        """`component` onto the device, the one there before back to its CPU copy (a staying component stays)."""
        if self.resident is component:
            return
        if self.resident is not None:
            self._move(self.resident, onto_device=False)
            self.resident = None
        if id(component) not in self._staying:
            self._move(component, onto_device=True)
            self.resident = component

    def release(self) -> None:
        """The component on the device back to the CPU (between requests: its copy is dropped, no transfer)."""
        if self.resident is not None:
            self._move(self.resident, onto_device=False)
            self.resident = None

    def moved(self) -> tuple[int, float]:
        """(bytes, seconds) of the weights moved onto the device since the last call: the copies' time on the stream
        that waits for them (CUDA events; the request's denoising or decode waits that long)."""
        moves, self._moves = self._moves, []
        self.last_moves = {}
        if moves:
            moves[-1][3].synchronize()
        for name, count, start, end in moves:
            before = self.last_moves.get(name, (0, 0.0))
            self.last_moves[name] = (before[0] + count, before[1] + start.elapsed_time(end) / 1e3)
        return sum(m[0] for m in self.last_moves.values()), sum(m[1] for m in self.last_moves.values())

    def _move(self, component: torch.nn.Module, onto_device: bool) -> None:
        timed = onto_device and self.device.type == "cuda"
        if timed:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        moved = 0
        for module, name, home in self.homes[id(component)]:
            table = module._parameters if name in module._parameters else module._buffers
            # From pinned memory the copy is asynchronous; the kernels that read it queue behind it on the stream.
            # Out: the CPU home again, the device copy dropped.
            if type(home.data) is torch.Tensor:
                table[name].data = home.to(self.device, non_blocking=True) if onto_device else home
            else:
                to_device = lambda part: part.to(self.device, non_blocking=True)  # noqa: E731
                table[name] = _as_held(home, _rebuilt(home.data, to_device)) if onto_device else home
            moved += stored_bytes(home)
        if timed:
            end.record()
            self._moves.append((self.names.get(id(component), "?"), moved, start, end))


class ComponentOnload(ModelHook):
    """accelerate's hook on a component: its forward (and diffusers' `vae.decode`/`encode`, which call the hook's
    `pre_forward`) moves it onto the device first. `execution_device` is what diffusers' pipelines read as their
    device (a pipeline's own `_execution_device` looks for it)."""

    def __init__(self, offload: ModelOffload) -> None:
        super().__init__()
        self.offload = offload
        self.execution_device = offload.device

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
        self.offload.onload(module)
        return send_to_device(args, self.execution_device), send_to_device(kwargs, self.execution_device)


def _rebuilt(tensor: torch.Tensor, leaf: Callable[[torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """`leaf` of a plain tensor; a tensor subclass (torchao's FP8: data and scales, `__tensor_flatten__`) rebuilt from
    `leaf` of each of its parts, so that it pins and moves in as asynchronously as a plain weight."""
    if type(tensor) is torch.Tensor:
        return leaf(tensor)
    names, context = tensor.__tensor_flatten__()
    parts = {name: _rebuilt(getattr(tensor, name), leaf) for name in names}
    return type(tensor).__tensor_unflatten__(parts, context, tensor.size(), tensor.stride())


def _as_held(old: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """`tensor` held as `old` was: a Parameter (not trained: requires no grad) or a buffer."""
    return torch.nn.Parameter(tensor, requires_grad=False) if isinstance(old, torch.nn.Parameter) else tensor


def _resident_blocks(model: torch.nn.Module, count: int) -> list[torch.nn.Module]:
    """`count` of the blocks of `model`'s block lists (the ModuleList children group offloading streams), spread
    evenly over the forward's order."""
    blocks = [b for child in model.children() if isinstance(child, torch.nn.ModuleList) for b in child]
    total, count = len(blocks), min(count, len(blocks))
    return [block for i, block in enumerate(blocks) if (i + 1) * count // total > i * count // total]
