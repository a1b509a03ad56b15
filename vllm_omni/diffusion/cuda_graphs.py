"""Replays a transformer's forward as a CUDA graph, one graph per input shape.

At Ulysses 2 and above a rank's GPU work per layer shrinks but the host still launches the
same ~200 kernels per layer, so eager PyTorch becomes bound by launch time (measured on an
H200: Qwen-Image U2 at 1328x1328 took 188 ms eagerly, about what the host needs to launch it).
A denoising loop calls the transformer with the same shapes at every step, so the runner
captures the forward once per shape (the all-to-alls included) and replays it.

The runner wraps each transformer's `forward_sharded` (the per-step work on a rank's shards,
keyword arguments only, one tensor out); the model's `forward` does the host-side preparation
(text-mask compaction, say) before it. The wrapped function must not synchronise with the
host or copy from host memory; calls it cannot replay (CPU tensors, tensors inside lists such
as ControlNet residuals) run eagerly. Whether graphs are used at all is decided by the whole
group: a failed capture on any rank makes every rank eager.
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any

import torch

from vllm_omni.diffusion.distributed.parallel_state import every_rank, get_parallel_state
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def compile_repeated_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """torch.compile each repeated transformer block (diffusers' `_repeated_blocks`); returns how many.

    Regional compilation: one block class compiles once and every block reuses it, in seconds
    rather than the minutes a whole-model compile takes. Inside a block, the unfused elementwise
    work (norms, modulation, gating, GELU, casts: a third of eager GPU time) fuses into few
    kernels. The shared attention layer is excluded from compilation (attention/layer.py), so the
    all-to-alls and the padding policy run as written. A size the block has not seen recompiles
    once with a dynamic sequence length, then reuses it. Inductor keeps its compiled kernels on
    disk (TORCHINDUCTOR_CACHE_DIR, default under ~/.cache/vllm_omni), so a restart reuses them.
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("~/.cache/vllm_omni/inductor").expanduser()))
    names = set(getattr(model, "_repeated_blocks", None) or ())
    compiled = 0
    for module in model.modules():
        if type(module).__name__ in names:
            module.compile(fullgraph=False, backend=backend)
            compiled += 1
    logger.info(
        "Compiling %d repeated block(s) of %s (first forward of each shape compiles)", compiled, type(model).__name__
    )
    return compiled


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict[str, torch.Tensor], output: torch.Tensor):
        self.graph, self.inputs, self.output = graph, inputs, output


class _NotReplayable(Exception):
    pass


def _static_value(value: Any) -> Hashable:
    """A hashable stand-in for a non-tensor argument; the graph is only valid for this exact value.

    Tensors inside containers (ControlNet residual lists, say) and arbitrary objects cannot be
    copied into a captured graph, so calls carrying them run eagerly.
    """
    if value is None or isinstance(value, (bool, int, float, str, torch.dtype)):
        return value
    if isinstance(value, (list, tuple)):
        return (type(value).__name__, tuple(_static_value(v) for v in value))
    if isinstance(value, dict) and not value:
        return "{}"
    raise _NotReplayable(type(value).__name__)


class CUDAGraphForward:
    """Drop-in for a function called with keyword arguments that returns one tensor.

    Every tensor argument, whatever its name, becomes a static input of the graph, copied in
    before each replay; every other argument is part of the graph's key. A call the graph
    cannot replay (a CPU tensor, tensors inside a container, an object) runs eagerly.
    """

    def __init__(self, forward: Callable[..., torch.Tensor], max_graphs: int = 8) -> None:
        self.forward = forward
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.pool = None
        self.disabled = False

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        if self.disabled:
            return self.forward(**kwargs)
        try:
            key = self._key(kwargs)
        except _NotReplayable:
            return self.forward(**kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(kwargs)
            except Exception as exc:  # noqa: BLE001 - fall back to eager rather than fail the request
                logger.warning("CUDA graph capture failed on this rank (%s: %s)", type(exc).__name__, exc)
            # Every rank captures; one failure sends every rank eager for good. A rank alone on the eager
            # path would run collectives its peers only replay, and the group would deadlock.
            if not every_rank(entry is not None):
                logger.warning("CUDA graph capture failed on a rank: every rank runs the transformer eagerly")
                self.disabled = True
                self.graphs.clear()
                return self.forward(**kwargs)
            self.graphs[key] = entry
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        for name, static in entry.inputs.items():
            static.copy_(kwargs[name])
        entry.graph.replay()
        return entry.output.clone()

    @staticmethod
    def _key(kwargs: dict[str, Any]) -> tuple:
        """Shapes and dtypes of the tensor arguments, the other arguments' values, the SP layout.

        Raises _NotReplayable for a call that must run eagerly.
        """
        tensors, values = [], []
        for name, value in sorted(kwargs.items()):
            if isinstance(value, torch.Tensor):
                if not value.is_cuda:
                    raise _NotReplayable(f"{name} is on {value.device}")
                tensors.append((name, tuple(value.shape), value.dtype, value.device.index))
            else:
                values.append((name, _static_value(value)))
        state = get_parallel_state()
        parallel = (state.sp_world_size, state.config.padding_mode) if state else None
        return tuple(tensors), tuple(values), parallel

    def _capture(self, kwargs: dict[str, Any]) -> _Graph:
        inputs = {name: value.clone() for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        call = dict(kwargs, **inputs)
        # Warm up on a side stream (lazy inits, caches, NCCL communicators), then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.forward(**call)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()  # graphs replay one at a time: share memory
        with torch.cuda.graph(graph, pool=self.pool):
            output = self.forward(**call)
        logger.debug("Captured a CUDA graph for the transformer: %s", self._key(kwargs)[0])
        return _Graph(graph, inputs, output)
