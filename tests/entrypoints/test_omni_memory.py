"""Memory on a one-rank `Omni("tiny/qwen-image")` (CPU): a request that runs out of memory fails alone
and the rank serves on, and fifty requests of mixed sizes and prompts leave the rank holding what it held.

The worker's VLLM_OMNI_TEST_FAULT hook simulates the out-of-memory error (torch.OutOfMemoryError with
CUDA's text, at a denoising step of requests with OOM_PROMPT) and plants a leak for LEAK_PROMPT;
VLLM_OMNI_TEST_MEMORY_TRACE makes the rank count, as a PROBE request arrives (after the previous one),
its live Python objects and tensors (and the tensors' bytes) after a full collection
(testing/memory_trace.py).
"""

from __future__ import annotations

import itertools
import json
import os

import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.request import RequestOutOfMemory  # noqa: E402
from vllm_omni.testing.faults import LEAK_BYTES  # noqa: E402
from vllm_omni.testing.hooks import MEMORY_TRACE  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

MODEL = "tiny/qwen-image"
OOM_PROMPT = "this request runs out of memory"
LEAK_PROMPT = "this request leaks"
PROBE = "a probe"
OBJECT_SLACK = 32
# Sizes that pad differently, n of 1 and 2, prompts of 1 to ~90 tokens (past the 64-token text bucket), and
# an out-of-memory request: a cycle of 5, so that the 10th and the 50th end at the same point of it.
SIZES = [(32, 32, 1), (48, 32, 2), (64, 48, 1), (32, 64, 1), (48, 48, 1)]
PROMPTS = ["a cat", "a red fox in the snow, " * 4, "x", ", ".join(["a lighthouse at dusk"] * 12), OOM_PROMPT]


@pytest.fixture(scope="module")
def omni():
    faults = [
        {"kind": "oom", "rank": 0, "step": 0, "prompt": OOM_PROMPT},
        {"kind": "leak", "rank": 0, "step": 0, "prompt": LEAK_PROMPT},
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_OMNI_TEST_FAULT", json.dumps(faults))
        patch.setenv("VLLM_OMNI_TEST_MEMORY_TRACE", PROBE)
        with Omni(MODEL, device="cpu") as omni:
            yield omni


def _generate(omni: Omni, prompt: str, width: int = 32, height: int = 32, n: int = 1) -> list:
    return omni.generate(prompt, width=width, height=height, n=n, num_inference_steps=2, seed=0, output_type="uint8")


def _held(omni: Omni) -> dict[str, int]:
    """What the rank held after the last request: a probe measures it as it arrives."""
    _generate(omni, PROBE)
    return omni.engine.executor.rank_stats[0].extras[MEMORY_TRACE]


def test_a_request_out_of_memory_fails_alone_and_the_rank_serves_on(omni):
    executor = omni.engine.executor
    pid = executor._procs[0].pid
    with pytest.raises(RequestOutOfMemory) as failure:
        _generate(omni, OOM_PROMPT, width=48, height=32, n=2)
    message = str(failure.value)
    assert message.startswith("request ") and "(48x32, n=2) ran out of memory on rank 0 while denoising" in message
    assert "CUDA out of memory. Tried to allocate 20.00 GiB" in message and "total capacity" not in message
    assert "serves on" in message and "a smaller size" in message and "--ulysses-degree" in message
    images = _generate(omni, "a cat")  # the next request runs on the same worker
    assert images[0].shape == (32, 32, 3)
    assert executor.restarts == 0 and executor._procs[0].pid == pid and executor.status().state == "ok"


def test_fifty_mixed_requests_leave_the_rank_holding_what_it_held_after_ten(omni):
    cycle = itertools.cycle(zip(SIZES, PROMPTS))
    held: dict[int, dict[str, int]] = {}
    for i in range(1, 51):
        (width, height, n), prompt = next(cycle)
        try:
            _generate(omni, prompt, width, height, n)
        except RequestOutOfMemory:
            assert prompt == OOM_PROMPT
        if i in (10, 50):
            held[i] = _held(omni)
    assert held[10]["tensors"] > 0
    # Tensors are what hold memory: exactly as many, as large.
    assert (held[50]["tensors"], held[50]["tensor_bytes"]) == (held[10]["tensors"], held[10]["tensor_bytes"])
    # Python objects settle once by about 15 (at a request that varies from run to run), then stay put:
    # a leak of one object a request would add 40.
    assert abs(held[50]["objects"] - held[10]["objects"]) <= OBJECT_SLACK


def test_the_trace_sees_a_planted_leak(omni):
    # What it leaks stays for the process's life: keep it last.
    before = _held(omni)
    for _ in range(3):
        _generate(omni, LEAK_PROMPT)
    leaked = _held(omni)
    assert leaked["tensors"] - before["tensors"] == 3
    assert leaked["tensor_bytes"] - before["tensor_bytes"] == 3 * LEAK_BYTES
    assert leaked["objects"] - before["objects"] >= 3
