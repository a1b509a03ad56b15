"""The requests in flight on a worker group, and each rank's report routed to the request it is about.

One request runs at a time, except that requests may be sent to run inside it (interleaving: they nest,
outermost first). The thread that runs the outermost one reads every report (base.py, which keeps the group's
deadlines and restarts it) and hands each to `Flights.record`; a request ends once every rank has answered it,
and the thread that waits on its `Flight` gets rank 0's images or its error. The cancel flags the ranks read
live here too: a request's flag stays until it ends.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from vllm_omni.diffusion.executor.errors import out_of_memory_error
from vllm_omni.diffusion.protocol import (
    CANCEL_SLOTS,
    Cancelled,
    Done,
    Failed,
    Progress,
    ProgressCallback,
    RankReport,
    RequestReport,
    Stats,
)
from vllm_omni.diffusion.request import DiffusionRequest, RequestCancelled, RequestError, RequestFailed
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


@dataclass(eq=False)
class Flight:
    """One request in flight on the group: its ranks' reports so far, then how it ended."""

    request: DiffusionRequest
    on_progress: ProgressCallback | None
    world_size: int
    replies: dict[int, Done | Failed | Cancelled] = field(default_factory=dict)
    steps: dict[int, Progress] = field(default_factory=dict)
    stats: dict[int, Stats] = field(default_factory=dict)
    stuck_after: float = math.inf  # when ranks still busy after another rank's error count as stuck
    finished: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None

    def progress(self, report: Progress) -> None:
        if report.rank != 0 or self.on_progress is None:
            return
        try:
            self.on_progress(report.done, report.total, report.phase)
        except Exception:  # noqa: BLE001 - a broken callback must not break the request
            logger.exception("Progress callback failed for %s; not called again", self.request.request_id)
            self.on_progress = None

    def where(self) -> str:
        return ", ".join(
            f"rank {rank} {'finished' if rank in self.replies else _step_text(self.steps.get(rank))}"
            for rank in range(self.world_size)
        )

    def end(self, error: BaseException | None = None) -> None:
        self.error = error
        self.finished.set()

    def outcome(self) -> Any:
        """Rank 0's images, or raise how the request ended."""
        if self.error is not None:
            raise self.error
        replies = self.replies
        if all(isinstance(reply, Done) for reply in replies.values()):
            return replies[0].images
        failures = [reply for reply in replies.values() if isinstance(reply, Failed)]
        if failures:
            failed = failures[0]
            if isinstance(failed.error, RequestError):  # the client's mistake, found in a worker (a damaged image)
                raise failed.error
            ooms = [reply for reply in failures if reply.out_of_memory]
            if ooms:  # one rank, or every rank at an agreed point: the group serves on
                # The lowest rank: at the prompt encoding, the one that encoded (its peers got a copy).
                raise out_of_memory_error(self.request, min(ooms, key=lambda reply: reply.rank), restarting=False)
            raise RequestFailed(failed.error)
        raise RequestCancelled(replies[0].reason if isinstance(replies[0], Cancelled) else "cancelled")


class Flights:
    """The requests in flight on one group, outermost first, and the cancel tokens flagged on its ranks.

    `send` sends a request to every rank, `flag_cancels` sets the tokens every rank reads as cancelled (the
    executor backend's). Thread-safe: a request sent to run inside the running ones comes from another thread.
    """

    def __init__(
        self,
        world_size: int,
        send: Callable[[DiffusionRequest], None],
        flag_cancels: Callable[[list[int]], None],
    ) -> None:
        self.world_size = world_size
        self._send = send
        self._flag_cancels = flag_cancels
        self._flights: dict[str, Flight] = {}
        self._lock = threading.Lock()
        self._cancelled: list[int] = []  # cancel tokens flagged on the ranks, oldest first

    def __bool__(self) -> bool:
        with self._lock:
            return bool(self._flights)

    def in_flight(self) -> list[Flight]:
        """The requests in flight, outermost first."""
        with self._lock:
            return list(self._flights.values())

    def send(self, request: DiffusionRequest, on_progress: ProgressCallback | None) -> Flight:
        """Send `request` to every rank; its flight, which `record` fills and whose `finished` is set at its end."""
        flight = Flight(request, on_progress, self.world_size)
        with self._lock:
            self._flights[request.request_id] = flight
            self._send(request)
        return flight

    def send_inside(self, request: DiffusionRequest, on_progress: ProgressCallback | None) -> Flight | None:
        """Send `request` to run inside the requests in flight and return its flight; None when none is in flight."""
        with self._lock:
            if not self._flights:
                return None
            flight = self._flights[request.request_id] = Flight(request, on_progress, self.world_size)
            self._send(request)
            logger.info("Request %s sent to run inside %s", request.request_id, ", ".join(list(self._flights)[:-1]))
            return flight

    def record(self, report: RankReport) -> Flight | None:
        """Note `report` on the flight of the request it is about, and return that flight; None for a report about
        no request in flight (a late message about an earlier request)."""
        with self._lock:
            flight = self._flights.get(report.request_id) if isinstance(report, RequestReport) else None
        if flight is None:
            return None
        match report:
            case Stats():
                flight.stats[report.rank] = report
            case Progress():
                flight.steps[report.rank] = report
                flight.progress(report)
            case Done() | Failed() | Cancelled():
                flight.replies[report.rank] = report
        return flight

    def end_if_answered(self, flight: Flight) -> None:
        """Once every rank has answered `flight`'s request, it ends: its cancel flag goes and its waiter wakes."""
        if len(flight.replies) < self.world_size:
            return
        with self._lock:
            del self._flights[flight.request.request_id]
            self._forget_cancel(flight.request.cancel_token)
        flight.end()

    def end_all(self, error: BaseException, shut_down: bool) -> None:
        """Every request still in flight ends: the innermost with `error` (the one whose failure restarted the
        group), the others with a RequestFailed saying the group restarted under them; all cancelled when
        `shut_down`."""
        with self._lock:
            flights, self._flights = list(self._flights.values()), {}
            for flight in flights:
                self._forget_cancel(flight.request.cancel_token)
        for flight in flights:
            if shut_down:
                why = RequestCancelled(f"request {flight.request.request_id} stopped: the engine is shutting down")
            elif flight is flights[-1] or isinstance(error, RequestCancelled):
                why = error
            else:
                why = RequestFailed(
                    f"request {flight.request.request_id} was in flight when another failed the group ({error}); "
                    "the workers are restarting"
                )
            flight.end(why)

    def cancel(self, cancel_token: int) -> None:
        """Flag the request with this cancel token on every rank (the newest CANCEL_SLOTS flags are kept)."""
        with self._lock:
            self._cancelled = [token for token in self._cancelled if token != cancel_token][1 - CANCEL_SLOTS :]
            self._cancelled.append(cancel_token)
            self._flag_cancels(self._cancelled + [-1] * (CANCEL_SLOTS - len(self._cancelled)))

    def _forget_cancel(self, cancel_token: int) -> None:
        """The request with this token ended: its flag goes (needs self._lock)."""
        if cancel_token in self._cancelled:
            self._cancelled.remove(cancel_token)
            self._flag_cancels(self._cancelled + [-1] * (CANCEL_SLOTS - len(self._cancelled)))


def _step_text(progress: Progress | None) -> str:
    if progress is None:
        return "had not started"
    where = "encoding at" if progress.phase == "encode" else "at step"
    return f"{where} {progress.done}/{progress.total}"
