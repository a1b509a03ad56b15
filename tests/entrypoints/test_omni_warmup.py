"""The warm-up a CUDA engine runs by default, forced on the CPU. In a module of its own: its request runs at the
model's default size (1024x1024), whose decode needs more memory than a worker of the small test requests, and
here no other module's engines are alive beside it."""

from __future__ import annotations

import json
import os

import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.engine.core import WARMUP_PROMPT  # noqa: E402
from vllm_omni.diffusion.executor.base import WorkerStartError  # noqa: E402

pytestmark = pytest.mark.slow  # a whole engine with a worker process
PROMPT = "a cat holding a sign that says hello world"


def test_warmup_runs_once_before_ready_and_requests_follow(capfd):
    """What CUDA engines do by default (compile, capture), forced on the CPU: one short request at
    the warm-up size before `Omni(...)` returns."""
    with Omni("tiny/qwen-image", warmup=True) as omni:
        assert omni.engine.warmup_s is not None and omni.engine.warmup_s > 0
        err = capfd.readouterr().err
        # On the CPU nothing compiles: one request at the default size (with compiled blocks, a second one).
        assert err.count("Warm-up done in") == 1 and "(1 request(s): 1024x1024)" in err
        assert omni.generate(PROMPT, height=32, width=32, num_inference_steps=2, seed=0)[0].size == (32, 32)


def test_a_warmup_request_that_fails_fails_the_start_naming_its_cause(monkeypatch):
    """Where the first worker group's warm-up (the model's default request) fails, every request like it would:
    the start fails with the cause, and no worker is left behind, rather than a ready server answering 500s."""
    fault = {"kind": "raise", "rank": 0, "step": 0, "prompt": WARMUP_PROMPT}
    monkeypatch.setenv("VLLM_OMNI_TEST_FAULT", json.dumps(fault))
    omni = None
    with pytest.raises(WorkerStartError, match=r"the warm-up request at 32x32 failed, so every request like it would: "
                       r"RequestFailed: .*test fault on rank 0 at step 0"):  # fmt: skip
        omni = Omni("tiny/qwen-image", warmup=True, warmup_size=(32, 32))
    assert omni is None
