"""The rank protocol (diffusion/protocol.py): every report survives the trip between processes
(pickle for multiprocessing queues, Ray's cloudpickle), and one health vocabulary is used by the
executor, the engine and the scheduler."""

from __future__ import annotations

import inspect
import logging
import pickle
from typing import get_type_hints

import numpy as np
import pytest

from vllm_omni.diffusion import protocol
from vllm_omni.diffusion.engine import core, lifecycle
from vllm_omni.diffusion.executor.base import ExecutorStatus
from vllm_omni.diffusion.protocol import (
    HEALTH_STATES,
    Cancelled,
    Done,
    Failed,
    GraphCaptureFailed,
    HealthState,
    LoadFailed,
    Log,
    Placed,
    Progress,
    RankPlacement,
    RankReport,
    Ready,
    RequestReport,
    Stats,
)
from vllm_omni.diffusion.request import RequestError

PLACEMENT = RankPlacement(1, "node-a", 3, "10.0.0.2", 4242)
try:  # Ray is optional: without it, its pickler is left out
    from ray import cloudpickle

    PICKLERS = [pickle, cloudpickle]
except ImportError:
    PICKLERS = [pickle]

REPORTS = [
    Ready(1),
    LoadFailed(1, "OSError: no weights\nTraceback ..."),
    Log(1, logging.makeLogRecord({"name": "vllm_omni.worker", "msg": "loaded", "levelno": logging.INFO})),
    Placed(1, PLACEMENT),
    Progress(0, "req-1", 2, 4),
    Progress(0, "req-1", 17, 261, "encode"),
    GraphCaptureFailed(1, "req-1", "capture ran out of memory"),
    Stats(1, "req-1", {"denoise": 0.5, "decode": 0.1}, graph_captures=2, compiles=1),
    Stats(
        0,
        "req-1",
        {"encode": 0.2},
        graph_captures=0,
        compiles=0,
        step_cache={"decisions": {"cond": {0: True, 1: False}}, "changes": [0.1]},
        peak_memory_bytes=2**30,
        allocated_memory_bytes=2**29,
        reserved_memory_bytes=3 * 2**29,
        extras={"memory_trace": {"objects": 5, "tensors": 2, "tensor_bytes": 64}},
    ),
    Done(0, "req-1", np.arange(12, dtype=np.uint8).reshape(1, 2, 2, 3)),
    Done(1, "req-1"),
    Failed(0, "req-1", RequestError("the source image cannot be decoded", param="image")),
    Failed(1, "req-1", "RuntimeError: test fault on rank 1 at step 1"),
    Failed(0, "req-1", "OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB", "encode", agreed=True),
    Cancelled(0, "req-1", "request req-1 cancelled at step 2"),
]


def _fields(report: RankReport) -> dict:
    """The report's fields in comparable form (an array as its bytes, an error as its type, text and param)."""
    values = dict(vars(report))
    for name, value in values.items():
        if isinstance(value, np.ndarray):
            values[name] = (value.dtype, value.shape, value.tobytes())
        elif isinstance(value, BaseException):
            values[name] = (type(value), str(value), getattr(value, "param", None))
        elif isinstance(value, logging.LogRecord):
            values[name] = (value.name, value.levelno, value.getMessage())
    return values


def test_every_report_type_has_a_round_trip_case():
    kinds = {
        cls
        for _, cls in inspect.getmembers(protocol, inspect.isclass)
        if issubclass(cls, RankReport) and cls not in (RankReport, RequestReport)
    }
    assert kinds == {type(report) for report in REPORTS}


@pytest.mark.parametrize("pickler", PICKLERS, ids=lambda pickler: pickler.__name__)
@pytest.mark.parametrize("report", REPORTS, ids=lambda report: type(report).__name__)
def test_every_report_survives_the_trip_between_processes(report, pickler):
    back = pickler.loads(pickler.dumps(report))
    assert type(back) is type(report) and _fields(back) == _fields(report)


def test_a_request_error_keeps_its_param_across_the_trip():
    back = pickle.loads(pickle.dumps(Failed(0, "req-1", RequestError("bad image", param="image"))))
    assert isinstance(back.error, RequestError) and back.error.param == "image"


def test_one_health_vocabulary_for_the_executor_the_engine_and_the_scheduler():
    assert get_type_hints(ExecutorStatus)["state"] == HealthState
    assert get_type_hints(lifecycle.Health)["state"] == HealthState
    assert get_type_hints(core.DiffusionEngine.health_status)["return"] == tuple[HealthState, str | None]
    assert HEALTH_STATES == ("loading", "warming_up", "ok", "restarting", "unhealthy", "failed", "shutting_down")
