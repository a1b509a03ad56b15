"""Replays a transformer's forward as a CUDA graph, one graph per input shape.

At Ulysses 2 and above a rank's GPU work per layer shrinks but the host still launches the
same ~200 kernels per layer, so eager PyTorch becomes bound by launch time (measured on an
H200: Qwen-Image U2 at 1328x1328 took 188 ms eagerly, about what the host needs to launch it).
A denoising loop calls the transformer with the same shapes at every step, so the runner
captures the forward once per shape (the all-to-alls included) and replays it.

The wrapped forward must not synchronise with the host or copy from host memory; calls it
cannot replay (a text mask, ControlNet residuals, CPU tensors) run eagerly.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import torch

from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

_TENSOR_INPUTS = ("hidden_states", "encoder_hidden_states", "timestep", "guidance", "additional_t_cond")


class _Graph:
    def __init__(self, graph: torch.cuda.CUDAGraph, inputs: dict[str, torch.Tensor], output: torch.Tensor):
        self.graph, self.inputs, self.output = graph, inputs, output


class CUDAGraphForward:
    """Drop-in for `model.forward` (diffusers calling convention: keyword arguments, tuple output)."""

    def __init__(self, forward, max_graphs: int = 8) -> None:
        self.forward = forward
        self.max_graphs = max_graphs
        self.graphs: OrderedDict[tuple, _Graph] = OrderedDict()
        self.pool = None
        self.disabled = False

    def __call__(self, **kwargs: Any):
        if self.disabled or not self._replayable(kwargs):
            return self.forward(**kwargs)
        key = self._key(kwargs)
        entry = self.graphs.get(key)
        if entry is None:
            try:
                entry = self._capture(kwargs)
            except Exception as exc:  # noqa: BLE001 - fall back to eager rather than fail the request
                logger.warning(
                    "CUDA graph capture failed (%s: %s); running the transformer eagerly", type(exc).__name__, exc
                )
                self.disabled = True
                return self.forward(**kwargs)
            self.graphs[key] = entry
            if len(self.graphs) > self.max_graphs:
                self.graphs.popitem(last=False)
        else:
            self.graphs.move_to_end(key)
        for name, static in entry.inputs.items():
            static.copy_(kwargs[name])
        entry.graph.replay()
        output = entry.output.clone()
        if kwargs.get("return_dict", True):
            from diffusers.models.modeling_outputs import Transformer2DModelOutput

            return Transformer2DModelOutput(sample=output)
        return (output,)

    @staticmethod
    def _replayable(kwargs: dict[str, Any]) -> bool:
        hidden = kwargs.get("hidden_states")
        return (
            isinstance(hidden, torch.Tensor)
            and hidden.is_cuda
            and kwargs.get("encoder_hidden_states_mask") is None
            and kwargs.get("controlnet_block_samples") is None
            and not kwargs.get("attention_kwargs")
        )

    @staticmethod
    def _key(kwargs: dict[str, Any]) -> tuple:
        state = get_parallel_state()
        shapes = tuple(
            (name, tuple(kwargs[name].shape), kwargs[name].dtype)
            for name in _TENSOR_INPUTS
            if isinstance(kwargs.get(name), torch.Tensor)
        )
        parallel = (state.sp_world_size, state.config.padding_mode) if state else None
        return shapes, repr(kwargs.get("img_shapes")), parallel

    def _capture(self, kwargs: dict[str, Any]) -> _Graph:
        inputs = {name: kwargs[name].clone() for name in _TENSOR_INPUTS if isinstance(kwargs.get(name), torch.Tensor)}
        call = dict(kwargs, **inputs, return_dict=False)
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
            output = self.forward(**call)[0]
        logger.info("Captured a CUDA graph for the transformer: %s", self._key(kwargs)[0])
        return _Graph(graph, inputs, output)
