"""Interleaving (--max-num-seqs above 1 with the fair or priority policy), end to end on CPU ranks over gloo.

A request that the policy puts before the running one runs inside it, from the running one's next step, and the
running one goes on after it: the short or urgent one finishes first, and both images equal their runs alone,
exactly (fp32, the same engine). Tiny Qwen-Image at 208x272 (221 image tokens: padded at Ulysses 2), true CFG.
The long request has 40 steps and the other is sent once the long one has done 2, so the workers take it
dozens of steps before the long one ends, however slow the machine.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import replace

import numpy as np
import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.engine.job import Job  # noqa: E402
from vllm_omni.diffusion.engine.policy import QueuePolicy  # noqa: E402
from vllm_omni.diffusion.request import GenerationParams  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

MODEL = "tiny/qwen-image"
LONG_STEPS = 40
HANG_PROMPT = "rank 1 hangs inside another request"
STALL_S = 4.0


def _params(prompt: str, steps: int, seed: int, **fields) -> GenerationParams:
    fields = dict(negative_prompt="blurry", true_cfg_scale=4.0) | fields
    return GenerationParams(
        prompt, height=208, width=272, num_inference_steps=steps, seed=seed, output_type="np", **fields
    )


LONG = _params("a lighthouse on a cliff at dusk, long exposure", LONG_STEPS, 7)
SHORT = _params("a cat", 8, 11)


def _submit(omni: Omni, params: GenerationParams) -> Job:
    return omni._call(omni.scheduler.submit(params))


def _wait(omni: Omni, job: Job) -> Job:
    return omni._call(job.wait())


def _progressed(job: Job, percent: int, timeout: float = 120) -> None:
    """Until `job` has done `percent` of its steps (polled: the scheduler's progress is what the policy reads)."""
    until = time.monotonic() + timeout
    while job.progress < percent or job.status != "in_progress":
        assert time.monotonic() < until and not job.finished, f"{job.id} never reached {percent}% ({job.status})"
        time.sleep(0.01)


def _alone(omni: Omni, params: GenerationParams) -> tuple[np.ndarray, dict | None]:
    job = _wait(omni, _submit(omni, params))
    assert job.status == "completed", job.error
    return np.stack(job.result.images), job.result.step_cache


def _one_inside_the_other(omni: Omni, outer: GenerationParams, inner: GenerationParams) -> tuple[Job, Job]:
    first = _submit(omni, outer)
    _progressed(first, 5)  # 2 of 40 steps
    second = _submit(omni, inner)
    return _wait(omni, first), _wait(omni, second)


@pytest.fixture(scope="module")
def fair():
    """Ulysses 2 with the step cache (its per-context states must not mix) and the default policy, fair."""
    with Omni(MODEL, ulysses_degree=2, cache="first_block", cache_threshold=0.55, max_num_seqs=4) as omni:
        assert omni.scheduler.policy.name == "fair"
        yield omni


def test_fair_runs_a_short_request_inside_a_long_one_and_both_equal_their_runs_alone(fair):
    alone = {params.prompt: _alone(fair, params) for params in (LONG, SHORT)}
    long, short = _one_inside_the_other(fair, LONG, SHORT)
    assert long.status == short.status == "completed"
    assert short.completed_at < long.completed_at  # one replica: only interleaving lets it finish first
    assert 0 < long.suspended_s < long.completed_at - short.started_at + 1e-3 and short.suspended_s == 0
    for job in (long, short):
        image, cache = alone[job.request.prompt]
        np.testing.assert_array_equal(np.stack(job.result.images), image)
        assert job.result.step_cache == cache and cache["forwards_skipped"] > 0
    # Without interleaving (first come, first served) the short one waits for the long one.
    fair.scheduler.policy = QueuePolicy("fcfs")
    try:
        long, short = _one_inside_the_other(fair, LONG, SHORT)
    finally:
        fair.scheduler.policy = QueuePolicy("fair")
    assert short.completed_at > long.completed_at
    np.testing.assert_array_equal(np.stack(short.result.images), alone[SHORT.prompt][0])


@pytest.fixture(scope="module")
def urgent():
    """CFG parallel (two ranks) with the priority policy; rank 1 hangs at step 2 of HANG_PROMPT's requests."""
    fault = {"kind": "hang", "rank": 1, "step": 2, "prompt": HANG_PROMPT}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_OMNI_TEST_FAULT", json.dumps(fault))  # inherited by every worker, restarted ones too
        with Omni(
            MODEL, cfg_parallel_size=2, scheduling_policy="priority", max_num_seqs=4, stall_timeout_s=STALL_S
        ) as omni:
            yield omni


def test_priority_runs_a_lower_priority_number_inside_the_running_request_under_cfg_parallel(urgent):
    low, high = replace(LONG, priority=2), replace(SHORT, priority=1)
    alone = {params.prompt: _alone(urgent, params)[0] for params in (low, high)}
    low_job, high_job = _one_inside_the_other(urgent, low, high)
    assert high_job.completed_at < low_job.completed_at
    for job in (low_job, high_job):
        np.testing.assert_array_equal(np.stack(job.result.images), alone[job.request.prompt])
    # The same priority never preempts.
    same = replace(SHORT, priority=2)
    low_job, same_job = _one_inside_the_other(urgent, low, same)
    assert same_job.completed_at > low_job.completed_at


def test_a_request_cancelled_while_another_runs_inside_it_stops_as_it_resumes(urgent):
    outer = replace(LONG, priority=3)
    inner = replace(LONG, prompt="a red bicycle", priority=1, num_inference_steps=20)
    expected = _alone(urgent, inner)[0]
    outer_job = _submit(urgent, outer)
    _progressed(outer_job, 5)
    inner_job = _submit(urgent, inner)
    _progressed(inner_job, 10)  # running inside the outer one, which is suspended
    urgent.scheduler.cancel(outer_job.id, "the client went away")
    assert _wait(urgent, inner_job).status == "completed"
    np.testing.assert_array_equal(np.stack(inner_job.result.images), expected)
    outer_job = _wait(urgent, outer_job)
    assert outer_job.status == "cancelled" and "the client went away" in outer_job.error.message
    assert urgent.engine.restarts == 0


def test_a_rank_hung_inside_an_interleaved_request_fails_both_and_the_restarted_group_serves(urgent):
    outer = replace(LONG, priority=3)
    hung = replace(SHORT, prompt=HANG_PROMPT, priority=1)
    outer_job, hung_job = _one_inside_the_other(urgent, outer, hung)
    assert hung_job.status == "failed" and f"made no progress for {STALL_S:g} s" in hung_job.error.message
    assert outer_job.status == "failed" and "was in flight when another failed the group" in outer_job.error.message
    assert urgent.engine.restarts == 1
    assert _alone(urgent, SHORT)[0].shape == (1, 208, 272, 3)  # the restarted group serves
