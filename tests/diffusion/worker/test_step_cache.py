"""The step cache's decision is the group's (diffusion/worker/step_cache.py), in the 2- and 3-rank gloo pools.

Each rank holds its shard of a padded image stream, as a Ulysses rank does after `shard_with_auto_pad`.
The shards are built so that a rank deciding on its own shard, as diffusers' First-Block-Cache does,
would take the other branch than the group (under USP, the ring pools: a Ulysses group or a ring deciding
alone would too): the group's decision must be the one a single process
takes on the whole (unpadded) sequence, on every rank. Whole pipelines under SP, CFG parallel and
graphs: tests/entrypoints/test_omni_step_cache.py.
"""

from __future__ import annotations

import math

import pytest
import torch
from diffusers.hooks.first_block_cache import FBCSharedBlockState
from diffusers.hooks.hooks import CacheContext, StateManager

from vllm_omni.diffusion.config import StepCacheConfig
from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state
from vllm_omni.diffusion.distributed.sequence_parallel import IMAGE, sequence_parallel_context, shard_with_auto_pad
from vllm_omni.diffusion.worker.step_cache import (
    CacheRecord,
    GroupFirstBlockHook,
    relative_change,
    step_cache_line,
    step_cache_report,
)

TOKENS, WIDTH = 13, 4  # 13 tokens: padded at 2 and 3 ranks


def sequences(world: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(previous, current) residuals of the whole sequence: rank 0's tokens change a lot, the others' barely."""
    torch.manual_seed(0)
    previous = torch.randn(1, TOKENS, WIDTH, dtype=torch.float64)
    current = previous.clone()
    local = -(-TOKENS // world)
    current[:, :local] += 2.0 * previous[:, :local].abs()  # rank 0's shard
    current[:, local:] *= 1.001
    return previous, current


def decide(threshold: float, pad_value: float) -> dict:
    """This rank's decision on its shards, what its own shard alone says, and the group's change."""
    state = get_parallel_state()
    world = state.sp_world_size
    previous, current = sequences(world)
    record = CacheRecord(StepCacheConfig(threshold=threshold))
    manager = StateManager(FBCSharedBlockState)
    manager.set_context(CacheContext("cond"))
    hook = GroupFirstBlockHook(manager, record)
    with sequence_parallel_context() as ctx:
        prev_shard = shard_with_auto_pad(previous, 1, IMAGE)
        cur_shard = shard_with_auto_pad(current, 1, IMAGE)
        shard = ctx.streams[IMAGE]
        real = max(0, min(shard.local_seq_len, shard.original_seq_len - ctx.rank * shard.local_seq_len))
        cur_shard[:, real:] = pad_value  # what padding rows hold after a block: anything
        manager.get_state().head_block_residual = prev_shard
        computed = hook._should_compute_remaining_blocks(cur_shard)
        change = relative_change(cur_shard, prev_shard)
    own = (cur_shard[:, :real] - prev_shard[:, :real]).abs().sum() / prev_shard[:, :real].abs().sum()
    return {"computed": computed, "own": bool(own > threshold), "change": change, "record": record.summary()}


def whole_sequence_change(world: int) -> float:
    previous, current = sequences(world)
    return float((current - previous).abs().sum() / previous.abs().sum())


@pytest.mark.parametrize("pad_value", [0.0, 1e6])
def test_every_rank_takes_the_groups_branch_where_its_own_shard_would_take_the_other(sp_pool, pad_value):
    world = sp_pool.world_size
    expected = whole_sequence_change(world)
    # Just above the group's change: the group skips; rank 0 alone (its tokens changed a lot) would compute.
    threshold = expected * 1.01
    results = sp_pool.run(decide, threshold, pad_value)
    assert [r["computed"] for r in results] == [False] * world
    assert results[0]["own"] is True  # the constructed disagreement: rank 0 alone would have computed
    assert all(r["change"] == pytest.approx(expected, rel=1e-12) for r in results)  # padding rows never count
    assert all(r["record"]["decisions"] == {"cond": {0: False}} for r in results)
    assert all(r["record"]["changes"] == [pytest.approx(expected, rel=1e-12)] for r in results)
    # Just below it: the group computes; the other ranks alone (their tokens barely changed) would skip.
    results = sp_pool.run(decide, expected * 0.99, pad_value)
    assert [r["computed"] for r in results] == [True] * world
    assert all(r["own"] is False for r in results[1:])


def test_ring_and_ulysses_ranks_take_the_groups_branch(ring_pool):
    """The statistic sums over the whole SP group, Ulysses and ring ranks alike: at Ulysses 2 x ring 2, ranks 0
    and 1 (one Ulysses group, one ring block) alone would compute where the group skips."""
    world = ring_pool.world_size
    expected = whole_sequence_change(world)
    results = ring_pool.run(decide, expected * 1.01, 0.0)
    assert [r["computed"] for r in results] == [False] * world
    assert all(r["change"] == pytest.approx(expected, rel=1e-12) for r in results)
    results = ring_pool.run(decide, expected * 0.99, 1e6)
    assert [r["computed"] for r in results] == [True] * world


def test_the_report_merges_the_ranks_and_names_group_1s_branch():
    config = StepCacheConfig()
    group_0, group_1 = CacheRecord(config), CacheRecord(config)
    group_0.start_request(0.1, swapped=False)
    group_1.start_request(0.1, swapped=True)  # CFG parallel group 1: its "cond" context runs the negative prompt
    for step, (computed_0, computed_1) in enumerate([(True, True), (False, True), (True, False)]):
        group_0.add("cond", computed_0, 0.1 * step if step else math.inf)
        group_1.add("cond", computed_1, 0.3 * step if step else math.inf)
        group_0.end_step()
        group_1.end_step()
    report = step_cache_report("first_block", 0.1, [group_0.summary(), group_0.summary(), group_1.summary()])
    assert report == {
        "policy": "first_block",
        "threshold": 0.1,
        "forwards_computed": 4,
        "forwards_skipped": 2,
        "skipped_steps": {"cond": [1], "uncond": [2]},
        "median_change": 0.25,  # of 0.1, 0.2 (group 0, counted once), 0.3, 0.6 (group 1)
    }
    assert step_cache_line(report) == (
        "step cache first_block (threshold 0.1): 4 forward(s) computed, 2 skipped (steps cond [1], uncond [2])"
    )


@pytest.mark.parametrize("threshold", [0, -1, float("nan"), True, "0.1"])
def test_a_threshold_that_is_not_a_positive_number_is_refused_naming_it(threshold):
    with pytest.raises(ValueError, match="cache_threshold must be a number > 0"):
        StepCacheConfig(threshold=threshold)


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="cache must be one of first_block"):
        StepCacheConfig(policy="teacache")
