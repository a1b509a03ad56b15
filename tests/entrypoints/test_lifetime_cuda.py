"""Workers on GPUs die with their parent and free the GPUs for the next engine at once; skipped without 2 GPUs.

Run on a GPU machine: `python -m pytest tests/entrypoints/test_lifetime_cuda.py`.
"""

from __future__ import annotations

import os
import selectors
import signal
import subprocess
import sys
import time

import pytest
import torch
from process_tree import children_of, still_alive_after
from server_process import server_env

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs"
)

DEVICE = "cuda"
PARENT = """
import sys, time
from vllm_omni import Omni
omni = Omni("tiny/qwen-image", ulysses_degree=2, device=sys.argv[1])
omni.generate("a cat", height=64, width=64, num_inference_steps=2, seed=0)
print("READY", flush=True)
time.sleep(600)
"""
MARGIN_MIB = 512  # what may stay in use on a GPU that was freed (driver bookkeeping)


def _free_mib(device: str) -> list[int]:
    if device != "cuda":
        return []
    return [torch.cuda.mem_get_info(index)[0] // 2**20 for index in range(2)]


def _wait_for_ready(proc: subprocess.Popen, timeout: float = 300) -> None:
    selector = selectors.DefaultSelector()
    selector.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if selector.select(timeout=1.0) and proc.stdout.readline().startswith("READY"):
            return
        assert proc.poll() is None, f"the parent exited with {proc.returncode}"
    raise AssertionError(f"the parent was not ready within {timeout} s")


def kill_parent_then_start_again(device: str) -> None:
    free_before = _free_mib(device)
    parent = subprocess.Popen(
        [sys.executable, "-c", PARENT, device], stdout=subprocess.PIPE, text=True, env=server_env()
    )
    try:
        _wait_for_ready(parent)
        children = children_of(parent.pid)
        assert len(children) >= 2
        if device == "cuda":
            assert all(free < before - MARGIN_MIB for free, before in zip(_free_mib(device), free_before))
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(timeout=30)
        assert still_alive_after(children, 5) == []
        assert all(free >= before - MARGIN_MIB for free, before in zip(_free_mib(device), free_before))
    finally:
        if parent.poll() is None:
            parent.kill()
    from vllm_omni import Omni

    with Omni("tiny/qwen-image", ulysses_degree=2, device=device) as omni:  # the same GPUs, at once
        assert omni.generate("a cat", height=64, width=64, num_inference_steps=2, seed=0)[0].size == (64, 64)


def test_sigkill_of_the_parent_frees_the_gpus_for_a_new_engine_at_once():
    torch.cuda.init()
    kill_parent_then_start_again(DEVICE)
