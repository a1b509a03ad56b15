"""`vllm-omni plan` (entrypoints/cli/plan.py, engine/admission.py `plan_deploy`): the plan a server's rank makes at
start, without a GPU and without reading a weight; and docs/memory.md's table of the released checkpoints, which
this test regenerates from their configs (benchmarks/checkpoints/, built on the meta device) and compares."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "benchmarks"))

import memory_table  # noqa: E402

pytestmark = pytest.mark.slow  # the released checkpoints built on the meta device, in subprocesses


def _plan(*args: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "plan", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_plan_says_whether_a_deploy_starts_on_a_gpu_of_that_size_without_one():
    """The tiny model in bf16 (3.6 MiB of weights, one 1024x1024 step of 4096 + 512 tokens at width 96: 16.9 MiB):
    within 0.9 of 32 MiB it starts and says what it admits; within 0.9 of 16 MiB it is refused, exit status 1,
    naming what would fit. No GPU is used."""
    starts = _plan("tiny/qwen-image", "--gpu-memory", str(32 / 1024))
    assert starts.returncode == 0, starts.stderr
    assert "starts: memory plan: weights" in starts.stdout and "placement: offload none" in starts.stdout
    assert "envelope (estimated" in starts.stdout and "per forward" in starts.stdout
    refused = _plan("tiny/qwen-image", "--gpu-memory", str(16 / 1024))
    assert refused.returncode == 1, refused.stderr
    assert "refused: the deploy does not fit" in refused.stdout and "would fit:" in refused.stdout


def test_the_released_checkpoints_table_in_the_docs_is_what_plan_says():
    checkpoints = memory_table.checkpoints()
    if not checkpoints:
        pytest.fail("benchmarks/checkpoints/ holds no checkpoint configs")
    documented = memory_table.generated_table(memory_table.DOCS.read_text())
    assert documented == memory_table.table(), "docs/memory.md is stale: run python benchmarks/memory_table.py"
