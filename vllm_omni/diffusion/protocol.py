"""The rank protocol: what a rank reports to its executor (one frozen dataclass per report), where a Ray rank
runs, and the group's health states.

The worker (worker.run_rank) and a Ray rank actor (executor/ray.RankActor) send these; the executors
(base.WorkerGroupExecutor, ray.RayExecutor) match them by type. They cross processes pickled (a
multiprocessing queue, Ray's object store), so they hold plain data. A contract between the layers, it sits at the
bottom: the worker, the executor, the engine, the scheduler and /metrics all import it, and it imports only the
bottom (config, request).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, get_args

from vllm_omni.diffusion.config import MAX_NUM_SEQS, Envelope
from vllm_omni.diffusion.request import Audio, RequestError

if TYPE_CHECKING:
    import numpy as np

# loading: the first load; warming_up: a loaded group runs its warm-up requests; ok: serving;
# restarting: a new group loads after a restart; unhealthy: a worker died while idle (respawned
# before the next request); failed: lost for good; shutting_down: stopping, or stopped.
HealthState = Literal["loading", "warming_up", "ok", "restarting", "unhealthy", "failed", "shutting_down"]
HEALTH_STATES: tuple[HealthState, ...] = get_args(HealthState)

# "encode": a family's long encode stage (an autoregressive prior's tokens, before any step); "denoise": the
# denoising steps (and the split decode's tiles, reported as the last step: the rank is alive).
ProgressPhase = Literal["denoise", "encode"]
# on_progress(done, total, phase), called in the executor's thread as rank 0 reports progress.
ProgressCallback = Callable[[int, int, ProgressPhase], None]


# The cancelled requests a rank can see at once: those in flight on its group (interleaving nests at most
# --max-num-seqs of them). A rank reads them as `cancel_token[:]`.
CANCEL_SLOTS = MAX_NUM_SEQS


@dataclass(frozen=True)
class RankReport:
    """Any report; `rank` sent it."""

    rank: int


@dataclass(frozen=True)
class Ready(RankReport):
    """The rank joined its process groups and loaded the pipeline; `envelope`: what its memory plan found fits
    (None: no device memory to plan against, as on a CPU)."""

    envelope: Envelope | None = None


@dataclass(frozen=True)
class LoadFailed(RankReport):
    """The rank could not load; `detail` is the error and its traceback."""

    detail: str


@dataclass(frozen=True)
class Log(RankReport):
    """A Ray rank's vllm_omni log record, plain data, for the driver's log."""

    record: logging.LogRecord


@dataclass(frozen=True)
class RankPlacement:
    """Where a rank runs: node id and bundle index name it (an IP may be shared by several nodes)."""

    rank: int
    node_id: str
    bundle_index: int
    ip: str
    pid: int

    def __str__(self) -> str:
        return f"node {self.node_id[:12]} ({self.ip}), bundle {self.bundle_index}, pid {self.pid}"


@dataclass(frozen=True)
class Placed(RankReport):
    """Where Ray placed the rank's actor."""

    where: RankPlacement


@dataclass(frozen=True)
class RequestReport(RankReport):
    """A report about one request; one about an earlier request arrives late and is dropped."""

    request_id: str


@dataclass(frozen=True)
class Progress(RequestReport):
    """`done` of `total` in `phase`: the request's start (0), each step or encode token, each decode tile."""

    done: int
    total: int
    phase: ProgressPhase = "denoise"


@dataclass(frozen=True)
class GraphCaptureFailed(RequestReport):
    """A CUDA graph capture failed on this rank (its SP group runs eager until the next restart)."""

    reason: str


@dataclass(frozen=True)
class Stats(RequestReport):
    """The rank's figures once the request finished; the engine and the metrics read the last one per rank."""

    phase_seconds: dict[str, float]  # encode, denoise, decode; onload (offloaded weights moved in)
    graph_captures: int  # since the rank's group started
    compiles: int  # graphs torch.compile compiled, likewise
    step_cache: dict[str, Any] | None = None  # the step cache's record (step_cache.CacheRecord.summary)
    peak_memory_bytes: int | None = None  # on CUDA: peak allocated memory during the request
    allocated_memory_bytes: int | None = None  # on CUDA: allocated once the request's tensors were dropped
    reserved_memory_bytes: int | None = None  # on CUDA: held by the caching allocator then
    cfg_one_pass_steps: int = 0  # steps whose CFG branches ran as one forward (worker/cfg_batch.py)
    # A profile request's (the warm-up's measured step): the envelope the measured step leaves on this rank.
    envelope: Envelope | None = None
    # What a rank's hooks add (worker/hooks.py, RankHooks.request_extras): test-only figures, empty in production.
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Done(RequestReport):
    """The request finished on this rank; `images` are rank 0's (uint8 or float32 array), None elsewhere, and so is
    `audio`, the videos' sound where the model makes some."""

    images: np.ndarray | None = None
    audio: Audio | None = None


# Where a request was when its rank ran out of memory: encoding its text, denoising, decoding.
RunPhase = Literal["encode", "denoise", "decode"]


@dataclass(frozen=True)
class Failed(RequestReport):
    """The request failed on this rank: bad input only a worker could see (a RequestError, with its
    param), or any other error as its text.

    `out_of_memory`: the phase in which the rank ran out of device memory (None: another error);
    `agreed`: it raised that error at a point every rank of its SP group reached together (the prompt
    encoding's broadcast), so no peer was left inside a collective.
    """

    error: RequestError | str
    out_of_memory: RunPhase | None = None
    agreed: bool = False


@dataclass(frozen=True)
class Cancelled(RequestReport):
    """The request was cancelled; every rank stopped at the same step."""

    reason: str
