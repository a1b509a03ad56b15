"""The worker group's lifecycle, shared by every executor backend (`WorkerGroupExecutor`).

DiffusionEngine runs each request through it on every rank and gets rank 0's images back.
multiproc.MultiprocExecutor starts one worker process per rank on this machine, ray.RayExecutor
one Ray actor per rank; both run worker.run_rank, whose reports are the types of protocol.py.

One request runs at a time (the engine queues them), except that a request may be sent to run inside the
running one (`execute(interleave=True)`, worker.RankServer): the thread that runs the outer one reads
every report and hands each request its own (flights.py). Every wait on the workers has a deadline
(OmniDiffusionConfig): every rank must load within `load_timeout_s`, and a request fails when no
rank has reported progress for `stall_timeout_s`. A missed deadline, a dead worker, or ranks still
busy after another rank failed fail the request in flight and restart the whole group (its process
group is broken); the new group loads in the background and runs the warm-up requests before it
takes a request ("warming_up"). A group that cannot load marks the executor failed. Once
`shutdown()` begins, nothing is executed, collected or respawned. /health reads `status()`.

A request that runs out of device memory fails alone (RequestOutOfMemory, naming its size): on a
one-rank group, or where every rank raised it at an agreed point (protocol.Failed.agreed: the
prompt encoding's broadcast), the ranks freed what it held and the group serves on. Anywhere else
on a group of several ranks (inside a denoiser forward, a split decode) its peers may be left inside
a collective, or on NCCL with an unmatched one: the group restarts at once (errors.py words the error).
"""

from __future__ import annotations

import math
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni.diffusion.config import Envelope, OmniDiffusionConfig
from vllm_omni.diffusion.executor.errors import out_of_memory_error
from vllm_omni.diffusion.executor.flights import Flight, Flights
from vllm_omni.diffusion.protocol import (
    Cancelled,
    Done,
    Failed,
    GraphCaptureFailed,
    HealthState,
    LoadFailed,
    ProgressCallback,
    RankReport,
    Ready,
    Stats,
)
from vllm_omni.diffusion.request import (
    Audio,
    DiffusionRequest,
    RequestCancelled,
    RequestError,
    RequestFailed,
)
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

POLL_S = 0.2
STUCK_AFTER_ERROR_S = 30.0  # ranks still busy this long after another rank failed are stuck (capped by stall)
IDLE_EXIT_S = 10.0  # at shutdown, idle workers get this long to leave their loop before they are killed


class WorkerStartError(RuntimeError):
    """The workers could not load the model, or not within `load_timeout_s`."""


class _ShutDown(Exception):
    """shutdown() began: whatever waits on the workers stops, and nothing restarts them."""


@dataclass(frozen=True)
class ExecutorStatus:
    """The worker group as /health reports it (`WorkerGroupExecutor.status()`).

    state (protocol.HealthState): "restarting" while a new group loads after `last_restart_reason`,
    "unhealthy" when a worker died while idle (the group is respawned at the next `check_workers`
    or request), "failed" when it cannot be brought back (`detail` says why), "shutting_down" once
    `shutdown()` ran. `restarts` counts the group restarts so far; `graph_capture_failures` the CUDA
    graph captures that failed on a rank (each sent that rank's SP group eager until the next
    restart), the last one's reason with it.
    """

    state: HealthState
    detail: str | None = None
    restarts: int = 0
    last_restart_reason: str | None = None
    graph_capture_failures: int = 0
    last_graph_capture_failure: str | None = None

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def to_dict(self) -> dict[str, Any]:
        """{"status": state}, plus detail, restarts and last_restart_reason where there is one."""
        body: dict[str, Any] = {"status": self.state}
        if self.detail:
            body["detail"] = self.detail
        if self.restarts:
            body["restarts"] = self.restarts
            body["last_restart_reason"] = self.last_restart_reason
        if self.graph_capture_failures:
            body["graph_capture_failures"] = self.graph_capture_failures
            body["last_graph_capture_failure"] = self.last_graph_capture_failure
        return body


class WorkerGroupExecutor:
    """A group of ranks; requests go to all of them, rank 0's result comes back.

    Subclasses say how ranks start and end, and carry the messages: `_start_group` (start every
    rank; they load in the background), `_kill_group`, `_dead_worker`, `_next_report`,
    `_send_request`, `_stop_idle_group`, `cancel` and `_release`.
    """

    def __init__(self, config: OmniDiffusionConfig, model_path: str) -> None:
        self.config = config
        self.model_path = model_path
        self.world_size = config.parallel_config.world_size
        self._lock = threading.Lock()  # one request, restart or readiness check at a time
        self._group_lock = threading.Lock()  # starting or killing the group, against shutdown
        self._stopping = threading.Event()  # begin_shutdown(): nothing starts or restarts any more
        self._closing = threading.Event()  # shutdown(): whatever waits on the workers stops now
        self._ready_ranks: set[int] = set()
        self._ready = threading.Event()
        self._load_deadline = math.inf
        self._group_idle = True  # every rank answered the last request: safe to ask them to leave
        self.failed: str | None = None  # why the workers cannot be brought back
        self.restarts = 0
        self.last_restart_reason: str | None = None
        self.warmup_requests: list[DiffusionRequest] = []  # run by every group before its first request
        # What one forward of this deploy holds (config.Envelope): the narrowest of the ranks' memory plans, then
        # of their measured step (the profile request, `profile_request(envelope)`, run first in the warm-up);
        # None where no rank plans against device memory (a CPU).
        self.envelope: Envelope | None = None
        self.profile_request: Callable[[Envelope], DiffusionRequest | None] | None = None
        self._measured: Envelope | None = None  # kept across restarts: a restarted group is not measured again
        self.warmup_s: float | None = None  # the last warm-up's duration, once one ran
        self._warm = False  # this group ran its warm-up (or has none to run)
        self._last_warmup_failed = False
        self._started = False  # a group was ready and warm once: later warm-up failures no longer fail the start
        self.graph_capture_failures = 0
        self.last_graph_capture_failure: str | None = None
        # Each rank's figures from its last finished request (the engine and the metrics read them;
        # no worker is asked).
        self.rank_stats: dict[int, Stats] = {}
        # The requests in flight, outermost first (interleaving nests them); the thread holding _lock reads their
        # reports, the others wait on their flight.
        self._flights = Flights(self.world_size, self._send_request, self._flag_cancels)
        self._last_progress = time.monotonic()  # the group's last report about any request in flight
        self._thread = threading.local()

    # ---- what a kind of group supplies -------------------------------------------------------

    def _start_group(self) -> None:
        """Start every rank (needs self._group_lock); they load in the background and report `Ready`."""
        raise NotImplementedError

    def _kill_group(self) -> None:
        """Kill every rank at once and drop their channels (needs self._group_lock)."""
        raise NotImplementedError

    def _dead_worker(self) -> tuple[int, str] | None:
        """A rank that is gone, and how ("exited with code -9"), or None. Never waits."""
        raise NotImplementedError

    def _next_report(self, timeout: float) -> RankReport:
        """The next report of any rank; queue.Empty after `timeout`."""
        raise NotImplementedError

    def _send_request(self, request: DiffusionRequest) -> None:
        raise NotImplementedError

    def _stop_idle_group(self, deadline: float) -> None:
        """Ask idle ranks to leave their loop (closing their process groups); wait for them until `deadline`."""
        raise NotImplementedError

    def _release(self) -> None:
        """After shutdown killed the group: free what the executor holds besides its ranks."""

    def _flag_cancels(self, cancel_tokens: list[int]) -> None:
        """Make `cancel_tokens` (at most CANCEL_SLOTS, -1 padded) what every rank reads as cancelled."""
        raise NotImplementedError

    def cancel(self, cancel_token: int) -> None:
        """Flag the request with this cancel token on every rank; they stop together at its next step (a request
        suspended while another runs inside it sees the flag as it resumes: it stays until the request ends)."""
        self._flights.cancel(cancel_token)

    # ---- lifecycle -------------------------------------------------------------------------

    def _spawn_locked(self) -> None:
        if self._stopping.is_set():
            raise _ShutDown()
        self._ready.clear()
        self._ready_ranks = set()
        self.envelope = None
        self._group_idle = True
        self._warm = False
        self._load_deadline = time.monotonic() + self.config.load_timeout_s
        self._start_group()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until every worker has loaded the model; raise WorkerStartError if one cannot.

        Bounded by `load_timeout_s` from the group's start, and by `timeout` when given.
        """
        with self._lock:
            until = math.inf if timeout is None else time.monotonic() + timeout
            try:
                if not self._await_ready(until):
                    self._fail_start(f"workers did not load within {timeout:g} s")
            except _ShutDown:
                raise WorkerStartError("the executor was shut down while the workers were loading") from None

    def _await_ready(self, until: float) -> bool:
        """Read load reports until every rank is ready (True) or `until` passes (False); needs self._lock.

        A group that has just loaded runs its warm-up first. Raises WorkerStartError (and marks the
        executor failed) when a rank cannot load, dies while loading, or misses the load deadline.
        """
        while not self._warm:
            if not self._load_group(until):
                return False
            self._warm_up_locked()  # a warm-up that fails restarts the group: load the new one
        if not self._load_group(until):
            return False
        self._started = True
        return True

    def _load_group(self, until: float) -> bool:
        while not self._ready.is_set():
            if self._closing.is_set():
                raise _ShutDown()
            now = time.monotonic()
            if now > self._load_deadline:
                missing = sorted(set(range(self.world_size)) - self._ready_ranks)
                self._fail_start(
                    f"worker rank(s) {missing} did not load {self.config.model} within "
                    f"load_timeout_s={self.config.load_timeout_s:g} s"
                )
            try:
                wait_s = max(0.0, min(POLL_S, until - now, self._load_deadline - now))
                report = self._next_report(wait_s)
            except queue.Empty:
                dead = self._dead_worker()
                if dead is not None:
                    self._fail_start(f"worker rank {dead[0]} {dead[1]} while loading")
                if time.monotonic() >= until:
                    return False
                continue
            if isinstance(report, LoadFailed):
                self._fail_start(f"worker rank {report.rank} could not load {self.config.model}: {report.detail}")
            elif isinstance(report, Ready):
                self._ready_ranks.add(report.rank)
                if report.envelope is not None:
                    self.envelope = report.envelope.narrowest(self.envelope)
                if len(self._ready_ranks) == self.world_size:
                    self._ready.set()
                    if self.restarts:
                        logger.info("Workers restarted (%d restart(s) so far)", self.restarts)
        return True

    def _warm_up_locked(self) -> None:
        """Run the warm-up requests on the group that has just loaded (needs self._lock).

        The warm-up runs the model's default request (a few steps; with compiled blocks, one more at another
        size): where the first group's fails, every request like it would, so the start fails naming the cause
        (a server that could only answer 500s never reports ready). A later group's failure (after a restart)
        is logged and the server goes on: requests then pay the compiles and captures. A warm-up that left
        the group restarting is not repeated by the next group (no restart loop); the one after tries again.
        """
        self._warm = True
        self._measure_step()
        if not self.warmup_requests:
            return
        if self._last_warmup_failed:
            self._last_warmup_failed = False
            logger.warning("Skipping the warm-up of this worker group: the last one failed")
            return
        start = time.perf_counter()
        self._group_idle = False
        try:
            for request in self.warmup_requests:
                self._collect(request, None)  # sends it
        except (RequestFailed, RequestCancelled, RequestError) as exc:
            if not self._started and not isinstance(exc, RequestCancelled):  # a cancel: shutdown during the start
                self._fail_start(
                    f"the warm-up request at {_request_shape(request)} failed, so every request like it "
                    f"would: {type(exc).__name__}: {exc}"
                )
            logger.error("Warm-up request failed (%s: %s); serving without it", type(exc).__name__, exc)
            self._last_warmup_failed = not self._warm  # it restarted the group
            self.warmup_s = 0.0
            return
        self.warmup_s = time.perf_counter() - start
        sizes = ", then ".join(_request_shape(request) for request in self.warmup_requests)
        logger.info("Warm-up done in %.1f s (%d request(s): %s)", self.warmup_s, len(self.warmup_requests), sizes)

    def _measure_step(self) -> None:
        """Measure one denoising step at the largest row the ranks' plans admit (the profile request) and serve
        the envelope the narrowest rank's measurement leaves (needs self._lock). Where the profile fails, the
        envelope narrows to the request the deploy must admit. A restarted group keeps the first measurement."""
        if self.envelope is None or self.profile_request is None:
            return
        if self._measured is not None:
            self.envelope = self._measured.narrowest(self.envelope)
            return
        request = self.profile_request(self.envelope)
        if request is None:
            return
        planned = self.envelope
        self._group_idle = False
        try:
            self._collect(request, None)  # sends it
        except (RequestFailed, RequestCancelled, RequestError) as exc:
            admitted = self.config.admission.required_tokens if self.config.admission else planned.max_tokens_per_step
            self.envelope = self._measured = Envelope(
                admitted, admitted + planned.text_tokens, 1, planned.text_tokens
            ).narrowest(planned)
            logger.warning(
                "The measured step (%s) failed (%s: %s): serving only what the deploy must admit, %s",
                _request_shape(request),
                type(exc).__name__,
                exc,
                self.envelope,
            )
            return
        measured = [s.envelope for s in self.rank_stats.values() if s.request_id == request.request_id]
        if len(measured) < self.world_size or None in measured:
            return  # no figure on some rank (no GPU, no test double): the plans' envelope stands
        envelope = measured[0]
        for other in measured[1:]:
            envelope = other.narrowest(envelope)
        self.envelope = self._measured = envelope
        logger.info("Measured one step at %s; serving %s (planned %s)", _request_shape(request), envelope, planned)

    def _fail_start(self, message: str) -> None:
        with self._group_lock:
            if self._stopping.is_set():
                raise _ShutDown()
            self._kill_locked()
            self.failed = message.splitlines()[0]
        raise WorkerStartError(message)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.failed is None and not self._closing.is_set()

    def is_healthy(self) -> bool:
        return self.is_ready and self._dead_worker() is None

    def status(self) -> ExecutorStatus:
        """The group's state for /health, with the reason of the last restart (a missed deadline, a death)."""
        history = dict(
            restarts=self.restarts,
            last_restart_reason=self.last_restart_reason,
            graph_capture_failures=self.graph_capture_failures,
            last_graph_capture_failure=self.last_graph_capture_failure,
        )
        if self._closing.is_set():
            return ExecutorStatus("shutting_down", **history)
        if self.failed:
            return ExecutorStatus("failed", self.failed, **history)
        if not self._ready.is_set():
            if self.restarts:
                detail = f"a new worker group is loading after: {self.last_restart_reason}"
                return ExecutorStatus("restarting", detail, **history)
            return ExecutorStatus("loading", **history)
        dead = self._dead_worker()
        if dead is not None:
            detail = f"worker rank {dead[0]} {dead[1]}; the group is respawned when idle"
            return ExecutorStatus("unhealthy", detail, **history)
        if not self._warm:
            detail = "running the warm-up requests (compiles, CUDA graph captures)"
            return ExecutorStatus("warming_up", detail, **history)
        return ExecutorStatus("ok", **history)

    def _restart_locked(self, reason: str) -> None:
        """Kill every worker and start a fresh group, without waiting for it (needs self._lock)."""
        with self._group_lock:
            if self._stopping.is_set():  # shutdown wins: a dead or stuck group is what it wants anyway
                logger.warning("Not restarting the workers (shutting down): %s", reason)
                raise _ShutDown()
            logger.error("Restarting workers: %s", reason)
            self._kill_locked()
            self.restarts += 1
            self.last_restart_reason = reason
            self._spawn_locked()

    def check_workers(self) -> None:
        """The server's watchdog: respawn an idle group whose worker died, and note ranks that finished loading.

        Never waits: a request in flight (or a caller waiting for the load) watches the workers itself.
        Raises WorkerStartError, with `failed` set, when a new group cannot load.
        """
        if self.failed or self._stopping.is_set():
            return
        if not self._lock.acquire(blocking=False):
            return
        try:
            if self._ready.is_set():
                dead = self._dead_worker()
                if dead is not None:
                    self._restart_locked(f"worker rank {dead[0]} {dead[1]}")
            self._await_ready(until=time.monotonic())
        except _ShutDown:
            pass
        finally:
            self._lock.release()

    def begin_shutdown(self) -> None:
        """From now on no request starts and no worker group is started or restarted.

        A request in flight runs on (the caller may have cancelled it) until it ends or misses a
        deadline, which then fails it without a restart. `shutdown()` ends everything.
        """
        self._stopping.set()

    def shutdown(self) -> None:
        """Stop the workers for good; from here on nothing is executed, collected or respawned.

        A request in flight stops at once (its execute() raises RequestCancelled) and its workers are
        killed, as are loading ones; idle workers leave their loop and close their process groups.
        """
        self._stopping.set()
        self._closing.set()
        # Whoever holds the lock sees _closing within one poll and lets go.
        if self._lock.acquire(timeout=5 * POLL_S):
            try:
                if self._group_idle and self._ready.is_set() and self._dead_worker() is None:
                    self._stop_idle_group(time.monotonic() + IDLE_EXIT_S)
            finally:
                self._lock.release()
        with self._group_lock:
            self._kill_locked()
        self._release()

    def _kill_locked(self) -> None:
        self._kill_group()
        self._ready.clear()
        self._ready_ranks = set()
        self.envelope = None

    # ---- requests ----------------------------------------------------------------------------

    def execute(
        self, request: DiffusionRequest, on_progress: ProgressCallback | None = None, interleave: bool = False
    ) -> Any:
        """Run `request` on every rank and return rank 0's images.

        `on_progress(done, total, phase)` is called as rank 0 reports the start (0), each finished
        denoising step, and the tokens of a family's encode stage ("encode"). Raises RequestFailed when
        the request fails (the group is restarted when it was left dead, stuck or hung past
        `stall_timeout_s`), RequestCancelled when it was cancelled or the executor is shutting down
        (begin_shutdown() or shutdown()).

        `interleave`: while the group runs other requests, send this one at once; the ranks run it inside
        the running one, from that one's next step (worker.RankServer), and this thread waits for it. A
        restart fails every request in flight. Without it (or on an idle group) the request waits its turn.
        """
        flight = self._flights.send_inside(request, on_progress) if interleave and not self._stopping.is_set() else None
        if flight is not None:
            flight.finished.wait()
            return self._outcome(flight)
        with self._lock:
            if self._stopping.is_set():
                raise RequestCancelled(f"request {request.request_id} not run: the engine is shutting down")
            if self.failed:
                raise RequestFailed(f"the workers are down: {self.failed}")
            try:
                dead = self._dead_worker()
                if dead is not None and self._ready.is_set():
                    self._restart_locked(f"worker rank {dead[0]} {dead[1]}")
                self._await_ready(math.inf)
                self._group_idle = False
                return self._collect(request, on_progress)
            except _ShutDown:
                raise RequestCancelled(f"request {request.request_id} stopped: the engine is shutting down") from None
            except WorkerStartError as exc:
                raise RequestFailed(f"the workers could not be started: {exc}") from exc

    @property
    def request_stats(self) -> dict[int, Stats]:
        """Each rank's figures for the request this thread's last `execute` ran (`rank_stats` is the group's latest)."""
        return getattr(self._thread, "stats", {})

    @property
    def request_audio(self) -> Audio | None:
        """The sound of the videos this thread's last `execute` returned (rank 0's), None where they have none."""
        return getattr(self._thread, "audio", None)

    def _outcome(self, flight: Flight) -> Any:
        """Rank 0's images for `flight`'s request (or raise how it ended); its figures and sound kept for this
        thread (`request_stats`, `request_audio`)."""
        self._thread.stats = flight.stats
        done = flight.replies.get(0)
        self._thread.audio = done.audio if isinstance(done, Done) else None
        return flight.outcome()

    def _collect(self, request: DiffusionRequest, on_progress: ProgressCallback | None) -> Any:
        """Send `request` and read the group's reports (needs self._lock) until it and every request sent to run
        inside it have ended; returns its images or raises how it ended."""
        flight = self._flights.send(request, on_progress)
        self._last_progress = time.monotonic()
        try:
            while self._flights:
                self._read_report()
        except Exception as exc:
            self._flights.end_all(exc, shut_down=isinstance(exc, _ShutDown))  # a restart, a shutdown: none is left
            if isinstance(exc, _ShutDown) or flight.error is exc:
                raise
            if flight.error is not None:  # it was in flight when a request run inside it failed the group
                raise flight.error from exc
            # It had ended before a request sent to run inside it (too late, so after it) failed the group.
        else:
            self._group_idle = True  # every rank answered every request sent
        return self._outcome(flight)

    def _read_report(self) -> None:
        """One report (or a poll's wait) for the requests in flight, with the group's deadlines checked first."""
        if self._closing.is_set():
            raise _ShutDown()
        now = time.monotonic()
        flights = self._flights.in_flight()
        for flight in flights:
            if now > flight.stuck_after:  # the first error is the cause; the ranks left waiting are its effect
                cause = next(reply for reply in flight.replies.values() if isinstance(reply, Failed))
                busy = sorted(set(range(self.world_size)) - set(flight.replies))
                self._fail_hung(flight.request, f"failed ({cause.error}) and rank(s) {busy} did not finish", cause)
        stall_s = self.config.stall_timeout_s
        if now - self._last_progress > stall_s:
            where = (
                flights[0].where()
                if len(flights) == 1
                else "; ".join(f"{f.request.request_id}: {f.where()}" for f in flights)
            )
            self._fail_hung(flights[-1].request, f"made no progress for {stall_s:g} s (stall_timeout_s): {where}")
        try:
            report = self._next_report(POLL_S)
        except queue.Empty:
            dead = self._dead_worker()
            if dead is not None:
                rank, how = dead
                during = ", ".join(flight.request.request_id for flight in self._flights.in_flight())
                self._restart_locked(f"worker rank {rank} {how} during {during}")
                raise RequestFailed(
                    f"a worker died while running the request (rank {rank} {how}); the workers are restarting"
                ) from None
            return
        flight = self._flights.record(report)
        if flight is None:
            return  # a late message about an earlier request
        self._last_progress = time.monotonic()
        match report:
            case GraphCaptureFailed(rank=rank, reason=reason):
                self.graph_capture_failures += 1
                self.last_graph_capture_failure = f"rank {rank}: {reason}"
                logger.warning("CUDA graph capture failed on rank %d during %s: %s", rank, report.request_id, reason)
            case Stats():
                self.rank_stats[report.rank] = report
            case Done() | Failed() | Cancelled():
                if isinstance(report, Failed) and flight.stuck_after == math.inf:
                    flight.stuck_after = self._last_progress + min(STUCK_AFTER_ERROR_S, stall_s)
                if isinstance(report, Failed) and _restarts_group(report, self.world_size):
                    # Its peers may be inside a collective it left: no waiting for them to get stuck.
                    self._restart_locked(f"request {report.request_id} ran out of memory on rank {report.rank}")
                    raise out_of_memory_error(flight.request, report, restarting=True)
                self._flights.end_if_answered(flight)

    def _fail_hung(self, request: DiffusionRequest, why: str, cause: Failed | None = None) -> None:
        """The group is stuck in this request: restart it, and fail the request saying why."""
        self._restart_locked(f"request {request.request_id} {why}")
        if cause is not None and cause.out_of_memory:
            raise out_of_memory_error(request, cause, restarting=True)
        raise RequestFailed(f"request {request.request_id} {why}; the workers are restarting")


def _restarts_group(failed: Failed, world_size: int) -> bool:
    """An out-of-memory error outside an agreed point, on a group of several ranks (the module's rule)."""
    return failed.out_of_memory is not None and not failed.agreed and world_size > 1


def _request_shape(request: DiffusionRequest) -> str:
    size = f"{request.width}x{request.height}" if request.width else "default size"
    return size + (f"x{request.num_frames}" if request.num_frames else "")
