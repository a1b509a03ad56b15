"""Decisions that change what a rank executes are taken by the whole group, over the CPU control group.

Runs in the 2- and 3-rank gloo pools (sp_pool): the agreement primitives, and the CUDA-graph
fallback, whose host-side decision is driven here with a capture that fails on one rank.
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.cuda_graphs import CUDAGraphForward, _Graph
from vllm_omni.diffusion.distributed.parallel_state import any_rank, every_rank, get_parallel_state


def agree(flags: list[bool]) -> tuple[bool, bool, bool]:
    state = get_parallel_state()
    flag = flags[state.rank]
    return any_rank(flag), every_rank(flag), state.control_group is not None


def test_any_rank_and_every_rank_give_every_rank_the_same_answer(sp_pool):
    n = sp_pool.world_size
    for flags in ([False] * n, [True] * n, [False] * (n - 1) + [True], [True] + [False] * (n - 1)):
        results = sp_pool.run(agree, flags)
        assert all(has_group for _, _, has_group in results)
        assert [(a, e) for a, e, _ in results] == [(any(flags), all(flags))] * n, flags


class _RecordedGraph:
    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    def replay(self) -> None:
        self.calls.append("replay")


def run_graphed_forward_twice(failing_rank: int | None) -> tuple[bool, list[str]]:
    """Two calls of a CUDAGraphForward whose capture fails on `failing_rank` (None: on no rank)."""
    rank = get_parallel_state().rank
    calls: list[str] = []

    def forward(**kwargs):
        calls.append("eager")
        return kwargs["hidden_states"] + 1

    def capture(kwargs):
        if rank == failing_rank:
            raise RuntimeError("operation not permitted when stream is capturing")
        return _Graph(_RecordedGraph(calls), {}, torch.zeros(2))

    graphed = CUDAGraphForward(forward)
    graphed._key = lambda kwargs: ("one shape",)  # CPU tensors stand in for CUDA ones
    graphed._capture = capture
    for _ in range(2):
        graphed(hidden_states=torch.ones(2))
    return graphed.disabled, calls


def test_a_capture_failure_on_one_rank_sends_every_rank_eager(sp_pool):
    last = sp_pool.world_size - 1
    # Ranks whose own capture worked run eagerly too, now and at the next call (no new capture).
    assert sp_pool.run(run_graphed_forward_twice, last) == [(True, ["eager", "eager"])] * sp_pool.world_size


def test_graphs_replay_when_every_rank_captured(sp_pool):
    assert sp_pool.run(run_graphed_forward_twice, None) == [(False, ["replay", "replay"])] * sp_pool.world_size
