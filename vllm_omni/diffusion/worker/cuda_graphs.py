"""CUDA graphs for a denoiser's sharded forward (`CUDAGraphForward`) and regional compilation.

The forward chain (forward_chain.py) wraps each denoiser's `forward_sharded` in a
`CUDAGraphForward`: at Ulysses 2 and above a rank's GPU work per layer shrinks but the host still
launches the same kernels, so eager PyTorch becomes bound by launch time; a denoising loop calls the
transformer with the same shapes at every step, so the forward is captured once per shape (the
all-to-alls included) and replayed. The model's `forward` does the host-side preparation before it.
The wrapped function must not synchronise with the host or copy from host memory; calls it cannot
replay (CPU tensors, tensors inside lists such as ControlNet residuals) run eagerly. Whether graphs
are used at all is decided by the ranks that share the graph, the SP group (`every_sp_rank`): a
failed capture on any of them makes all of them eager for the life of the group (logged with its
reason and reported, see `on_failure`); a restarted group captures again.

A captured graph owns every tensor it reads: tensors are either arguments (copied into the
graph's static inputs) or built inside the capture, in its memory pool. So the warm-up run and
the capture each open a fresh SP context (the padding mask is built within the capture, not
cached from the warm-up), and a model computes tables that live in an evicting cache (rotary
tables) before the graphed function and passes them in.

What captures a graph is the wrapper's `backend` (`GraphBackend`): CUDA's (`CUDAGraphs`), or one a rank's hooks
supply (worker/hooks.py; the tests' simulated graphs on CPU ranks).
"""

from __future__ import annotations

import os
from collections import OrderedDict
from collections.abc import Callable, Hashable
from pathlib import Path
from typing import Any, Protocol

import torch

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.attention.backends import attention_precision
from vllm_omni.diffusion.distributed.parallel_state import every_sp_rank, get_parallel_state
from vllm_omni.diffusion.distributed.sequence_parallel import fresh_sp_context
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def compile_repeated_blocks(model: torch.nn.Module, backend: str = "inductor") -> int:
    """torch.compile each repeated transformer block (diffusers' `_repeated_blocks`); returns how many.

    Regional compilation: one block class compiles once and every block reuses it, far sooner
    than a whole-model compile. Inside a block, the unfused elementwise work (norms, modulation,
    gating, GELU, casts) fuses into few kernels. The shared attention layer is excluded from
    compilation (attention/layer.py), so the all-to-alls and the padding policy run as written. A
    size the block has not seen recompiles once with a dynamic sequence length, then reuses it.
    Inductor keeps its compiled kernels on disk (TORCHINDUCTOR_CACHE_DIR, default under
    ~/.cache/vllm_omni), so a restart reuses them.
    """
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path("~/.cache/vllm_omni/inductor").expanduser()))
    names = diffusers_compat.repeated_block_names(model)
    compiled = 0
    for module in model.modules():
        if type(module).__name__ in names:
            # The block's own forward, not its __call__: hooks registered on the block afterwards (the step
            # cache's, step_cache.py) wrap the compiled function and run outside it, so their state (cache
            # contexts, decisions) never becomes a guard that recompiles the block.
            module.forward = torch.compile(module.forward, fullgraph=False, backend=backend)
            compiled += 1
    logger.info(
        "Compiling %d repeated block(s) of %s (first forward of each shape compiles)", compiled, type(model).__name__
    )
    return compiled


class Replayable(Protocol):
    def replay(self) -> None: ...


class GraphBackend(Protocol):
    """What captures a call of the wrapped function into a graph that can be replayed."""

    replays_cpu_tensors: bool  # whether a call with CPU tensors is captured (else it runs eagerly)

    def capture(
        self, forward: Callable[..., torch.Tensor], call: dict[str, Any], captures: int, shapes: Any
    ) -> tuple[Replayable, torch.Tensor]:
        """`forward(**call)` captured (the wrapper's `captures`-th, of tensors `shapes`): the graph and its output,
        which each replay overwrites. May raise: the SP group then runs eagerly."""
        ...


class CUDAGraphs:
    """CUDA graph capture; the graphs of one backend share a memory pool (they replay one at a time)."""

    replays_cpu_tensors = False

    def __init__(self) -> None:
        self.pool: Any = None  # made at the first capture

    def capture(
        self, forward: Callable[..., torch.Tensor], call: dict[str, Any], captures: int, shapes: Any
    ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        # Warm up on a side stream (lazy inits, caches, NCCL communicators), then capture. Each run
        # opens its own SP context, so what the capture reads of it (the padding mask) is built in
        # the graph's pool rather than kept from the warm-up's allocations.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), fresh_sp_context():
            forward(**call)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        if self.pool is None:
            self.pool = torch.cuda.graph_pool_handle()
        with torch.cuda.graph(graph, pool=self.pool), fresh_sp_context():
            output = forward(**call)
        logger.debug("Captured a CUDA graph for the transformer: %s", shapes)
        return graph, output


class _Graph:
    def __init__(self, graph: Replayable, inputs: dict[str, torch.Tensor], output: torch.Tensor):
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
    `on_failure(reason)` is called on the rank whose own capture failed. `backend` captures (None: CUDA
    graphs of its own); graphs replay one at a time and their outputs are cloned, so wrappers of one pipeline
    can share one backend and its memory pool.
    """

    def __init__(
        self,
        forward: Callable[..., torch.Tensor],
        max_graphs: int = 8,
        on_failure: Callable[[str], None] | None = None,
        backend: GraphBackend | None = None,
    ) -> None:
        self.eager = forward  # the wrapped function, run eagerly where a call cannot replay
        self.max_graphs = max_graphs
        self.on_failure = on_failure
        self.backend = backend if backend is not None else CUDAGraphs()
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.disabled = False
        self.captures = 0

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        if self.disabled:
            return self.eager(**kwargs)
        try:
            key = self._key(kwargs, allow_cpu=self.backend.replays_cpu_tensors)
        except _NotReplayable:
            return self.eager(**kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(kwargs)
            except Exception as exc:  # noqa: BLE001 - fall back to eager rather than fail the request
                reason = f"{type(exc).__name__}: {exc}"
                logger.warning("CUDA graph capture failed on this rank (%s)", reason)
                if self.on_failure is not None:
                    self.on_failure(reason)
            # The SP group's ranks capture together, since a graph holds their all-to-alls; one failure
            # sends all of them eager for the group's life. A rank alone on the eager path would run
            # collectives its peers only replay, and the group would deadlock.
            if not every_sp_rank(entry is not None):
                logger.warning(
                    "CUDA graph capture failed on a rank of this SP group: its ranks run the transformer "
                    "eagerly until the worker group restarts"
                )
                self.disabled = True
                self.graphs.clear()
                return self.eager(**kwargs)
            self.graphs[key] = entry
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        for name, static in entry.inputs.items():
            static.copy_(kwargs[name])
        entry.graph.replay()
        return entry.output.clone()

    def key(self, kwargs: dict[str, Any]) -> tuple | None:
        """The graph a call with `kwargs` replays (its key in `graphs`); None for a call that runs eagerly."""
        try:
            return self._key(kwargs, allow_cpu=self.backend.replays_cpu_tensors)
        except _NotReplayable:
            return None

    @staticmethod
    def _key(kwargs: dict[str, Any], allow_cpu: bool = False) -> tuple:
        """Shapes and dtypes of the tensor arguments, the other arguments' values, the SP layout, the attention
        precision.

        Raises _NotReplayable for a call that must run eagerly.
        """
        tensors, values = [], []
        for name, value in sorted(kwargs.items()):
            if isinstance(value, torch.Tensor):
                if not (value.is_cuda or allow_cpu):
                    raise _NotReplayable(f"{name} is on {value.device}")
                tensors.append((name, tuple(value.shape), value.dtype, value.device.index))
            else:
                values.append((name, _static_value(value)))
        state = get_parallel_state()
        parallel = (state.sp_world_size, state.config.padding_mode) if state else None
        # A graph holds the attention kernel it captured: FP8 and exact steps (backends.py's rule) replay their own.
        return tuple(tensors), tuple(values), parallel, attention_precision()

    def _capture(self, kwargs: dict[str, Any]) -> _Graph:
        inputs = {name: value.clone() for name, value in kwargs.items() if isinstance(value, torch.Tensor)}
        call = dict(kwargs, **inputs)
        self.captures += 1
        shapes = self._key(call, allow_cpu=True)[0]
        graph, output = self.backend.capture(self.eager, call, self.captures, shapes)
        return _Graph(graph, inputs, output)
