"""A request's life in the scheduler (scheduler.py): its status, progress and times, then a result or an error.

Its own module so that what orders jobs (policy.py) and what runs them (scheduler.py) both import it without
importing each other.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Literal

from vllm_omni.diffusion.request import DiffusionOutput, DiffusionRequest

JobStatus = Literal["queued", "in_progress", "completed", "failed", "cancelled"]
ErrorCode = Literal["invalid_request", "server_error", "out_of_memory", "cancelled", "shutting_down"]
MESSAGE_CHARS = 500  # a client's error message is one line, at most this long


def one_line(error: BaseException | str) -> str:
    """The first line of an error's text (a worker's load error carries its whole traceback)."""
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    if not line and isinstance(error, BaseException):
        line = type(error).__name__
    return line if len(line) <= MESSAGE_CHARS else line[: MESSAGE_CHARS - 3] + "..."


@dataclass(frozen=True)
class JobError:
    """Why a job did not complete.

    code: "invalid_request" (bad input; `param` names the field), "server_error" (the engine or
    the workers failed), "out_of_memory" (the request needed more device memory than a rank had;
    the message names its size), "cancelled" (`Scheduler.cancel`), "shutting_down" (the server stops).
    """

    code: ErrorCode
    message: str  # one line, for the client; details go to the log
    param: str | None = None


@dataclass(eq=False)
class Job:
    """One request's life, whether or not anyone waits for it: its status, progress and times, then a
    result or an error. Callers wait for it (`wait`), poll it (`Scheduler.get`) or cancel it."""

    id: str  # also the engine's request id, in every log line about it
    request: DiffusionRequest
    status: JobStatus = "queued"
    progress: int = 0  # percent of `phase` done: its denoising steps (or of an encode stage's tokens)
    phase: str = "denoise"  # "encode" while a family's long encode stage runs (an autoregressive prior's tokens)
    created_at: float = field(default_factory=time.time)  # Unix times
    started_at: float | None = None
    completed_at: float | None = None
    result: DiffusionOutput | None = None
    error: JobError | None = None
    exception: BaseException | None = field(default=None, repr=False)  # what its run raised (`Omni` raises it)
    replica: int | None = None  # the replica that runs it, once it runs
    batch_key: tuple | None = None  # jobs with equal keys may share a forward (None: never batched)
    overtaken: int = 0  # jobs queued after it that started before it, or ran inside it (the fair policy's age bound)
    call: list[Job] = field(default_factory=list, repr=False)  # the jobs of its engine call (a batch: several)
    suspended_s: float = 0.0  # seconds it waited between two of its steps while requests ran inside it
    _done: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    _cancel_reason: str | None = field(default=None, repr=False)

    @property
    def finished(self) -> bool:
        return self.status in ("completed", "failed", "cancelled")

    async def wait(self) -> Job:
        """Until the job completed, failed or was cancelled."""
        await self._done.wait()
        return self
