"""What a request passes before its job joins the scheduler's queue (scheduler.py): the server takes work
(lifecycle.py), the queue has a place for it (held while the request is checked), and the engine's checks
accept it. Its refusals, `QueueFull` with a Retry-After and `InternalError`, are what the routes answer 503 and
500 for. (admission.py is another admission: what a deploy's memory admits.)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import deque
from collections.abc import Callable, Sized
from typing import Any

from vllm_omni.diffusion.engine.job import Job, one_line
from vllm_omni.diffusion.engine.lifecycle import Lifecycle
from vllm_omni.diffusion.engine.replicas import Engine
from vllm_omni.diffusion.request import DiffusionRequest, GenerationParams, RequestError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class QueueFull(Exception):
    def __init__(self, max_queue: int, retry_after_s: int) -> None:
        super().__init__(f"the queue is full ({max_queue} request(s) waiting behind the running one); retry later")
        self.retry_after_s = retry_after_s


class InternalError(Exception):
    """The engine's checks failed unexpectedly (logged with its traceback); the message is one line."""


class QueuePlace:
    """A place held in the queue; leaving the `with` block gives it back (a queued job has its own)."""

    def __init__(self, admission: QueueAdmission) -> None:
        self._admission: QueueAdmission | None = admission

    def __enter__(self) -> QueuePlace:
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._admission is not None:
            self._admission.reserved -= 1
            self._admission = None


class QueueAdmission:
    """The gate in front of one queue of `max_queue` places: `waiting` is the queue, `running` its jobs in flight."""

    def __init__(self, lifecycle: Lifecycle, max_queue: int, waiting: Sized, running: Callable[[], list[Job]]) -> None:
        self.lifecycle = lifecycle
        self.max_queue = max_queue
        self._waiting = waiting
        self._running = running
        self.reserved = 0  # submits past the capacity check, still in the engine's checks
        self.run_seconds: deque[float] = deque(maxlen=16)  # recent run times, for Retry-After

    def check_capacity(self) -> None:
        """QueueFull when `max_queue` requests already wait (or are being checked) behind the running one."""
        if len(self._waiting) + self.reserved >= self.max_queue:
            raise QueueFull(self.max_queue, self.retry_after_s())

    def hold_place(self) -> QueuePlace:
        """A place in the queue, held while a request is checked (`with` it; `place_held=True` to submit). The routes
        read a body before they submit, so a silent upload holds no place.

        Raises Unavailable or QueueFull at once, before anything is read.
        """
        self.lifecycle.check_accepting()
        self.check_capacity()
        self.reserved += 1
        return QueuePlace(self)

    def retry_after_s(self) -> int:
        """Seconds until a place in the queue is likely free: what the running job has left, about."""
        typical = sum(self.run_seconds) / len(self.run_seconds) if self.run_seconds else 1.0
        started = [job.started_at for job in self._running() if job.started_at]
        elapsed = time.time() - min(started) if started else 0.0
        return max(1, min(3600, math.ceil(typical - elapsed)))

    async def check(
        self, engine: Engine, params: GenerationParams, request_id: str, policy: str, place_held: bool
    ) -> DiffusionRequest:
        """`params` as request `request_id`, checked by `engine` (under the scheduling `policy`), with a place in the
        queue held meanwhile unless the caller holds one; raises Unavailable, QueueFull, RequestError (bad input)
        or InternalError."""
        if params.priority not in (None, 0) and policy != "priority":
            raise RequestError(
                f"priority {params.priority!r} is taken only by a server started with --scheduling-policy priority "
                f"(this one schedules {policy}); leave it out or 0",
                "priority",
            )
        with contextlib.nullcontext() if place_held else self.hold_place():
            try:
                return await asyncio.to_thread(engine.preprocess, dataclasses.replace(params, request_id=request_id))
            except RequestError:
                raise
            except Exception as exc:
                logger.exception("Request %s: the checks failed unexpectedly", request_id)
                message = one_line(f"{type(exc).__name__}: {exc}")
                raise InternalError(f"could not check the request: {message}") from None
