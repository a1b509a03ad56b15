"""Simulated CUDA graphs: the graph decisions of worker/cuda_graphs.py on CPU ranks (a test double).

Switched on by `VLLM_OMNI_TEST_CUDA_GRAPHS=simulate` in the workers' environment (testing/hooks.py hands it to the
runner as CUDAGraphForward's capture backend): the same keys, cache and SP-group agreement as real graphs, with a
"graph" that re-runs the forward on its static inputs at each replay; `simulate:fail-rank=N` makes the first
capture on rank N fail. CI uses it (tests/entrypoints/test_omni_graph_decisions.py) for what only
multi-GPU runs reach.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni import envs
from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state
from vllm_omni.diffusion.distributed.sequence_parallel import fresh_sp_context
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

TEST_GRAPHS_ENV = envs.TEST_CUDA_GRAPHS


class SimulatedGraph:
    """Replays by running the forward again on the captured call's static inputs, into its output."""

    def __init__(self, forward: Callable[..., torch.Tensor], call: dict[str, Any], output: torch.Tensor) -> None:
        self.forward, self.call, self.output = forward, call, output

    def replay(self) -> None:
        with fresh_sp_context():
            self.output.copy_(self.forward(**self.call))


@dataclass(frozen=True)
class SimulatedGraphs:
    """Stands in for CUDA graph capture in CUDAGraphForward (its `backend`: cuda_graphs.GraphBackend), on CPU ranks."""

    fail_rank: int | None = None  # the first capture on this rank raises
    replays_cpu_tensors = True  # CPU ranks: their tensors are the graph's inputs

    @classmethod
    def from_env(cls) -> SimulatedGraphs | None:
        text = os.environ.get(TEST_GRAPHS_ENV, "")
        if not text:
            return None
        mode, _, option = text.partition(":")
        if mode != "simulate" or (option and not option.startswith("fail-rank=")):
            raise ValueError(f"{TEST_GRAPHS_ENV} must be 'simulate' or 'simulate:fail-rank=N', got {text!r}")
        return cls(int(option.removeprefix("fail-rank=")) if option else None)

    def capture(
        self, forward: Callable[..., torch.Tensor], call: dict[str, Any], captures: int, shapes: Any
    ) -> tuple[SimulatedGraph, torch.Tensor]:
        """A "capture" of `forward(**call)`, the wrapper's `captures`-th: the graph and its output."""
        state = get_parallel_state()
        rank = state.rank if state is not None else 0
        with fresh_sp_context():
            output = forward(**call)
        # It fails after the forward, as a real capture does: its peers went through the collectives too.
        if self.fail_rank == rank and captures == 1:
            raise RuntimeError(f"simulated capture failure on rank {rank} ({TEST_GRAPHS_ENV})")
        logger.info("Rank %d: simulated CUDA graph capture %d (%s)", rank, captures, shapes)
        return SimulatedGraph(forward, call, output), output
