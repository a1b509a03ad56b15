"""benchmarks/qwen_image_e2e.py in its --tiny smoke mode: every phase's host-side logic on CPU.

One run of the script (a subprocess, as on the GPU machine): build the checkpoint folder,
diffusers' compiled variant, the cold-start reads, and ours at Ulysses 2 with two CPU workers,
whose phases the probe the script installs in the workers must report. A row from an earlier
call must survive the merge.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # the benchmark scripts end to end, in subprocesses

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/qwen_image_e2e.py"


def test_tiny_smoke_run_reports_every_phase_and_keeps_earlier_rows(tmp_path):
    out, docs = tmp_path / "e2e.json", tmp_path / "benchmarks.md"
    earlier = {"variant": "ours-eager", "phase": "ours", "gpus": 1, "what": "an earlier call", "error": "kept"}
    out.write_text(json.dumps({"variants": {"ours-eager": earlier}}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_OMNI_CPU_THREADS="1", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    command = [sys.executable, str(SCRIPT), "--tiny", "--phase", "build", "diffusers", "ours", "ours2"]
    command += ["--variants", "diffusers-compiled", "ours-u2", "--runs", "1", "--folder", str(tmp_path / "model")]
    command += ["--out", str(out), "--docs", str(docs)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]

    results = json.loads(out.read_text())
    assert results["build"]["bytes"] > 0 and results["build"]["safetensors_files"] == 3
    assert results["variants"]["ours-eager"] == earlier
    for name in ("diffusers-compiled", "ours-u2"):
        row = results["variants"][name]
        assert row["error"] is None, row["error"]
        assert [run["label"] for run in row["runs"]] == ["warm-up", "run 0"]
        for run in row["runs"]:
            phases = [run["text_s"], run["denoise_s"], run["decode_s"]]
            assert all(seconds > 0 for seconds in phases), run
            assert abs(sum(phases) + run["other_s"] - run["e2e_s"]) < 0.01, run
    assert results["variants"]["diffusers-compiled"]["warmup_compile_s"] > 0  # torch.compile's time is counted
    ours = results["variants"]["ours-u2"]
    assert ours["ranks_reporting"] == 2 and ours["load_s"] > 0
    assert ours["runs"][1]["call_s"] < ours["runs"][1]["e2e_s"]  # the worker's run is part of the engine's call
    reads = results["cold_start"]["reads"]
    assert [read["label"] for read in reads] == ["evicted", "cached"]
    assert reads[1]["page_cache_before"] in (None, 1.0)  # just read in full

    text = docs.read_text()
    assert "<!-- BEGIN qwen_image_e2e" in text and "<!-- END qwen_image_e2e -->" in text
    for name in ("diffusers-compiled", "ours-u2", "ours-eager | 1 | error: kept"):
        assert name in text
