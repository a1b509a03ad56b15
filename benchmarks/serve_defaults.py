"""`vllm-omni serve MODEL` with no options, as a new user runs it: does it start on the card, what does it admit,
and how long does one request at the model's default size take (issue 44).

For each family given (Qwen-Image for now: the real-size random-weight checkpoint of qwen_image_e2e.py's build,
57.7 GB), the server starts as a process with no engine option, /health is polled until it answers 200 (or the
server exits), and one request goes through POST /v1/images/generations at the model's default size and steps
(Qwen-Image: 1024x1024, 50 steps, true CFG 4.0 with the negative prompt " "). Recorded per family, one row each
in benchmarks/results/serve_defaults.json: the card, started or not (with the refusal), the start lines (the
memory plan, the measured step, the envelope), GET /v1/models's envelope, seconds to ready, the request's seconds.

On the device (`.whl` carried: diffusers, fastapi, starlette, uvicorn, pydantic, python-multipart):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 benchmarks/serve_defaults.py --copy-to $OUT
    python3 benchmarks/serve_defaults.py --copy-to $OUT --options "--gpu-memory-utilization 0.6"   # a 48 GiB share

`--phase docs` rewrites the docs section from the JSON (no GPU).
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serve_defaults.json"
DOCS = ROOT / "docs" / "benchmarks.md"
PORT = 8123
READY_TIMEOUT_S = 1200
# The start lines worth keeping: the plan, the measured step, the envelope, the refusal.
KEPT = re.compile(r"memory plan:|offload chosen|Measured one step|Serving up to|does not fit|Warm-up done|Engine ready")


def get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, {}
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def post(url: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def card() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def serve_row(family: str, folder: Path, request: dict[str, Any], log_path: Path, options: list[str]) -> dict[str, Any]:
    """Start `vllm-omni serve folder` with `options` (none: as a new user does), wait for it, send `request`, stop
    it."""
    base = f"http://127.0.0.1:{PORT}"
    command = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", str(folder), "--port", str(PORT)]
    command += options
    shown = " ".join(["vllm-omni serve FOLDER", *options])
    row: dict[str, Any] = {"family": family, "card": card(), "command": shown, "started": False}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while time.perf_counter() - start < READY_TIMEOUT_S and server.poll() is None:
                if get(f"{base}/health")[0] == 200:
                    row["started"] = True
                    break
                time.sleep(2)
            row["ready_s"] = round(time.perf_counter() - start, 1)
            if row["started"]:
                row["envelope"] = get(f"{base}/v1/models")[1]["data"][0].get("envelope")
                sent = time.perf_counter()
                status, answer = post(f"{base}/v1/images/generations", request, timeout=1800)
                row["request"] = {**{k: v for k, v in request.items() if k != "prompt"}, "status": status}
                row["request_s"] = round(time.perf_counter() - sent, 2)
                if status != 200:
                    row["request"]["error"] = answer
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    lines = [line.rstrip() for line in log_path.read_text(errors="replace").splitlines() if KEPT.search(line)]
    row["start_lines"] = [line.split("] ", 1)[-1] for line in lines]
    return row


def qwen_image(folder: Path) -> tuple[Path, dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import qwen_image_e2e

    qwen_image_e2e.build_checkpoint(qwen_image_e2e.REAL, folder, rebuild=False)
    prompt = "A cat holding a sign that says hello world."
    return folder, {"prompt": prompt, "negative_prompt": " ", "response_format": "b64_json"}  # the model's defaults


FAMILIES = {"qwen-image": qwen_image}


def docs_section(results: dict[str, Any]) -> str:
    lines = [
        "### `vllm-omni serve MODEL` with no options (issue 44)",
        "",
        "Real dimensions, random bf16 weights, one request at the model's default size and steps "
        "(`benchmarks/serve_defaults.py`).",
        "",
        "| family | command | card | started | envelope | ready (s) | request (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in results.values():
        envelope = (row.get("envelope") or {}).get("description", "-")
        started = "yes" if row["started"] else "no: " + next((x for x in row["start_lines"] if "not fit" in x), "?")
        request = row.get("request_s", "-")
        placement = " (model offload chosen)" if any("offload chosen" in x for x in row["start_lines"]) else ""
        cells = [row["family"], f"`{row['command']}`", row["card"], started + placement, envelope]
        lines.append("| " + " | ".join(cells) + f" | {row.get('ready_s')} | {request} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument("--phase", choices=["serve", "docs"], default="serve")
    parser.add_argument("--folder-root", type=Path, default=Path("/tmp"))
    parser.add_argument("--copy-to", type=Path)
    parser.add_argument(
        "--options",
        default="",
        help="serve options, one string (e.g. '--gpu-memory-utilization 0.6': a 48 GiB share of an 80 GB card); "
        "a row of its own",
    )
    args = parser.parse_args()
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.phase == "serve":
        for family in args.families:
            folder, request = FAMILIES[family](args.folder_root / f"{family}-e2e")
            log = (args.copy_to or Path("/tmp")) / f"serve-{family}.log"
            key = f"{family} {args.options}".strip()
            results[key] = row = serve_row(family, folder, request, log, args.options.split())
            print(json.dumps(row, indent=1), flush=True)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
            if args.copy_to is not None:
                shutil.copy(RESULTS, args.copy_to / RESULTS.name)
    sys.path.insert(0, str(ROOT))
    from benchmarks.harness.reports import replace_section

    replace_section(DOCS, "serve_defaults", docs_section(results), "serve_defaults")
    if args.copy_to is not None:
        shutil.copy(DOCS, args.copy_to / DOCS.name)


if __name__ == "__main__":
    main()
