"""benchmarks/hunyuan_video_e2e.py in its --tiny smoke mode: every phase's host-side logic on CPU.

One run of the script (a subprocess, as on the GPU machine): build the checkpoint folder from the
tiny model's configs, diffusers-eager and ours-default with one CPU worker, whose phases the probe
the script installs in the worker must report (the VAE decode split is benchmarks/vae_decode.py's,
not a phase here). A row from an earlier call must survive the merge. Then, in
this process: MP4 encoding without PyAV is reported as not measured, and a docs section without
rows says it was not run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytestmark = pytest.mark.slow  # the benchmark scripts end to end, in subprocesses

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks/hunyuan_video_e2e.py"


def test_tiny_smoke_run_reports_every_phase_and_keeps_earlier_rows(tmp_path):
    out, docs = tmp_path / "e2e.json", tmp_path / "benchmarks.md"
    earlier = {"variant": "ours-eager", "phase": "ours", "gpus": 1, "what": "an earlier call", "error": "kept"}
    out.write_text(json.dumps({"variants": {"ours-eager": earlier}}))
    env = dict(os.environ, PYTHONPATH=str(ROOT), VLLM_OMNI_CPU_THREADS="1", VLLM_WORKER_MULTIPROC_METHOD="spawn")
    command = [sys.executable, str(SCRIPT), "--tiny", "--phase", "build", "diffusers", "ours"]
    command += ["--variants", "diffusers-eager", "ours-default", "--folder", str(tmp_path / "model")]
    command += ["--out", str(out), "--docs", str(docs)]
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]

    results = json.loads(out.read_text())
    build = results["build"]
    assert build["bytes"] > 0 and build["safetensors_files"] == 4  # transformer, both text encoders, VAE
    assert build["flow_shift"] == 5.0 and build["guidance_scale"] == 6.0
    assert results["variants"]["ours-eager"] == earlier
    with_av = importlib.util.find_spec("av") is not None
    for name in ("diffusers-eager", "ours-default"):
        row = results["variants"][name]
        assert row["error"] is None, row["error"]
        assert (row["size"], row["frames"], row["steps"]) == ("208x144", 9, 2)
        assert [run["label"] for run in row["runs"]] == ["warm-up", "run 0"]
        for run in row["runs"]:
            phases = [run["text_s"], run["prep_s"], run["loop_s"], run["decode_s"]]
            assert all(seconds > 0 for seconds in phases), run
            assert abs(sum(phases) + run["other_s"] - run["e2e_s"]) < 0.01, run
            assert abs(run["per_step_s"] * run["steps"] - run["loop_s"]) < 1e-3, run
            expected = run["e2e_s"] - run["loop_s"] + 50 * run["per_step_s"]
            assert abs(run["extrapolated_s"] - expected) < 0.01, run
        timed = row["runs"][1]
        if with_av:
            assert timed["mp4_s"] > 0 and timed["mp4_bytes"] > 0
            assert abs(row["extrapolated_with_mp4_s"] - row["extrapolated_s"] - row["mp4_s"]) < 0.01
        else:
            assert timed["mp4_s"] is None and timed["mp4_note"].startswith("not measured")
    ours = results["variants"]["ours-default"]
    assert ours["load_s"] > 0
    assert ours["runs"][1]["call_s"] < ours["runs"][1]["e2e_s"]  # the worker's run is part of the engine's call

    assert "decode" not in results  # the VAE decode split is measured by benchmarks/vae_decode.py

    text = docs.read_text()
    assert "<!-- BEGIN hunyuan_video_e2e" in text and "<!-- END hunyuan_video_e2e -->" in text
    assert "these numbers mean nothing" in text and "extrapolated" in text
    for name in ("diffusers-eager", "ours-default", "ours-eager | error: kept", "benchmarks/vae_decode.py"):
        assert name in text
    assert "rank 0's share of 8" not in text
    assert "| reference |" in text  # ours-default's agreement column: the other rows are compared with it


def load_script(monkeypatch):
    name = "hunyuan_video_e2e_under_test"
    spec = importlib.util.spec_from_file_location(name, SCRIPT)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, name, module)  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_mp4_without_pyav_is_not_measured_and_an_empty_section_says_not_run(monkeypatch):
    script = load_script(monkeypatch)
    monkeypatch.setitem(sys.modules, "av", None)  # `import av` raises ImportError, as on the GPU machine
    result = script.time_mp4(np.zeros((2, 16, 16, 3), dtype=np.uint8), 24)
    assert result["mp4_s"] is None and result["mp4_note"].startswith("not measured: ")
    section = script.docs_section({"variants": {}})
    assert "Not run yet" in section and "--phase build ours --variants ours-default" in section
