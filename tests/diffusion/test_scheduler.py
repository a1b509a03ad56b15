"""The server's scheduler without HTTP: a fake engine whose requests run only when a test lets them.

Covers loading and readiness, first-in-first-out order, the queue limit checked before the
engine's checks (and with Retry-After), jobs that live with nobody waiting (poll, progress,
times, forget), cancellation queued and running, errors as data (the field at fault; one-line
messages, tracebacks in the log), shutdown, the watchdog giving up on lost workers, and the
scheduling policies (fcfs, priority, fair with its age bound).
"""

from __future__ import annotations

import asyncio
import threading
from types import SimpleNamespace

import pytest

from vllm_omni.diffusion.config import BatchingConfig, EngineLimits
from vllm_omni.diffusion.engine.job import Job
from vllm_omni.diffusion.engine.lifecycle import Unavailable
from vllm_omni.diffusion.engine.policy import MAX_OVERTAKES, QueuePolicy
from vllm_omni.diffusion.engine.queue_admission import InternalError, QueueFull
from vllm_omni.diffusion.engine.scheduler import Scheduler
from vllm_omni.diffusion.request import (
    DiffusionOutput,
    DiffusionRequest,
    GenerationParams,
    RequestCancelled,
    RequestError,
)

WAIT_S = 10  # a hang guard for conditions that hold within milliseconds


class FakeEngine:
    """Each request runs until the test calls `finish(id)` (or cancels it); it reports half its steps first."""

    spec = SimpleNamespace(task="generate")
    envelope = None  # not sized by a GPU's memory

    def __init__(self) -> None:
        self.loaded = threading.Event()
        self.state: tuple[str, str | None] = ("ok", None)
        self.preprocessed: list[str] = []
        self.preprocess_gate: threading.Event | None = None  # set: preprocess waits for it
        self.started: dict[str, threading.Event] = {}
        self.run_order: list[str] = []  # request ids, as their steps began
        self.starts = threading.Semaphore(0)  # released as each step begins
        self.go: dict[str, threading.Event] = {}
        self.cancelled: list[str] = []
        self.closed = False
        self.shutdown_begun = False
        self.failure: Exception | None = None  # raised by the next step

    def _event(self, table: dict, request_id: str) -> threading.Event:
        return table.setdefault(request_id, threading.Event())

    # -- the Engine protocol
    def wait_until_ready(self) -> None:
        assert self.loaded.wait(WAIT_S)

    def health_status(self):
        return self.state if self.loaded.is_set() else ("loading", None)

    def check_workers(self) -> None:
        pass

    def preprocess(self, params: GenerationParams) -> DiffusionRequest:
        self.preprocessed.append(params.prompt)
        if self.preprocess_gate is not None:
            assert self.preprocess_gate.wait(WAIT_S)
        if params.prompt == "bad":
            raise RequestError("prompt is bad", "prompt")
        if params.prompt == "boom":
            raise KeyError("unexpected")
        steps = params.num_inference_steps or 4
        priority = params.priority or 0
        # The fair policy's estimate: the engine's is steps x tokens per step x images; here the steps stand for it.
        return DiffusionRequest(
            params.request_id, params.prompt, num_inference_steps=steps, seed=1, priority=priority, work=steps
        )

    def step(self, request: DiffusionRequest, on_progress=None) -> DiffusionOutput:
        on_progress(2, 4)
        self.run_order.append(request.request_id)
        self.starts.release()
        self._event(self.started, request.request_id).set()
        assert self._event(self.go, request.request_id).wait(WAIT_S)
        if request.request_id in self.cancelled:
            raise RequestCancelled(f"request {request.request_id} cancelled at step 3")
        if self.failure is not None:
            failure, self.failure = self.failure, None
            raise failure
        return DiffusionOutput(request.request_id, [request.prompt], request.seed, 16, 16)

    def cancel(self, request_id: str) -> None:
        self.cancelled.append(request_id)
        self._event(self.go, request_id).set()

    def begin_shutdown(self) -> None:
        self.shutdown_begun = True

    def close(self) -> None:
        self.closed = True

    # -- test controls
    async def running(self, request_id: str) -> None:
        assert await asyncio.to_thread(self._event(self.started, request_id).wait, WAIT_S)

    def finish(self, request_id: str) -> None:
        self._event(self.go, request_id).set()


def scheduler_for(engine: FakeEngine, max_queue: int = 4, **kwargs) -> Scheduler:
    kwargs.setdefault("scheduling_policy", "fcfs")  # arrival order, unless a test is about another policy
    return Scheduler(lambda replica: engine, EngineLimits(max_queue=max_queue), **kwargs)


async def started(engine: FakeEngine, max_queue: int = 4, **kwargs) -> Scheduler:
    scheduler = scheduler_for(engine, max_queue, **kwargs)
    await scheduler.start()
    engine.loaded.set()
    while not scheduler.ready:  # the loader thread finishes within milliseconds
        await asyncio.sleep(0.001)
    return scheduler


def params(prompt: str = "a cat") -> GenerationParams:
    return GenerationParams(prompt=prompt)


def test_nothing_is_taken_until_the_engine_has_loaded_then_health_is_ok():
    async def scenario():
        engine = FakeEngine()
        scheduler = scheduler_for(engine)
        await scheduler.start()
        assert scheduler.health().to_dict() == {"status": "loading"}
        with pytest.raises(Unavailable, match="still loading") as refused:
            await scheduler.submit(params())
        assert refused.value.state == "loading" and engine.preprocessed == []
        engine.loaded.set()
        while not scheduler.ready:
            await asyncio.sleep(0.001)
        assert scheduler.health().ok
        job = await scheduler.submit(params())
        engine.finish(job.id)
        assert (await job.wait()).status == "completed"
        await scheduler.stop()
        assert engine.closed

    asyncio.run(scenario())


class WarmingEngine(FakeEngine):
    """Loads, then warms up until `warmed` (health: warming_up), then reports ok a moment before
    `wait_until_ready` returns (until `returned`): the window where /health once said 200 while
    requests were refused as loading."""

    def __init__(self) -> None:
        super().__init__()
        self.warmed = threading.Event()
        self.returned = threading.Event()

    def wait_until_ready(self) -> None:
        assert self.loaded.wait(WAIT_S) and self.warmed.wait(WAIT_S) and self.returned.wait(WAIT_S)

    def health_status(self):
        if not self.loaded.is_set():
            return ("loading", None)
        return ("ok", None) if self.warmed.is_set() else ("warming_up", "running the warm-up requests")


def test_health_is_ok_only_once_a_request_would_be_taken_warm_up_included():
    async def scenario():
        engine = WarmingEngine()
        scheduler = scheduler_for(engine)
        await scheduler.start()

        async def refused_as(state: str) -> None:
            assert scheduler.health().state == state and not scheduler.health().ok
            with pytest.raises(Unavailable) as refused:
                await scheduler.submit(params())
            assert refused.value.state == state

        while scheduler.engine is None:  # created in a thread of its own at once
            await asyncio.sleep(0.001)
        await refused_as("loading")
        engine.loaded.set()
        await refused_as("warming_up")
        engine.warmed.set()  # the engine says ok, its wait has not returned yet
        await refused_as("warming_up")
        engine.returned.set()
        while not scheduler.ready:
            await asyncio.sleep(0.001)
        assert scheduler.health().ok
        job = await scheduler.submit(params())
        engine.finish(job.id)
        assert (await job.wait()).status == "completed"
        await scheduler.stop()

    asyncio.run(scenario())


def test_jobs_run_one_at_a_time_in_the_order_they_came():
    async def scenario():
        engine = FakeEngine()
        scheduler = await started(engine)
        jobs = [await scheduler.submit(params(f"prompt {i}")) for i in range(3)]
        await engine.running(jobs[0].id)
        assert [j.status for j in jobs] == ["in_progress", "queued", "queued"]
        for job in reversed(jobs):  # released last first: they still finish first in, first out
            engine.finish(job.id)
        done = [await job.wait() for job in jobs]
        assert [j.result.images for j in done] == [["prompt 0"], ["prompt 1"], ["prompt 2"]]
        assert jobs[0].completed_at <= jobs[1].started_at and jobs[1].completed_at <= jobs[2].started_at
        await scheduler.stop()

    asyncio.run(scenario())


def test_a_job_lives_without_anyone_waiting_and_can_be_polled_then_forgotten():
    async def scenario():
        engine = FakeEngine()
        scheduler = await started(engine, max_finished_jobs=2)
        job_id = (await scheduler.submit(params())).id
        polled = scheduler.get(job_id)
        assert polled.status in ("queued", "in_progress") and polled.created_at > 0
        await engine.running(job_id)
        assert scheduler.get(job_id).status == "in_progress" and scheduler.get(job_id).progress == 50
        engine.finish(job_id)
        job = await scheduler.get(job_id).wait()
        assert (job.status, job.progress, job.error) == ("completed", 100, None)
        assert job.created_at <= job.started_at <= job.completed_at
        assert job.request.images is None  # nothing held for a finished job but its result
        scheduler.forget(job_id)
        assert scheduler.get(job_id) is None
        # Finished jobs nobody forgets are kept up to max_finished_jobs, the oldest dropped first.
        kept = []
        for i in range(3):
            kept.append(await scheduler.submit(params(f"p{i}")))
            engine.finish(kept[-1].id)
            await kept[-1].wait()
        assert [scheduler.get(j.id) is not None for j in kept] == [False, True, True]
        await scheduler.stop()

    asyncio.run(scenario())


def test_a_full_queue_refuses_before_the_engine_checks_anything_and_says_when_to_retry():
    async def scenario():
        engine = FakeEngine()
        scheduler = await started(engine, max_queue=1)
        running = await scheduler.submit(params("running"))
        await engine.running(running.id)
        # While one submit is still in the engine's checks its place is held: a second one is refused.
        engine.preprocess_gate = threading.Event()
        checking = asyncio.create_task(scheduler.submit(params("waiting")))
        while engine.preprocessed[-1] != "waiting":
            await asyncio.sleep(0.001)
        with pytest.raises(QueueFull) as full:
            await scheduler.submit(params("refused"))
        assert "refused" not in engine.preprocessed  # refused before its upload was read or its prompt counted
        assert full.value.retry_after_s >= 1
        with pytest.raises(QueueFull):
            scheduler.hold_place()  # what the edits route takes before it reads a multipart body
        engine.preprocess_gate.set()
        waiting = await checking
        engine.finish(running.id)
        engine.finish(waiting.id)
        assert (await waiting.wait()).status == "completed"
        await scheduler.stop()

    asyncio.run(scenario())


def test_a_place_held_while_an_upload_is_read_counts_until_its_job_takes_it():
    async def scenario():
        engine = FakeEngine()
        scheduler = await started(engine, max_queue=1)
        running = await scheduler.submit(params("running"))
        await engine.running(running.id)
        with scheduler.hold_place():
            with pytest.raises(QueueFull):
                await scheduler.submit(params("refused"))
            queued = await scheduler.submit(params("uploaded"), place_held=True)
        assert "refused" not in engine.preprocessed
        with pytest.raises(QueueFull):
            scheduler.hold_place()  # the queued job has the place now
        engine.finish(running.id)
        engine.finish(queued.id)
        assert (await queued.wait()).status == "completed"
        with scheduler.hold_place():  # free again
            pass
        await scheduler.stop()

    asyncio.run(scenario())


def test_cancel_drops_a_queued_job_at_once_and_stops_a_running_one():
    async def scenario():
        engine = FakeEngine()
        scheduler = await started(engine)
        running = await scheduler.submit(params("running"))
        queued = await scheduler.submit(params("queued"))
        await engine.running(running.id)
        scheduler.cancel(queued.id, "client disconnected")
        assert queued.status == "cancelled" and queued.error.code == "cancelled"
        assert "client disconnected" in queued.error.message
        scheduler.cancel(running.id, "client disconnected")
        assert engine.cancelled == [running.id]
        await running.wait()
        assert running.status == "cancelled" and running.error.code == "cancelled"
        assert queued.id not in engine.started  # it never ran
        await scheduler.stop()

    asyncio.run(scenario())


def test_errors_are_data_bad_input_names_its_field_and_failures_are_one_line(capsys):
    async def scenario():
        engine = FakeEngine()
        scheduler = await started(engine)
        with pytest.raises(RequestError) as bad:
            await scheduler.submit(params("bad"))
        assert bad.value.param == "prompt"
        with pytest.raises(InternalError, match=r"^could not check the request: KeyError: 'unexpected'$"):
            await scheduler.submit(params("boom"))

        # Bad input found while running (a source image that does not decode) keeps its field.
        engine.failure = RequestError("image cannot be decoded: truncated", "image")
        job = await scheduler.submit(params())
        engine.finish(job.id)
        await job.wait()
        assert (job.status, job.error.code, job.error.param) == ("failed", "invalid_request", "image")

        # A worker group that could not be reloaded reports a traceback: the client gets one line.
        traceback_text = 'Traceback (most recent call last):\n  File "/srv/worker.py", line 3, in _load\nOSError: gone'
        engine.failure = RuntimeError(f"worker rank 0 could not load tiny/qwen-image: OSError: gone\n{traceback_text}")
        job = await scheduler.submit(params())
        engine.finish(job.id)
        await job.wait()
        assert job.error.code == "server_error"
        assert job.error.message == "generation failed: worker rank 0 could not load tiny/qwen-image: OSError: gone"
        await scheduler.stop()

    asyncio.run(scenario())
    assert 'File "/srv/worker.py", line 3' in capsys.readouterr().err  # the log keeps the whole text


def test_shutdown_ends_queued_jobs_cancels_the_running_one_and_refuses_new_work():
    async def scenario():
        engine = FakeEngine()
        scheduler = await started(engine)
        running = await scheduler.submit(params("running"))
        queued = await scheduler.submit(params("queued"))
        await engine.running(running.id)
        scheduler.begin_shutdown()
        assert engine.shutdown_begun and engine.cancelled == [running.id]
        assert queued.status == "cancelled" and queued.error.code == "shutting_down"
        await running.wait()
        assert running.error.code == "shutting_down" and "shutting down" in running.error.message
        with pytest.raises(Unavailable) as refused:
            await scheduler.submit(params())
        assert refused.value.state == "shutting_down"
        assert scheduler.health().to_dict() == {"status": "shutting_down"}
        await scheduler.stop()
        assert engine.closed

    asyncio.run(scenario())


def test_watchdog_reports_lost_workers_and_health_says_why():
    async def scenario():
        engine = FakeEngine()
        lost = asyncio.Event()
        reasons = []

        def on_fatal(reason: str) -> None:
            reasons.append(reason)
            lost.set()

        scheduler = await started(engine, watchdog_interval_s=0.01, on_fatal=on_fatal)
        engine.state = ("failed", "worker rank 1 could not load tiny/qwen-image: OSError: gone")
        await asyncio.wait_for(lost.wait(), WAIT_S)
        assert reasons == ["worker rank 1 could not load tiny/qwen-image: OSError: gone"]
        health = scheduler.health()
        assert not health.ok and health.to_dict()["status"] == "failed"
        with pytest.raises(Unavailable, match="the workers are down"):
            await scheduler.submit(params())
        await scheduler.stop()

    asyncio.run(scenario())


def test_a_model_that_cannot_load_ends_the_server_with_a_one_line_reason():
    async def scenario():
        lost = asyncio.Event()
        reasons = []

        def broken_engine(replica):
            raise OSError("no file named model_index.json\n  File ...")

        scheduler = Scheduler(
            broken_engine, EngineLimits(), on_fatal=lambda r: (reasons.append(r), lost.set()), scheduling_policy="fcfs"
        )
        await scheduler.start()
        await asyncio.wait_for(lost.wait(), WAIT_S)
        assert reasons == ["OSError: no file named model_index.json"]
        assert scheduler.health().to_dict() == {"status": "failed", "detail": reasons[0]}
        await scheduler.stop()

    asyncio.run(scenario())


def test_replicas_run_jobs_at_once_and_one_failing_leaves_the_other_serving():
    """data_parallel_size=2: two engines behind one queue; a job goes to an idle replica."""

    async def scenario():
        engines = [FakeEngine(), FakeEngine()]
        scheduler = Scheduler(
            lambda replica: engines[replica], EngineLimits(max_queue=4), replicas=2, scheduling_policy="fcfs"
        )
        await scheduler.start()
        for engine in engines:
            engine.loaded.set()
        while not scheduler.ready:
            await asyncio.sleep(0.001)
        health = scheduler.health().to_dict()
        assert health["status"] == "ok" and [r["status"] for r in health["replicas"]] == ["ok", "ok"]
        first, second = await scheduler.submit(params("one")), await scheduler.submit(params("two"))
        for job in (first, second):  # both run at once, each on its own replica
            while job.status != "in_progress":
                await asyncio.sleep(0.001)
            await engines[job.replica].running(job.id)
        assert {first.replica, second.replica} == {0, 1} and scheduler.running == 2
        # A failure on one replica fails its job only; the other finishes, and the failed one serves again.
        failing = engines[first.replica]
        failing.failure = RuntimeError("worker rank 0 died")
        failing.finish(first.id)
        assert (await first.wait()).status == "failed"
        engines[second.replica].finish(second.id)
        assert (await second.wait()).status == "completed"
        # One replica restarting: the server still takes work (the other is ok) and says which one is not.
        failing.state = ("restarting", "worker rank 0 died")
        health = scheduler.health().to_dict()
        assert health["status"] == "ok" and sorted(r["status"] for r in health["replicas"]) == ["ok", "restarting"]
        third = await scheduler.submit(params("three"))
        for engine in engines:
            engine.finish(third.id)
        assert (await third.wait()).status == "completed"
        await scheduler.stop()
        assert all(engine.closed for engine in engines)

    asyncio.run(scenario())


class BatchingEngine(FakeEngine):
    """FakeEngine whose requests may share a call: `calls` records each call's request ids; a call runs
    until the test finishes its first request."""

    spec = SimpleNamespace(task="generate", batchable=True)

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[list[str]] = []

    def preprocess(self, params: GenerationParams) -> DiffusionRequest:
        request = super().preprocess(params)
        request.height = request.width = params.height  # requests of other sizes never share a call
        return request

    def step(self, request: DiffusionRequest, on_progress=None) -> DiffusionOutput:
        self.calls.append([request.request_id])
        return super().step(request, on_progress)

    def step_batch(self, requests: list[DiffusionRequest], on_progress=None) -> list[DiffusionOutput]:
        self.calls.append([request.request_id for request in requests])
        first = super().step(requests[0], on_progress)  # waits for finish(first id); raises when cancelled
        return [first] + [DiffusionOutput(r.request_id, [r.prompt], r.seed, 16, 16) for r in requests[1:]]


async def batching_scheduler(max_batch_size: int, batch_wait_ms: float = 0.0) -> tuple[BatchingEngine, Scheduler]:
    engine = BatchingEngine()
    scheduler = await started(engine, 8, batching=BatchingConfig(max_batch_size, batch_wait_ms))
    return engine, scheduler


def test_queued_requests_that_can_share_a_forward_run_as_one_call_each_with_its_own_result():
    async def scenario():
        engine, scheduler = await batching_scheduler(max_batch_size=3)
        alone = await scheduler.submit(GenerationParams("first", height=32))
        await engine.running(alone.id)  # the queue fills behind it
        b, c = (
            await scheduler.submit(GenerationParams("b", height=32)),
            await scheduler.submit(GenerationParams("c", height=32)),
        )
        other = await scheduler.submit(GenerationParams("other size", height=64))  # never with b, c, e
        e = await scheduler.submit(GenerationParams("e", height=32))
        late = await scheduler.submit(GenerationParams("late", height=32))  # beyond max_batch_size
        engine.finish(alone.id)
        await engine.running(b.id)
        assert engine.calls == [[alone.id], [b.id, c.id, e.id]]  # first in, first out among those that match
        assert {job.status for job in (b, c, e)} == {"in_progress"} and scheduler.running == 3
        engine.finish(b.id)
        for job, prompt in ((b, "b"), (c, "c"), (e, "e")):
            assert (await job.wait()).status == "completed" and job.result.images == [prompt]
        await engine.running(other.id)
        engine.finish(other.id)
        await engine.running(late.id)
        engine.finish(late.id)
        await asyncio.gather(other.wait(), late.wait())
        assert engine.calls[2:] == [[other.id], [late.id]]
        await scheduler.stop()

    asyncio.run(scenario())


def test_cancelling_one_request_of_a_batch_ends_it_at_once_and_leaves_the_others():
    async def scenario():
        engine, scheduler = await batching_scheduler(max_batch_size=2)
        blocker = await scheduler.submit(GenerationParams("blocker", height=32))
        await engine.running(blocker.id)
        b, c = (
            await scheduler.submit(GenerationParams("b", height=32)),
            await scheduler.submit(GenerationParams("c", height=32)),
        )
        engine.finish(blocker.id)
        await engine.running(b.id)
        scheduler.cancel(b.id, "client disconnected")  # the first row: the call carries its id
        assert b.status == "cancelled" and "client disconnected" in b.error.message
        assert engine.cancelled == []  # the call goes on for c
        engine.finish(b.id)
        assert (await c.wait()).status == "completed" and c.result.images == ["c"]
        assert b.result is None
        # Once every request of a call is cancelled, the call itself is.
        blocker = await scheduler.submit(GenerationParams("blocker", height=32))
        await engine.running(blocker.id)
        d, e = (
            await scheduler.submit(GenerationParams("d", height=32)),
            await scheduler.submit(GenerationParams("e", height=32)),
        )
        engine.finish(blocker.id)
        await engine.running(d.id)
        assert engine.calls[-1] == [d.id, e.id]
        scheduler.cancel(e.id)
        assert engine.cancelled == []
        scheduler.cancel(d.id)
        assert engine.cancelled == [d.id]
        await asyncio.gather(d.wait(), e.wait())
        assert d.status == e.status == "cancelled"
        await scheduler.stop()

    asyncio.run(scenario())


def test_a_request_waits_up_to_batch_wait_ms_for_company():
    async def scenario():
        # A long wait: the call starts as soon as its second request arrives (the batch is full), not at the deadline.
        engine, scheduler = await batching_scheduler(max_batch_size=2, batch_wait_ms=60_000)
        first = await scheduler.submit(GenerationParams("first", height=32))
        second = await scheduler.submit(GenerationParams("second", height=32))
        await engine.running(first.id)
        assert engine.calls == [[first.id, second.id]]
        engine.finish(first.id)
        await asyncio.gather(first.wait(), second.wait())
        await scheduler.stop()

    asyncio.run(scenario())


# ---- scheduling policies --------------------------------------------------------------------------


async def run_order(policy: str, requests: list[dict]) -> list[str]:
    """The prompts ("0", "1", ...) of `requests` (GenerationParams fields), all queued behind a running blocker,
    in the order they ran under `policy`; each runs only once the one before it has finished."""
    engine = FakeEngine()
    scheduler = await started(engine, max_queue=16, scheduling_policy=policy)
    blocker = await scheduler.submit(params("blocker"))
    await engine.running(blocker.id)
    assert engine.starts.acquire(timeout=0)  # the blocker's start
    jobs = {}
    for i, fields in enumerate(requests):
        job = await scheduler.submit(GenerationParams(str(i), **fields))
        jobs[job.id] = job
    engine.finish(blocker.id)
    order = []
    for _ in requests:
        assert await asyncio.to_thread(engine.starts.acquire, timeout=WAIT_S)
        job = jobs[engine.run_order[-1]]
        order.append(job.request.prompt)
        engine.finish(job.id)
        assert (await job.wait()).status == "completed"
    await scheduler.stop()
    return order


STEPS = [{"num_inference_steps": steps} for steps in (50, 50, 2, 8)]


def test_fcfs_runs_in_arrival_order_whatever_the_work():
    order = asyncio.run(run_order("fcfs", STEPS))
    assert order == ["0", "1", "2", "3"]


def test_priority_runs_the_lowest_value_first_ties_in_arrival_order(capsys):
    order = asyncio.run(run_order("priority", [{"priority": p} for p in (0, 5, -1, 5, -1)]))
    assert order == ["2", "4", "0", "1", "3"]
    log = capsys.readouterr().err
    assert "(position 1; priority -1)" in log  # "2" queued ahead of the three before it
    assert "in the queue; priority -1, overtook 2)" in log  # "2" ran before "0" and "1"


def test_fair_runs_the_least_work_first_and_a_short_job_overtakes_long_ones(capsys):
    order = asyncio.run(run_order("fair", STEPS))
    assert order == ["2", "3", "0", "1"]
    assert "least work first, overtook 2)" in capsys.readouterr().err


def test_fair_runs_a_long_job_once_four_later_jobs_have_overtaken_it():
    requests = [{"num_inference_steps": 50}] + [{"num_inference_steps": 2}] * (MAX_OVERTAKES + 2)
    order = asyncio.run(run_order("fair", requests))
    assert order == ["1", "2", "3", "4", "0", "5", "6"]


def test_fair_batches_take_no_job_that_would_overtake_one_past_the_bound():
    def job(name: str, work: int, overtaken: int = 0) -> Job:
        return Job(name, DiffusionRequest(name, name, work=work), overtaken=overtaken)

    policy = QueuePolicy("fair")
    long, a, b = job("long", 100, overtaken=MAX_OVERTAKES - 2), job("a", 1), job("b", 1)
    assert policy.next_head([long, a, b]) is a and policy.admit([a, b], [long, a, b]) == [a, b]
    long.overtaken = MAX_OVERTAKES - 1
    assert policy.next_head([long, a, b]) is a and policy.admit([a, b], [long, a, b]) == [a]
    assert policy.started([a], [long, a, b]) == 1 and long.overtaken == MAX_OVERTAKES and b.overtaken == 0
    assert policy.next_head([long, b]) is long  # its bound is reached: it goes next


@pytest.mark.parametrize("policy", ["fcfs", "fair"])
def test_a_priority_on_a_server_not_scheduling_by_priority_is_refused_naming_it(policy):
    async def scenario():
        engine = FakeEngine()
        scheduler = await started(engine, scheduling_policy=policy)
        with pytest.raises(RequestError, match="--scheduling-policy priority") as refused:
            await scheduler.submit(GenerationParams("urgent", priority=1))
        assert refused.value.param == "priority" and "urgent" not in engine.preprocessed
        job = await scheduler.submit(GenerationParams("default", priority=0))  # 0 is everyone's priority
        engine.finish(job.id)
        assert (await job.wait()).status == "completed"
        await scheduler.stop()

    asyncio.run(scenario())
