"""Every wait on the workers has a deadline, and shutdown wins over restarts (DiffusionEngine, real processes).

Ulysses 2 on the CPU (gloo), tiny Qwen-Image. Rank 1 hangs at the end of step 1 of any request
whose prompt is HANG_PROMPT (the worker's VLLM_OMNI_TEST_FAULT hook), so rank 0 waits for it in
the step's collective; other prompts run normally, also in the restarted group.
"""

from __future__ import annotations

import json
import os
import threading
import time

import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni.diffusion.config import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.engine.core import DiffusionEngine  # noqa: E402
from vllm_omni.diffusion.executor.base import WorkerStartError  # noqa: E402
from vllm_omni.diffusion.request import GenerationParams, RequestCancelled, RequestFailed

pytestmark = pytest.mark.slow  # whole engines with worker processes

MODEL = "tiny/qwen-image"
HANG_PROMPT = "rank 1 hangs at step 1"
STALL_S = 4.0
SLACK_S = 10.0  # a loaded 2-core CI machine; the point is "near the deadline", not "never"
STEPS = 4


def _params(prompt: str = "a cat") -> GenerationParams:
    return GenerationParams(prompt, height=32, width=32, num_inference_steps=STEPS, seed=0)


def _config(**deadlines: float) -> OmniDiffusionConfig:
    # CPU even where GPUs exist: the 4 s deadline is sized for the tiny model's CPU steps, not a first
    # GPU step that compiles and captures graphs.
    return OmniDiffusionConfig(MODEL, DiffusionParallelConfig(ulysses_degree=2), device="cpu", **deadlines)


@pytest.fixture(scope="module")
def engine():
    fault = {"kind": "hang", "rank": 1, "step": 1, "prompt": HANG_PROMPT}
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_OMNI_TEST_FAULT", json.dumps(fault))  # inherited by every worker, restarted ones too
        engine = DiffusionEngine(_config(stall_timeout_s=STALL_S))
        try:
            engine.wait_until_ready()
            yield engine
        finally:
            engine.close()


def test_load_deadline_fails_the_start_and_kills_the_workers():
    # No group of workers starts, joins its process group and loads in 10 ms, forked by a warm forkserver or spawned
    engine = DiffusionEngine(_config(load_timeout_s=0.01))
    executor = engine.executor
    try:
        with pytest.raises(WorkerStartError, match=r"did not load .* within load_timeout_s=0.01 s"):
            engine.wait_until_ready()
        assert executor.status().state == "failed" and "load_timeout_s" in executor.failed
        assert not any(proc.is_alive() for proc in executor._procs)
        with pytest.raises(RequestFailed, match="the workers are down"):
            engine.step(_params())
    finally:
        engine.close()


def test_a_hung_rank_fails_the_request_at_the_stall_deadline_and_the_group_restarts(engine):
    executor = engine.executor
    hung_group = list(executor._procs)
    start = time.monotonic()
    with pytest.raises(RequestFailed, match=r"made no progress for 4 s \(stall_timeout_s\): rank 0 at step 1/4"):
        engine.step(_params(HANG_PROMPT))
    assert STALL_S <= time.monotonic() - start < STALL_S + SLACK_S
    assert not any(proc.is_alive() for proc in hung_group)
    status = executor.status()
    assert (status.state, status.restarts) == ("restarting", 1)
    assert "made no progress" in status.last_restart_reason and "made no progress" in status.detail

    # The next request waits for the new group and runs; progress comes from rank 0, step by step.
    progress: list[tuple[int, int]] = []
    images = executor.execute(
        engine.preprocess(_params()), on_progress=lambda done, total, _: progress.append((done, total))
    )
    assert images.shape == (1, 32, 32, 3)
    assert progress == [(step, STEPS) for step in range(STEPS + 1)]
    assert executor.status().state == "ok" and executor.restarts == 1


def test_shutdown_during_a_hung_request_wins_over_the_deadline_and_restarts_nothing(engine):
    # Closes the module's engine: keep it last.
    executor = engine.executor
    restarts = executor.restarts
    started = threading.Event()
    outcome: dict[str, BaseException] = {}

    def run() -> None:
        try:
            request = engine.preprocess(_params(HANG_PROMPT))
            executor.execute(request, on_progress=lambda done, _total, _phase: done and started.set())
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    assert started.wait(60), "the request never reached step 1"
    group = list(executor._procs)
    begun = time.monotonic()
    engine.close()
    thread.join(timeout=30)
    assert not thread.is_alive()
    assert time.monotonic() - begun < STALL_S  # shutdown ended it, not the stall deadline
    assert isinstance(outcome.get("error"), RequestCancelled) and "shutting down" in str(outcome["error"])
    assert executor.restarts == restarts and executor._procs == group
    assert not any(proc.is_alive() for proc in group)
    assert executor.status().state == "shutting_down"
    with pytest.raises(RequestCancelled, match="not run: the engine is shutting down"):
        engine.step(_params())


def test_the_start_method_is_spawn_unless_set_and_fork_is_refused(monkeypatch):
    from vllm_omni.diffusion.executor.multiproc import start_method

    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    assert start_method() == "spawn"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "forkserver")
    assert start_method() == "forkserver"
    monkeypatch.setenv("VLLM_WORKER_MULTIPROC_METHOD", "fork")  # the executor's process runs threads
    with pytest.raises(
        ValueError, match="VLLM_WORKER_MULTIPROC_METHOD='fork': the workers start with spawn or forkserver"
    ):
        start_method()
