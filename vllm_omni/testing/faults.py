"""Injected faults for the deadline tests: one rank hangs, raises or pauses at one step (`InjectedFault`).

Off unless the env var VLLM_OMNI_TEST_FAULT is set; the worker (worker._serve) reads it once per
rank and calls `trigger` at each denoising step, decode tile and encode token.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

TEST_FAULT_ENV = "VLLM_OMNI_TEST_FAULT"


@dataclass(frozen=True)
class InjectedFault:
    """One rank hangs or raises at one step of the requests with one prompt.

    VLLM_OMNI_TEST_FAULT='{"kind": "hang", "rank": 1, "step": 1, "prompt": "stall here"}' makes
    rank 1 block forever (or raise, with "raise"; or, with "pause", wait until the request is
    cancelled) at the end of denoising step 1 (0-based) of every request whose prompt is "stall
    here" (every request when "prompt" is left out), before the group agrees on the step: its peers
    then wait in a collective. With "phase": "decode", "step" is a tile of the split VAE decode; with
    "encode", a token of a family's encode stage (GLM-Image's AR), on the rank that runs it.
    A JSON list sets several faults. The deadline tests (tests/diffusion/test_worker_deadlines.py,
    tests/entrypoints/test_serve_lifetime.py) use it.
    """

    kind: str
    rank: int
    step: int
    prompt: str | None = None
    phase: str = "step"  # "decode": `step` is a tile of a split VAE decode; "encode": a token of an encode stage

    @classmethod
    def from_env(cls) -> list[InjectedFault]:
        text = os.environ.get(TEST_FAULT_ENV)
        if not text:
            return []
        specs = json.loads(text)
        faults = [cls(**spec) for spec in (specs if isinstance(specs, list) else [specs])]
        for fault in faults:
            if fault.kind not in ("hang", "raise", "pause"):
                raise ValueError(f"{TEST_FAULT_ENV}: kind must be 'hang', 'raise' or 'pause', got {fault.kind!r}")
            if fault.phase not in ("step", "decode", "encode"):
                raise ValueError(f"{TEST_FAULT_ENV}: phase must be 'step', 'decode' or 'encode', got {fault.phase!r}")
        return faults

    def trigger(
        self,
        rank: int,
        step: int,
        request: DiffusionRequest,
        phase: str = "step",
        cancelled: Callable[[], bool] | None = None,
    ) -> None:
        """Act when this is the fault's rank, step, phase and prompt; `cancelled` tells a "pause" when to end."""
        if rank != self.rank or step != self.step or phase != self.phase or self.prompt not in (None, request.prompt):
            return
        logger.warning(
            "Test fault: rank %d %ss at %s %d of request %s", rank, self.kind, phase, step, request.request_id
        )
        if self.kind == "raise":
            raise RuntimeError(f"test fault on rank {rank} at {phase} {step}")
        if self.kind == "pause":  # until the request is cancelled: a cancel that lands inside this phase
            while not cancelled():
                threading.Event().wait(0.01)
            return
        threading.Event().wait()  # until the executor kills this process
