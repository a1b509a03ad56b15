"""The scheduler below the entrypoints: one queue of jobs for the replicas' engines (replicas.py), in a
scheduling policy's order (policy.py), request batching (batching.py), interleaving and cancellation. What joins
the queue passes queue_admission.py; the engines' load, health, watchdog and shutdown are lifecycle.py's. The
HTTP routes and `Omni` submit to it; docs/serving.md describes the policy, and tests drive it with a fake engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Protocol

from vllm_omni.diffusion.config import BatchingConfig, EngineLimits
from vllm_omni.diffusion.engine.batching import batch_key
from vllm_omni.diffusion.engine.job import Job, JobError, JobStatus, one_line
from vllm_omni.diffusion.engine.lifecycle import Health, Lifecycle
from vllm_omni.diffusion.engine.policy import QueuePolicy
from vllm_omni.diffusion.engine.queue_admission import QueueAdmission, QueuePlace
from vllm_omni.diffusion.engine.replicas import Engine, ReplicaEngines
from vllm_omni.diffusion.request import (
    DiffusionOutput,
    GenerationParams,
    RequestCancelled,
    RequestError,
    RequestOutOfMemory,
)
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class Observer(Protocol):
    """Told of what the metrics count (metrics.ServerMetrics); called on the event loop's thread or the engine's."""

    def job_finished(self, job: Job) -> None: ...
    def steps_done(self, count: int) -> None: ...


class Scheduler:
    """Lives on one event loop: `start` it there, `submit` jobs and wait for them, `stop` it. The engines'
    blocking calls run in threads of their own."""

    def __init__(
        self,
        engine_factory: Callable[[int], Engine],
        limits: EngineLimits,
        *,
        watchdog_interval_s: float | None = 2.0,  # None: no watchdog
        max_finished_jobs: int = 256,
        on_fatal: Callable[[str], None] = lambda reason: None,
        observer: Observer | None = None,
        replicas: int = 1,
        batching: BatchingConfig | None = None,
        scheduling_policy: str,  # no default here: the engine's (config.py) is the one default
        max_num_seqs: int = 1,
    ) -> None:
        self.limits = limits
        self.batching = batching or BatchingConfig()
        self.policy = QueuePolicy(scheduling_policy)
        self.max_num_seqs = max_num_seqs  # engine calls in flight on a replica at once (interleaving: > 1)
        self.observer = observer
        self.replicas = replicas
        self.max_finished_jobs = max_finished_jobs
        self.on_fatal = on_fatal  # the workers are lost for good, or the model cannot load: the server ends
        self._engines = ReplicaEngines(engine_factory, replicas)
        # Read at the call: the server sets `on_fatal` after it built the scheduler.
        self.lifecycle = Lifecycle(self._engines, lambda reason: self.on_fatal(reason), watchdog_interval_s)
        self._step_thread = ThreadPoolExecutor(max_workers=replicas * max_num_seqs, thread_name_prefix="engine-step")
        self._waiting: deque[Job] = deque()
        self.admission = QueueAdmission(self.lifecycle, limits.max_queue, self._waiting, self._running_jobs)
        # Each replica's engine calls in flight, outermost first: one, or with interleaving those run inside it.
        self._calls: list[list[list[Job]]] = [[] for _ in range(replicas)]
        self._jobs: dict[str, Job] = {}
        self._finished: deque[str] = deque()
        self._wakeup: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._tasks: list[asyncio.Task] = []

    # ---- lifecycle (lifecycle.py) ---------------------------------------------------------------

    async def start(self) -> None:
        """Begin loading the engines (in the background: until every replica has loaded and run its warm-up,
        `submit` raises Unavailable); start one consumer per replica and the watchdog. Returns at once."""
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._tasks = [
            *self.lifecycle.start(),
            *(asyncio.create_task(self._consume(i), name=f"consume-queue-{i}") for i in range(self.replicas)),
        ]
        if self.max_num_seqs > 1 and self.policy.name != "fcfs":
            self._tasks.append(asyncio.create_task(self._interleave(), name="interleave"))

    async def wait_until_loaded(self) -> None:
        """Until every replica has loaded and warmed up; raises what the load raised (`Omni` waits here)."""
        await self.lifecycle.wait_until_loaded()

    @property
    def engine(self) -> Engine | None:
        """The first replica's engine (the model's spec, the request checks: the same in every replica)."""
        return self._engines[0]

    @property
    def engines(self) -> list[Engine | None]:
        """Each replica's engine (None while it is created)."""
        return list(self._engines)

    @property
    def ready(self) -> bool:
        return self.lifecycle.loaded

    def health(self) -> Health:
        """The server's state: ok only while work is taken (one replica up and warm is enough); else why not."""
        return self.lifecycle.health()

    def replica_states(self) -> list[tuple[Health, list[Job], Engine | None]]:
        """Each replica's health, running jobs and engine (None while it is created), for the metrics."""
        health = self.lifecycle.replica_health
        return [(health(engine), self._running_jobs(i), engine) for i, engine in enumerate(self._engines)]

    def check_accepting(self) -> None:
        """Unavailable unless new work is taken (loaded and warm, workers not lost, not shutting down)."""
        self.lifecycle.check_accepting()

    def begin_shutdown(self) -> None:
        """Refuse new work, end the queued jobs, cancel the running one (it stops at its next step)."""
        if self.lifecycle.shutting_down:
            return
        self.lifecycle.shutting_down = True
        logger.info("Shutting down: cancelling the running request and %d queued one(s)", len(self._waiting))
        while self._waiting:
            job = self._waiting.popleft()
            self._finish(job, "cancelled", error=JobError("shutting_down", "the server is shutting down; not run"))
        self._engines.begin_shutdown([[call[0].id for call in calls] for calls in self._calls])

    def begin_shutdown_threadsafe(self) -> None:
        """`begin_shutdown` from another thread (a signal handler)."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.begin_shutdown)

    async def stop(self, grace_s: float = 30.0) -> None:
        """Shut down: give the running jobs `grace_s` to stop, then close the engines and their workers."""
        self.begin_shutdown()
        running = self._running_jobs()
        if running:
            try:
                await asyncio.wait_for(asyncio.gather(*(job.wait() for job in running)), grace_s)
            except asyncio.TimeoutError:
                logger.warning("Request(s) %s did not stop within %.0f s", ", ".join(j.id for j in running), grace_s)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._engines.close()
        self._step_thread.shutdown(wait=False, cancel_futures=True)

    # ---- admission (queue_admission.py) ---------------------------------------------------------

    def check_capacity(self) -> None:
        """QueueFull when `max_queue` requests already wait (or are being checked) behind the running one."""
        self.admission.check_capacity()

    def hold_place(self) -> QueuePlace:
        """A place in the queue, held while a request is checked (`with` it; `place_held=True` to submit).
        Raises Unavailable or QueueFull at once."""
        return self.admission.hold_place()

    def retry_after_s(self) -> int:
        """Seconds until a place in the queue is likely free: what the running job has left, about."""
        return self.admission.retry_after_s()

    # ---- state --------------------------------------------------------------------------------

    @property
    def queue_length(self) -> int:
        return len(self._waiting)

    @property
    def running(self) -> int:
        return len(self._running_jobs())

    def _running_jobs(self, replica: int | None = None) -> list[Job]:
        """The jobs in flight (on `replica`), outermost call first."""
        replicas = self._calls if replica is None else [self._calls[replica]]
        return [job for calls in replicas for call in calls for job in call]

    def get(self, job_id: str) -> Job | None:
        """A job by id; finished ones are kept (the latest `max_finished_jobs`) until `forget`."""
        return self._jobs.get(job_id)

    # ---- jobs ---------------------------------------------------------------------------------

    async def submit(self, params: GenerationParams, id_prefix: str = "req", place_held: bool = False) -> Job:
        """Check, then queue; raises Unavailable, QueueFull, RequestError (bad input) or InternalError.

        The queue's capacity is checked before the engine's checks (which read the uploads' headers and
        count prompt tokens), and a place held meanwhile, unless the caller holds one (`hold_place`). A
        queued job carries the checked request, source images still compressed.
        """
        request_id = f"{id_prefix}-{uuid.uuid4().hex[:16]}"
        request = await self.admission.check(self.engine, params, request_id, self.policy.name, place_held)
        self.check_accepting()  # shutdown may have begun meanwhile
        key = batch_key(request, self.engine.spec) if self.batching.max_batch_size > 1 else None
        job = Job(request.request_id, request, batch_key=key)
        self._jobs[job.id] = job
        self._waiting.append(job)
        self._wakeup.set()
        size = f"{request.width}x{request.height}" if request.width else "auto"
        frames = f", frames={request.num_frames}" if request.num_frames else ""
        order = "" if self.policy.name == "fcfs" else f"; {self.policy.describe(job)}"
        logger.info(
            "Request %s queued: size=%s%s, steps=%d, seed=%d, n=%d (position %d%s)",
            job.id,
            size,
            frames,
            request.num_inference_steps,
            request.seed,
            request.num_images,
            self.policy.position(job, self._waiting),
            order,
        )
        return job

    def cancel(self, job_id: str, reason: str = "cancelled") -> Job | None:
        """A queued job ends now; a running one stops at its next denoising step. None: no such job.

        A job of a batch ends at once, its rows computing on to the end of the call (dropping them would
        change the call's shapes mid-run); the call itself is cancelled once all of its jobs are.
        """
        job = self._jobs.get(job_id)
        if job is None or job.finished or job._cancel_reason is not None:
            return job
        job._cancel_reason = reason
        if job.status == "queued":
            self._waiting.remove(job)
            logger.info("Request %s dropped from the queue: %s", job.id, reason)
            self._finish(job, "cancelled", error=JobError("cancelled", f"cancelled before it ran: {reason}"))
        else:
            batch = job.call
            if any(other._cancel_reason is None for other in batch):
                # Its batch goes on for the others: this job ends now, its rows are dropped from the call's answer.
                logger.info("Request %s: %s; its batch goes on without it", job.id, reason)
                self._finish(job, "cancelled", error=JobError("cancelled", f"cancelled: {reason}"))
            else:
                logger.info("Request %s: %s, cancelling at the next step", job.id, reason)
                self._engines[job.replica].cancel(batch[0].id)
        return job

    def forget(self, job_id: str) -> None:
        """Drop a finished job (its result was delivered)."""
        job = self._jobs.get(job_id)
        if job is not None and job.finished:
            del self._jobs[job_id]

    def _finish(
        self, job: Job, status: JobStatus, result: DiffusionOutput | None = None, error: JobError | None = None
    ) -> None:
        job.status, job.result, job.error = status, result, error
        job.completed_at = time.time()
        if status == "completed":
            job.progress = 100
        job.request.images = None  # the compressed uploads are not needed any more
        job._done.set()
        if self.observer is not None:
            self.observer.job_finished(job)
        self._finished.append(job.id)
        while len(self._finished) > self.max_finished_jobs:
            self._jobs.pop(self._finished.popleft(), None)

    async def _consume(self, replica: int) -> None:
        """Replica `replica`'s consumer: the next job in the queue (and those batched with it), one call at a
        time, in a step thread (`engine.step` blocks); the first idle replica takes the head of the queue."""
        while True:
            jobs, overtook = await self._next_jobs()
            while self._calls[replica]:  # a call sent late to run inside the last one still runs
                self._wakeup.clear()
                await self._wakeup.wait()
            order = f"; {self.policy.describe(jobs[0])}, overtook {overtook}" if overtook else ""
            await self._run_call(replica, jobs, order)

    async def _interleave(self) -> None:
        """Interleaving (fair and priority, max_num_seqs > 1): a queued job that the policy puts before the innermost
        call in flight on a replica runs inside it, from that call's next denoising step; the call goes on after."""
        while True:
            self._wakeup.clear()
            await self._wakeup.wait()
            if any(not calls for calls in self._calls):
                continue  # an idle replica takes the queue's head
            for replica, calls in enumerate(self._calls):
                if not self._waiting or len(calls) >= self.max_num_seqs:
                    continue
                head, running = self.policy.next_head(self._waiting), calls[-1]
                if not self.policy.preempts(head, running):
                    continue
                jobs = [head]  # alone: a call run inside another is not batched
                self.policy.started(jobs, self._waiting)
                self._waiting.remove(head)
                for job in running:
                    job.overtaken += 1
                reason = f"; {self.policy.describe(head)}, inside {running[0].id} (at {running[0].progress}%)"
                asyncio.create_task(self._run_call(replica, jobs, reason, interleave=True), name=f"inside-{head.id}")

    async def _run_call(self, replica: int, jobs: list[Job], order: str, interleave: bool = False) -> None:
        """Run `jobs` as one engine call on `replica` (inside its calls in flight when `interleave`) and finish them."""
        loop = asyncio.get_running_loop()
        below = self._calls[replica][-1] if interleave and self._calls[replica] else []  # suspended while this runs
        self._calls[replica].append(jobs)
        started = time.time()
        for job in jobs:
            job.status, job.started_at, job.replica, job.call = "in_progress", started, replica, jobs
        where = f" on replica {replica}" if self.replicas > 1 else ""
        batched = f" with {', '.join(job.id for job in jobs[1:])} (a batch of {len(jobs)})" if len(jobs) > 1 else ""
        logger.info(
            "Request %s running%s%s (%.2f s in the queue%s)",
            jobs[0].id,
            where,
            batched,
            started - jobs[0].created_at,
            order,
        )
        try:
            outputs = await loop.run_in_executor(self._step_thread, self._step, jobs, interleave)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # noqa: BLE001 - the jobs fail, the scheduler goes on
            for job in jobs:
                if not job.finished:
                    self._fail(job, exc)
        else:
            self.admission.run_seconds.append(time.time() - started)
            for job, output in zip(jobs, outputs):
                if job.finished:  # cancelled while its batch ran
                    continue
                self._finish(job, "completed", result=output)
                logger.info(
                    "Request %s done: size=%dx%d, steps=%d, seed=%d, n=%d, %.2f s (%.2f s queued)",
                    job.id,
                    output.width,
                    output.height,
                    job.request.num_inference_steps,
                    output.seed,
                    len(output.images),
                    job.completed_at - job.created_at,
                    job.started_at - job.created_at,
                )
        finally:
            for job in below:
                job.suspended_s += time.time() - started
            self._calls[replica].remove(jobs)
            self._wakeup.set()  # the replica may be free, or its innermost call changed

    async def _next_jobs(self) -> tuple[list[Job], int]:
        """Take the job the policy runs next and the queued jobs that can share its forwards (up to
        max_batch_size, waiting up to batch_wait_ms for them); also how many queued jobs the head overtook."""
        while True:
            while not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            head = self.policy.next_head(self._waiting)
            jobs = self._company(head)
            deadline = time.monotonic() + self.batching.batch_wait_ms / 1e3
            while head.batch_key is not None and len(jobs) < self._batch_rows(head):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._wakeup.clear()
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), remaining)
                if head not in self._waiting:
                    break  # another replica took it, or it was cancelled
                jobs = self._company(head)
            if head not in self._waiting:
                continue
            overtook = self.policy.started(jobs, self._waiting)
            for job in jobs:
                self._waiting.remove(job)
            return jobs, overtook

    def _company(self, head: Job) -> list[Job]:
        """`head` and the queued jobs, in queue order, that may share its forwards (up to max_batch_size, and as
        the policy admits)."""
        if head.batch_key is None:
            return [head]
        same = [job for job in self._waiting if job.batch_key == head.batch_key]
        return self.policy.admit(same[: self._batch_rows(head)], self._waiting)

    def _batch_rows(self, head: Job) -> int:
        """The rows a batch led by `head` may hold: max_batch_size, and no more than one forward of the deploy's
        envelope holds at its size (admission.py)."""
        envelope = self.engine.envelope if self.engine is not None else None
        rows = self.batching.max_batch_size
        return min(rows, envelope.rows_for(head.request.tokens)) if envelope is not None else rows

    def _fail(self, job: Job, exc: Exception) -> None:
        """Finish `job` with what its run raised."""
        job.exception = exc
        if isinstance(exc, RequestCancelled):
            logger.info("Request %s cancelled: %s", job.id, exc)
            if job._cancel_reason is not None:
                error = JobError("cancelled", f"cancelled: {job._cancel_reason}")
            elif self.lifecycle.shutting_down:
                error = JobError("shutting_down", "the server is shutting down; the request was cancelled")
            else:
                error = JobError("cancelled", "cancelled")
            self._finish(job, "cancelled", error=error)
        elif isinstance(exc, RequestError):
            logger.info("Request %s refused: %s", job.id, exc)
            self._finish(job, "failed", error=JobError("invalid_request", one_line(exc), exc.param))
        elif isinstance(exc, RequestOutOfMemory):  # the worker logged its traceback
            logger.warning("Request %s failed: %s", job.id, exc)
            self._finish(job, "failed", error=JobError("out_of_memory", one_line(exc)))
        else:
            # The whole text (a worker's traceback, say) goes to the log; the client gets its first line.
            logger.error("Request %s failed: %s: %s", job.id, type(exc).__name__, exc, exc_info=exc)
            self._finish(job, "failed", error=JobError("server_error", f"generation failed: {one_line(exc)}"))

    def _step(self, jobs: list[Job], interleave: bool = False) -> list[DiffusionOutput]:
        if all(job._cancel_reason is not None for job in jobs):
            raise RequestCancelled(f"request {jobs[0].id} cancelled before it started")

        steps = {"done": 0}

        def on_progress(done: int, total: int, phase: str = "denoise") -> None:
            for job in jobs:
                job.phase = phase
                job.progress = min(99, 100 * done // total) if total else 0  # 100 once the result is in
            if phase != "denoise":
                return
            if self.observer is not None and done > steps["done"]:  # progress may repeat (decode heartbeats)
                self.observer.steps_done(done - steps["done"])
                steps["done"] = done

        engine = self._engines[jobs[0].replica]
        if interleave:
            return [engine.step(jobs[0].request, on_progress=on_progress, interleave=True)]
        if len(jobs) == 1:
            return [engine.step(jobs[0].request, on_progress=on_progress)]
        return engine.step_batch([job.request for job in jobs], on_progress=on_progress)
