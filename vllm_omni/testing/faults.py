"""Injected faults for the deadline and memory tests: one rank hangs, raises, pauses, runs out of memory or
leaks at one step (`InjectedFault`).

Off unless the env var VLLM_OMNI_TEST_FAULT is set; read once per rank (testing/hooks.py), whose hooks call
`trigger` at each denoising step, decode tile, encode token, prompt encoding and adapter merge (the hook points).
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass

from vllm_omni import envs
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

TEST_FAULT_ENV = envs.TEST_FAULT
KINDS = ("hang", "raise", "pause", "oom", "leak")
PHASES = ("step", "decode", "encode", "text", "lora")
LEAK_BYTES = 64 * 1024
_LEAKED: list = []  # what "leak" faults keep, for the process's life


@dataclass(frozen=True)
class InjectedFault:
    """One rank hangs, raises, runs out of memory or leaks at one step of the requests with one prompt.

    VLLM_OMNI_TEST_FAULT='{"kind": "hang", "rank": 1, "step": 1, "prompt": "stall here"}' makes
    rank 1 block forever (or raise, with "raise"; or, with "pause", wait until the request is
    cancelled) at the end of denoising step 1 (0-based) of every request whose prompt is "stall
    here" (every request when "prompt" is left out), before the group agrees on the step: its peers
    then wait in a collective. "oom" raises torch.OutOfMemoryError with CUDA's text, as an
    allocation there would; "leak" keeps a tensor and a Python buffer (LEAK_BYTES each) for the
    process's life and goes on. With "phase": "decode", "step" is a tile of the split VAE decode;
    with "encode", a token of a family's encode stage (an autoregressive prior), on the rank that runs it;
    with "text" (step 0), the start of the prompt encoding on the rank that encodes it once for its
    SP group (the runner's text-once path); with "lora" (step 0), as the rank merges the request's adapter.
    A JSON list sets several faults. The deadline and memory
    tests (tests/diffusion/executor/test_worker_deadlines.py, tests/entrypoints/test_serve_lifetime.py,
    tests/entrypoints/test_omni_memory.py) use it.
    """

    kind: str
    rank: int
    step: int
    prompt: str | None = None
    phase: str = "step"  # "decode": a tile of a split VAE decode; "encode": a token of an encode stage; "text", "lora"

    @classmethod
    def from_env(cls) -> list[InjectedFault]:
        text = os.environ.get(TEST_FAULT_ENV)
        if not text:
            return []
        specs = json.loads(text)
        faults = [cls(**spec) for spec in (specs if isinstance(specs, list) else [specs])]
        for fault in faults:
            if fault.kind not in KINDS:
                raise ValueError(f"{TEST_FAULT_ENV}: kind must be one of {KINDS}, got {fault.kind!r}")
            if fault.phase not in PHASES:
                raise ValueError(f"{TEST_FAULT_ENV}: phase must be one of {PHASES}, got {fault.phase!r}")
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
        if self.kind == "oom":
            import torch

            raise torch.OutOfMemoryError(
                f"CUDA out of memory. Tried to allocate 20.00 GiB. GPU {rank} has a total capacity of 23.54 GiB of "
                f"which 1.25 GiB is free. (test fault on rank {rank} at {phase} {step})"
            )
        if self.kind == "leak":
            import torch

            _LEAKED.append((torch.zeros(LEAK_BYTES // 4), bytearray(LEAK_BYTES)))
            return
        if self.kind == "pause":  # until the request is cancelled: a cancel that lands inside this phase
            while not cancelled():
                threading.Event().wait(0.01)
            return
        threading.Event().wait()  # until the executor kills this process
