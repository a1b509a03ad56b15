"""What a rank lets a test reach into (`RankHooks`), and where a rank finds its hooks (`rank_hooks`).

Production code takes `hooks: RankHooks | None`; None is production, and every seam is a no-op then. The test
doubles (vllm_omni/testing/: injected faults, simulated graphs and device memory, a memory trace) implement the
Protocol; production never imports them. The seam is one environment variable, envs.TEST_HOOKS, naming a factory
as "module:function": the rank's entry point (worker.run_rank) imports it by that name, once per rank, and only
when it is set. The test suite sets it for every test (tests/conftest.py names vllm_omni.testing.hooks), so a
worker process, spawned or a Ray actor, builds its doubles from the same variables it always read.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Literal, Protocol

from vllm_omni import envs

if TYPE_CHECKING:
    from vllm_omni.diffusion.request import DiffusionRequest
    from vllm_omni.diffusion.worker.cuda_graphs import GraphBackend

# Where a request passes a hook point: the end of a denoising step, a tile of a split VAE decode, a token of a
# family's encode stage, the start of the text encoded once for an SP group, the merge of the request's adapter.
HookPoint = Literal["step", "decode", "encode", "text", "lora"]


class RankHooks(Protocol):
    """A rank's test seams, built once per rank."""

    def at(self, point: HookPoint, index: int, request: DiffusionRequest, cancelled: Callable[[], bool]) -> None:
        """The request passes `point` (its `index`-th: step, tile, token; 0 for text and lora); may raise, or block
        until `cancelled()`."""

    def request_extras(self, request: DiffusionRequest) -> dict[str, Any]:
        """Test-only figures for the request's Stats (`extras`), taken as it arrives, before it runs."""

    def graph_backend(self) -> GraphBackend | None:
        """What captures the denoisers' graphs instead of CUDA (on any device); None: CUDA's, on CUDA only."""

    def device_memory(self) -> tuple[int, int] | None:
        """(total, free) bytes of a device to plan and check allocations against instead of the rank's."""

    def measured_step_bytes(self, estimate: int) -> int | None:
        """A profile request's measured step where the runner measured none, given the plan's `estimate`."""


def rank_hooks(rank: int) -> RankHooks | None:
    """The hooks the factory named by envs.TEST_HOOKS builds for `rank`; None (production) when it is not set."""
    name = os.environ.get(envs.TEST_HOOKS)
    if not name:
        return None
    module, _, function = name.partition(":")
    factory: Callable[[int], RankHooks | None] = getattr(importlib.import_module(module), function)
    return factory(rank)
