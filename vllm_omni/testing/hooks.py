"""The test doubles of one rank as one `RankHooks` (diffusion/worker/hooks.py), built from the environment.

`rank_hooks` is the factory envs.TEST_HOOKS names (tests/conftest.py sets it to FACTORY for the whole suite):
the worker calls it once per rank. It returns None where no double is switched on, so the rank runs as in
production. Each double keeps its own variable and module: faults.py (VLLM_OMNI_TEST_FAULT), memory_trace.py
(VLLM_OMNI_TEST_MEMORY_TRACE), graphs.py (VLLM_OMNI_TEST_CUDA_GRAPHS), memory.py (VLLM_OMNI_TEST_GPU_MEMORY,
VLLM_OMNI_TEST_MEASURED_STEP).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.worker.hooks import HookPoint
from vllm_omni.testing.faults import InjectedFault
from vllm_omni.testing.graphs import SimulatedGraphs
from vllm_omni.testing.memory import simulated_device_memory, simulated_step_factor
from vllm_omni.testing.memory_trace import MemoryTrace

FACTORY = f"{__name__}:rank_hooks"
MEMORY_TRACE = "memory_trace"  # the key of MemoryTrace's figures in Stats.extras


@dataclass
class TestHooks:
    """One rank's doubles; each left out (empty, None) does nothing."""

    __test__ = False  # not a pytest test class

    rank: int
    faults: list[InjectedFault]
    trace: MemoryTrace | None = None
    graphs: SimulatedGraphs | None = None
    memory: tuple[int, int] | None = None
    step_factor: float | None = None  # a measured step is this many times the plan's estimate

    def at(self, point: HookPoint, index: int, request: DiffusionRequest, cancelled: Callable[[], bool]) -> None:
        for fault in self.faults:
            fault.trigger(self.rank, index, request, point, cancelled)

    def request_extras(self, request: DiffusionRequest) -> dict[str, Any]:
        traced = self.trace.measure(request) if self.trace is not None else None
        return {} if traced is None else {MEMORY_TRACE: traced}

    def graph_backend(self) -> SimulatedGraphs | None:
        return self.graphs

    def device_memory(self) -> tuple[int, int] | None:
        return self.memory

    def measured_step_bytes(self, estimate: int) -> int | None:
        return None if self.step_factor is None else int(self.step_factor * estimate)


def rank_hooks(rank: int) -> TestHooks | None:
    """The doubles the environment switches on for `rank`; None where it switches on none."""
    hooks = TestHooks(
        rank,
        InjectedFault.from_env(),
        MemoryTrace.from_env(),
        SimulatedGraphs.from_env(),
        simulated_device_memory(),
        simulated_step_factor(),
    )
    doubles = (hooks.trace, hooks.graphs, hooks.memory, hooks.step_factor)
    return hooks if hooks.faults or any(double is not None for double in doubles) else None
