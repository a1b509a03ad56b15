"""Decisions that change what a rank executes are taken by the whole group, over the CPU control group.

Runs in the 2- and 3-rank gloo pools (sp_pool, one SP group) and the ring pools (ring_pool: ring 2,
ring 3, Ulysses 2 x ring 2, whose SP group holds two Ulysses groups and two rings): the agreement
primitives, and the CUDA-graph fallback through the simulated graphs (VLLM_OMNI_TEST_CUDA_GRAPHS' code
path), with a capture that fails on one rank. Under USP the failing rank is the last, in the other
Ulysses group than rank 0 and on the other ring rank: were the decision taken over the Ulysses group
or the ring alone, rank 0 would replay a graph whose ring passes its peer never joins. The CFG-parallel
case, two SP groups that must not meet in the capture decision, runs through whole engines in
tests/entrypoints/test_omni_graph_decisions.py.
"""

from __future__ import annotations

import torch

from vllm_omni.diffusion.distributed.parallel_state import any_rank, every_rank, get_parallel_state
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward
from vllm_omni.testing.graphs import SimulatedGraphs


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


def run_graphed_forward_twice(failing_rank: int | None) -> tuple[bool, int, list[str], list[bool]]:
    """Two calls of a simulated-graph CUDAGraphForward whose first capture fails on `failing_rank`."""
    calls: list[str] = []
    failures: list[str] = []

    def forward(*, hidden_states):
        calls.append("run")
        return hidden_states + 1

    graphed = CUDAGraphForward(forward, on_failure=failures.append, backend=SimulatedGraphs(failing_rank))
    outputs = [graphed(hidden_states=torch.full((2,), float(i))) for i in range(2)]
    correct = [torch.equal(out, torch.full((2,), i + 1.0)) for i, out in enumerate(outputs)]
    return graphed.disabled, len(failures), calls, correct


def test_a_capture_failure_on_one_rank_sends_every_rank_of_the_sp_group_eager(sp_pool):
    last = sp_pool.world_size - 1
    results = sp_pool.run(run_graphed_forward_twice, last)
    # The failing rank reports its reason once; every rank runs eagerly now and at the next call.
    assert [failures for _, failures, _, _ in results] == [0] * last + [1]
    assert all(disabled and correct == [True, True] for disabled, _, _, correct in results)
    # Every rank ran the capture (1; the failure comes at its end, as on a GPU), then eagerly (2),
    # and the second call eagerly (3): no new capture.
    assert [len(calls) for _, _, calls, _ in results] == [3] * sp_pool.world_size


def test_graphs_replay_when_every_rank_captured(sp_pool):
    for disabled, failures, calls, correct in sp_pool.run(run_graphed_forward_twice, None):
        # A capture (1 run) and a replay of it per call (2 runs): the replay reads the new input.
        assert (disabled, failures, len(calls), correct) == (False, 0, 3, [True, True])


def test_ring_ranks_agree_with_the_ulysses_ranks(ring_pool):
    """Cancel (any_rank over the world) and the graph fallback (every_sp_rank over the SP group) under USP."""
    n = ring_pool.world_size
    for flags in ([False] * (n - 1) + [True], [True] + [False] * (n - 1)):
        assert [(a, e) for a, e, _ in ring_pool.run(agree, flags)] == [(any(flags), all(flags))] * n, flags
    results = ring_pool.run(run_graphed_forward_twice, n - 1)
    assert [failures for _, failures, _, _ in results] == [0] * (n - 1) + [1]
    assert all(disabled and correct == [True, True] for disabled, _, _, correct in results)
    assert [len(calls) for _, _, calls, _ in results] == [3] * n
