"""Serving benchmark: a load generator against a running vllm_omni server, through its HTTP API.

Requests go to `POST /v1/images/generations` (the answer is the images) or `POST /v1/videos` (the
answer is a job, polled at `GET /v1/videos/{id}` until it ends, then deleted), with either
`--concurrency N` (N clients, each sending its next request when its last one is answered) or
Poisson arrivals at `--request-rate R` requests/s (exponential gaps), for `--num-requests K`
and/or `--duration S` (no new request after S seconds). A workload is a JSON list of entries
`{"width", "height", "num_inference_steps", "weight", ...any other request field}` (or the
built-in names `mix`, `512`, `1328` and `previews`); each request draws an entry by weight, a prompt (built-in
prompts of different lengths, or `--prompts FILE`, one a line) and a seed from one seeded RNG,
so runs with the same `--seed` send the same requests in the same order.

Reported: throughput (requests/s, images/s; a video counts as one), client-side latency (from
sending the request to its answer: the images' response, or the poll that saw the video job
completed; mean / p50 / p99), overall and per workload entry, the server's queue time, and the
failures with their first messages. Queue time comes from the server: a `timings_ms` figure whose
name has "queue" in it where the responses carry one (per request), else the change of the
`vllm_omni_request_queue_seconds` histogram on GET /metrics over the run (its mean; other clients'
requests in that window count too). The job's own times cannot give it: a video job shows
`created_at` and `completed_at` only. The row also records the server's /health and /v1/models.

Each run merges one row, keyed by `--label`, into `--results` (benchmarks/results/serving.json)
and rewrites the "serving" section of `--docs` (docs/benchmarks.md) from every row there;
`--docs-only` just rewrites the section. `--start-server "vllm-omni serve ..."` starts the server
(on a free port unless the command names one), waits for /health 200, runs, and stops it, so one
command measures one configuration:

    python benchmarks/serving.py --start-server "vllm-omni serve <ckpt> --max-batch-size 4" \\
        --workload mix --concurrency 8 --num-requests 24 --warmup 8 --label "batching on, c=8, mix"

With CUDA graphs per shape, the first request of each size (and, with batching, of each batch
size and mix of prompt lengths: a graph holds its rows' text lengths) captures a graph: `--warmup N`
first sends N requests drawn the same way (from their own RNG stream, so the measured requests do
not change), unmeasured. Issue 30's batching target is `--workload 512 --concurrency 16` against a
server with `--max-batch-size 16 --batch-wait-ms 200` and one without (the wait lets a batch refill
while its clients send their next requests). A tiny model's numbers are
refused for the committed results and docs: give --results and --docs elsewhere.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import random
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import replace_section  # noqa: E402

KEY = "serving"
DEFAULT_RESULTS = ROOT / f"benchmarks/results/{KEY}.json"
DEFAULT_DOCS = ROOT / "docs/benchmarks.md"
ROUTES = {"images": "/v1/images/generations", "videos": "/v1/videos"}
QUEUE_METRIC = "vllm_omni_request_queue_seconds"

WORKLOADS: dict[str, list[dict[str, Any]]] = {
    # Upstream vLLM-Omni's serving benchmark mix.
    "mix": [
        {"width": 512, "height": 512, "num_inference_steps": 20, "weight": 15},
        {"width": 768, "height": 768, "num_inference_steps": 20, "weight": 25},
        {"width": 1024, "height": 1024, "num_inference_steps": 25, "weight": 45},
        {"width": 1536, "height": 1536, "num_inference_steps": 35, "weight": 15},
    ],
    "1328": [{"width": 1328, "height": 1328, "num_inference_steps": 50, "weight": 1}],
    # Small images from many clients (issue 30): what request batching changes, each batch mixing the built-in
    # prompts' lengths (rows of different text lengths share one forward).
    "512": [{"width": 512, "height": 512, "num_inference_steps": 20, "weight": 1}],
    # Short previews among long requests (issue 30): what a scheduling policy changes.
    "previews": [
        {"width": 512, "height": 512, "num_inference_steps": 8, "weight": 40},
        {"width": 1024, "height": 1024, "num_inference_steps": 20, "weight": 40},
        {"width": 1328, "height": 1328, "num_inference_steps": 50, "weight": 20},
    ],
}

# Of different lengths (6 to 134 words; under Qwen-Image's 507 tokens even in the tiny models' small
# vocabulary, 395 at most), so batched requests pad their text to different lengths as real traffic does.
PROMPTS = (
    "A red fox in the snow.",
    "A cozy reading nook by a rainy window, a cat asleep on a knitted blanket, warm lamp light, film photograph.",
    "A bustling night market in an old harbour town: paper lanterns strung between wooden stalls, steam rising "
    "from noodle pots, a fishmonger shouting prices, children chasing each other between the crates, the wet "
    "cobblestones reflecting neon signs in red and teal, and in the distance a lighthouse sweeping its beam over "
    "the dark water. Shot on a wide lens, shallow depth of field, rich colours.",
    "An architectural cutaway illustration of a vertical farm inside a converted skyscraper. Each floor shows a "
    "different crop: lettuces under violet grow lights, tomato vines climbing trellises, a mushroom cellar lit "
    "only by amber work lamps, rice terraces built into a sloping atrium, and an aquaponics floor where tilapia "
    "swim in glass tanks whose water feeds the beds above. Workers in blue overalls tend the plants, a freight "
    "elevator carries crates of produce down to a street market at the base, and solar panels and wind turbines "
    "crown the roof. Clean technical line work with soft watercolour washes, labelled callouts in a neat hand, "
    "the sky behind the tower a pale dawn gradient, the whole drawing on slightly yellowed paper with a ruled "
    "border and a small title block in the lower right corner.",
)


# ---- workload and requests ------------------------------------------------------------------------


def load_workload(spec: str) -> tuple[str, list[dict[str, Any]]]:
    """A built-in name, a JSON file, or inline JSON -> (name, entries)."""
    if spec in WORKLOADS:
        name, entries = spec, WORKLOADS[spec]
    elif spec.lstrip().startswith("["):
        name, entries = "custom", json.loads(spec)
    else:
        path = Path(spec)
        if not path.is_file():
            raise SystemExit(f"--workload {spec!r}: not a built-in ({', '.join(WORKLOADS)}), a JSON list or a file")
        name, entries = path.stem, json.loads(path.read_text())
    if not isinstance(entries, list) or not entries or not all(isinstance(e, dict) for e in entries):
        raise SystemExit(f"--workload {spec!r}: expected a non-empty JSON list of objects")
    for entry in entries:
        weight = entry.get("weight", 1)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or weight <= 0:
            raise SystemExit(f"--workload: weight must be a positive number, got {weight!r} in {entry}")
        if ("width" in entry) != ("height" in entry):
            raise SystemExit(f"--workload: give width and height together (or neither), got {entry}")
        if entry.get("route", "images") not in ROUTES:
            raise SystemExit(f"--workload: route must be one of {', '.join(ROUTES)}, got {entry['route']!r}")
    return name, [dict(e) for e in entries]


def entry_label(entry: dict[str, Any]) -> str:
    """'1024x1024, 25 steps' plus any other field."""
    parts = []
    if "width" in entry or "height" in entry:
        parts.append(f"{entry.get('width', 'auto')}x{entry.get('height', 'auto')}")
    if "num_inference_steps" in entry:
        parts.append(f"{entry['num_inference_steps']} steps")
    shown = {"width", "height", "num_inference_steps", "weight"}
    parts += [f"{k}={v}" for k, v in entry.items() if k not in shown]
    return ", ".join(parts) or "server defaults"


@dataclass
class Request:
    entry: int  # index into the workload
    route: str  # "images" or "videos"
    body: dict[str, Any]


def request_stream(
    entries: list[dict[str, Any]], prompts: list[str], route: str, seed: int, extra: dict[str, Any]
) -> Iterator[Request]:
    """The requests in order, endless; each draws its entry, prompt and seed from one RNG."""
    rng = random.Random(seed)
    weights = [e.get("weight", 1) for e in entries]
    while True:
        index = rng.choices(range(len(entries)), weights=weights)[0]
        entry = entries[index]
        body: dict[str, Any] = {"prompt": rng.choice(prompts), "seed": rng.randrange(2**31), **extra}
        fields = {k: v for k, v in entry.items() if k not in ("weight", "route", "width", "height")}
        if "width" in entry or "height" in entry:
            body["size"] = f"{entry['width']}x{entry['height']}"
        body.update(fields)
        yield Request(index, entry.get("route", route), body)


# ---- one request ----------------------------------------------------------------------------------


@dataclass
class Outcome:
    entry: int
    ok: bool
    sent_s: float  # since the load started
    latency_s: float
    images: int = 0
    timings_ms: dict[str, float] = field(default_factory=dict)
    error: str | None = None


def _error_text(response: httpx.Response) -> str:
    try:
        message = response.json()["error"]["message"]
    except Exception:  # noqa: BLE001 - not our error shape: show the start of the body
        message = response.text[:200]
    return f"HTTP {response.status_code}: {message}"


async def send(http: httpx.AsyncClient, request: Request, poll_s: float, timeout_s: float, t0: float) -> Outcome:
    """One request, timed from sending to its answer; any failure is an outcome, never retried."""
    start = time.perf_counter()
    outcome = Outcome(request.entry, ok=False, sent_s=start - t0, latency_s=0.0)
    job_path = None
    try:
        if request.route == "images":
            response = await http.post(ROUTES["images"], json=request.body)
            answer = response.json() if response.status_code == 200 else None
        else:
            response = await http.post(ROUTES["videos"], json=request.body)
            if response.status_code == 200:
                job_path = f"{ROUTES['videos']}/{response.json()['id']}"
                response = await _poll_video(http, job_path, poll_s, start + timeout_s)
            answer = response.json() if response.status_code == 200 else None
        outcome.latency_s = time.perf_counter() - start
        if answer is None:
            outcome.error = _error_text(response)
        elif request.route == "videos" and answer["status"] != "completed":
            error = answer.get("error") or {}
            outcome.error = f"job {answer['status']} ({error.get('code')}): {error.get('message')}"
        else:
            outcome.ok = True
            outcome.images = len(answer["data"]) if request.route == "images" else 1
            outcome.timings_ms = answer.get("timings_ms") or {}
        if job_path is not None:
            await http.delete(job_path)  # untimed: the MP4 is not needed
    except httpx.HTTPError as exc:
        outcome.latency_s = time.perf_counter() - start
        timed_out = isinstance(exc, (httpx.TimeoutException, _PollTimeout))
        outcome.error = f"timed out after {timeout_s:g} s" if timed_out else f"{type(exc).__name__}: {exc}"
        if job_path is not None:
            with contextlib.suppress(httpx.HTTPError):
                await http.delete(job_path)  # a job given up on must not hold the server
    return outcome


class _PollTimeout(httpx.HTTPError):
    """The video job did not end within --timeout."""


async def _poll_video(http: httpx.AsyncClient, path: str, poll_s: float, deadline: float) -> httpx.Response:
    """GET the job until it ends (or an error answer); that answer."""
    while True:
        response = await http.get(path)
        if response.status_code != 200 or response.json()["status"] in ("completed", "failed"):
            return response
        if time.perf_counter() > deadline:
            raise _PollTimeout("the job did not end in time")
        await asyncio.sleep(poll_s)  # the next poll


# ---- load ----------------------------------------------------------------------------------------


async def run_load(
    http: httpx.AsyncClient, requests: Iterator[Request], args: argparse.Namespace, count: int | None, seed: int
) -> tuple[list[Outcome], float]:
    """Send `count` requests (None: until --duration) at the load asked for; (outcomes, elapsed seconds)."""
    t0 = time.perf_counter()

    def more(sent: int) -> bool:
        in_time = args.duration is None or time.perf_counter() - t0 < args.duration
        return in_time and (count is None or sent < count)

    def one(request: Request) -> Any:
        return send(http, request, args.poll_interval, args.timeout, t0)

    outcomes: list[Outcome] = []
    if args.request_rate is None:
        sent = [0]

        async def client() -> None:
            while more(sent[0]):
                sent[0] += 1
                outcomes.append(await one(next(requests)))

        await asyncio.gather(*(client() for _ in range(args.concurrency)))
    else:
        gaps = random.Random(seed)
        tasks = []
        arrival = t0  # the first request at once, then exponential gaps
        while more(len(tasks)):
            await asyncio.sleep(max(0.0, arrival - time.perf_counter()))
            if not more(len(tasks)):  # --duration may have passed while waiting
                break
            tasks.append(asyncio.create_task(one(next(requests))))
            arrival += gaps.expovariate(args.request_rate)
        outcomes = list(await asyncio.gather(*tasks))
    elapsed = max((o.sent_s + o.latency_s for o in outcomes), default=0.0)
    return outcomes, elapsed


async def queue_seconds(http: httpx.AsyncClient) -> tuple[float, float] | None:
    """(sum, count) of the queue-time histogram over every kind, from GET /metrics; None without it."""
    try:
        response = await http.get("/metrics")
    except httpx.HTTPError:
        return None
    if response.status_code != 200:
        return None
    total = {"_sum": 0.0, "_count": 0.0}
    for family in text_string_to_metric_families(response.text):
        if family.name == QUEUE_METRIC:
            for sample in family.samples:
                suffix = sample.name.removeprefix(QUEUE_METRIC)
                if suffix in total:
                    total[suffix] += sample.value
    return total["_sum"], total["_count"]


async def server_info(http: httpx.AsyncClient) -> dict[str, Any]:
    health = await http.get("/health")
    if health.status_code != 200:
        raise SystemExit(f"the server is not ready: GET /health answered {health.status_code} {health.text[:200]}")
    models = await http.get("/v1/models")
    card = models.json()["data"][0] if models.status_code == 200 else {"error": _error_text(models)}
    return {"health": health.json(), "model": card}


# ---- statistics and the report -------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's default)."""
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def latency_stats(values: list[float]) -> dict[str, float] | None:
    if not values:
        return None
    stats = {"mean": statistics.fmean(values), "p50": percentile(values, 50), "p99": percentile(values, 99)}
    return {k: round(v, 4) for k, v in stats.items()}


def queue_report(done: list[Outcome], before: tuple | None, after: tuple | None) -> dict[str, Any]:
    """Per request from the responses where they carry a queue figure, else the /metrics histogram's mean."""
    key = next((k for o in done for k in o.timings_ms if "queue" in k.lower()), None)
    if key is not None:
        values = [o.timings_ms[key] / 1000 for o in done if key in o.timings_ms]
        return {"source": f"timings_ms[{key!r}] of each response", **latency_stats(values)}
    if before is not None and after is not None and after[1] > before[1]:
        mean = (after[0] - before[0]) / (after[1] - before[1])
        return {"source": f"GET /metrics {QUEUE_METRIC} (mean over the run)", "mean": round(mean, 4)}
    return {"source": "not reported by this server"}


def summarize(
    outcomes: list[Outcome], elapsed: float, entries: list[dict[str, Any]], queue: dict[str, Any]
) -> dict[str, Any]:
    done = [o for o in outcomes if o.ok]
    failed = [o for o in outcomes if not o.ok]
    errors: list[str] = []
    for o in failed:
        if o.error not in errors and len(errors) < 5:
            errors.append(o.error)
    engine = [o.timings_ms["total"] / 1000 for o in done if "total" in o.timings_ms]
    per_entry = []
    for index, entry in enumerate(entries):
        mine = [o.latency_s for o in done if o.entry == index]
        sent = sum(o.entry == index for o in outcomes)
        per_entry.append(
            {"entry": entry_label(entry), "sent": sent, "completed": len(mine), **(latency_stats(mine) or {})}
        )
    return {
        "sent": len(outcomes),
        "completed": len(done),
        "failed": len(failed),
        "errors": errors,
        "elapsed_s": round(elapsed, 3),
        "requests_per_s": round(len(done) / elapsed, 4) if elapsed else None,
        "images_per_s": round(sum(o.images for o in done) / elapsed, 4) if elapsed else None,
        "latency_s": latency_stats([o.latency_s for o in done]),
        "queue_s": queue,
        "engine_mean_s": round(statistics.fmean(engine), 4) if engine else None,  # timings_ms["total"]
        "per_entry": per_entry,
        "requests": [
            {"entry": o.entry, "ok": o.ok, "sent_s": round(o.sent_s, 4), "latency_s": round(o.latency_s, 4)}
            for o in sorted(outcomes, key=lambda o: o.sent_s)
        ],
    }


def _find(card: dict[str, Any], key: str) -> Any:
    """`key` in the model card or one level down (parallel_config, limits, ...)."""
    if key in card:
        return card[key]
    return next((v[key] for v in card.values() if isinstance(v, dict) and key in v), None)


def server_summary(server: dict[str, Any]) -> str:
    card = server.get("model", {})
    parts = [f"U{_find(card, 'ulysses_degree') or 1}"]
    for key, name in (("cfg_parallel_size", "CFG"), ("data_parallel_size", "DP")):
        if (_find(card, key) or 1) > 1:
            parts.append(f"{name}{_find(card, key)}")
    batch, wait = _find(card, "max_batch_size") or 1, _find(card, "batch_wait_ms") or 0
    if batch > 1:  # request batching on (/v1/models' `batching`)
        parts.append(f"batch {batch}" + (f" wait {wait:g} ms" if wait else ""))
    return " ".join(parts)


def load_text(args: argparse.Namespace) -> str:
    if args.request_rate is not None:
        return f"Poisson {args.request_rate:g}/s"
    return f"concurrency {args.concurrency}"


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3g}"


def _s(stats: dict[str, float] | None) -> str:
    return " / ".join(f"{stats[k]:.2f}" for k in ("mean", "p50", "p99")) if stats else "n/a"


def print_report(row: dict[str, Any]) -> None:
    q = row["queue_s"]
    lines = [
        f"{row['label']}: {row['model']} ({row['server_summary']}), {row['route']}, {row['load']}, "
        f"workload {row['workload']}",
        f"  {row['completed']} completed, {row['failed']} failed of {row['sent']} in {row['elapsed_s']:.2f} s: "
        f"{_rate(row['requests_per_s'])} requests/s, {_rate(row['images_per_s'])} images/s",
        f"  latency s (mean / p50 / p99): {_s(row['latency_s'])}; engine mean s: {row['engine_mean_s']}",
        f"  queue s: {q.get('mean', 'n/a')} mean ({q['source']})",
        f"  {'entry':<40} {'sent':>5} {'done':>5}  latency s (mean / p50 / p99)",
    ]
    for e in row["per_entry"]:
        lines.append(f"  {e['entry']:<40} {e['sent']:>5} {e['completed']:>5}  {_s(e if 'mean' in e else None)}")
    lines += [f"  error: {message}" for message in row["errors"]]
    print("\n".join(lines), flush=True)


# ---- results and docs ----------------------------------------------------------------------------


def load_results(path: Path) -> dict[str, Any]:
    if path.is_file():
        results = json.loads(path.read_text())
        if isinstance(results, dict) and "runs" in results:
            return results
    return {"runs": {}}


def docs_section(results: dict[str, Any]) -> str:
    rows = list(results["runs"].values())
    tiny = any(str(row.get("model", "")).startswith("tiny/") for row in rows)
    hosts = sorted({row.get("gpus") or row.get("host") or "n/a" for row in rows})
    lines = [
        "## Serving",
        "",
        *(["**Tiny model on CPU: these numbers mean nothing.**", ""] if tiny else []),
        "`benchmarks/serving.py` against a real `vllm-omni serve` through its HTTP API: fixed concurrency (N clients, "
        "each sending its next request when its last is answered) or Poisson arrivals at a rate; each request draws "
        "a workload entry by weight, a prompt (built in: four of 6 to 134 words; 7 to 395 tokens of the tiny "
        "models' tokenizer, which the random-weight checkpoint uses) and a seed from one seeded RNG, so runs with "
        "the same seed send the same requests. `mix` is upstream's (512x512 20 steps 15 %, 768x768 20 steps "
        "25 %, 1024x1024 25 steps 45 %, 1536x1536 35 steps 15 %); `512` is 512x512, 20 steps; `1328` is 1328x1328, "
        "50 steps; `previews` "
        "(issue 30) is 512x512 8 steps 40 %, 1024x1024 20 steps 40 %, 1328x1328 50 steps 20 %. Latency is "
        "client-side, from sending a request to its answer (videos: the poll that saw the job completed); queue time "
        "is the server's (its source in the JSON: the `/metrics` queue histogram's mean over the run where the "
        "responses carry no queue figure). Throughput is completed requests (images; a video counts one) over the "
        f"time from the first request sent to the last answer. Server: the parallel config from `/v1/models`. "
        f"Hosts: {', '.join(hosts)}.",
        "",
        "| run | model | server | route | load | workload | completed / failed | requests/s | images/s "
        "| latency s mean / p50 / p99 | queue s mean |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        queue = row["queue_s"].get("mean")
        lines.append(
            f"| {row['label']} | {row['model']} | {row['server_summary']} | {row['route']} | {row['load']} | "
            f"{row['workload']} | {row['completed']} / {row['failed']} | {_rate(row['requests_per_s'])} | "
            f"{_rate(row['images_per_s'])} | {_s(row['latency_s'])} | {'n/a' if queue is None else f'{queue:.2f}'} |"
        )
    lines += [
        "",
        "Per workload entry:",
        "",
        "| run | entry | completed | latency s mean / p50 / p99 |",
        "|---|---|---|---|",
    ]
    for row in rows:
        for e in row["per_entry"]:
            lines.append(f"| {row['label']} | {e['entry']} | {e['completed']} | {_s(e if 'mean' in e else None)} |")
    failures = [(row["label"], message) for row in rows for message in row["errors"]]
    if failures:
        lines += ["", "First failures:", ""] + [f"- {label}: {message}" for label, message in failures]
    return "\n".join(lines)


def save(results: dict[str, Any], path: Path, docs: Path, copy_to: Path | None) -> None:
    """The JSON first: a docs failure never loses a measurement (`--docs-only` rewrites the section later)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(results, indent=1) + "\n")
    replace_section(docs, KEY, docs_section(results))
    if copy_to is not None:
        copy_to.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, copy_to / path.name)
        shutil.copy(docs, copy_to / docs.name)


# ---- the server, when this script starts it ------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _flag(argv: list[str], name: str) -> str | None:
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            return argv[i + 1]
        if arg.startswith(name + "="):
            return arg.split("=", 1)[1]
    return None


@contextlib.contextmanager
def started_server(command: str, log_path: Path, timeout_s: float) -> Iterator[str]:
    """Start `command` (its own process group), wait for /health 200, yield its URL; then SIGTERM it."""
    argv = shlex.split(command)
    if _flag(argv, "--port") is None:
        argv += ["--port", str(_free_port())]
    host = _flag(argv, "--host")
    url = f"http://{'127.0.0.1' if host in (None, '0.0.0.0', '::') else host}:{_flag(argv, '--port')}"
    print(f"starting: {shlex.join(argv)}\n  log: {log_path}", flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if proc.poll() is not None:
                raise SystemExit(f"the server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
            if time.monotonic() > deadline:
                raise SystemExit(f"the server was not ready in {timeout_s:g} s:\n{log_path.read_text()[-3000:]}")
            with contextlib.suppress(httpx.TransportError):
                if httpx.get(f"{url}/health", timeout=5).status_code == 200:
                    break
            time.sleep(0.5)  # the next /health poll
        yield url
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)  # the server's clean shutdown ends its workers
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # the group it leads: itself and its workers
                proc.wait(timeout=30)


# ---- main ----------------------------------------------------------------------------------------


async def measure(args: argparse.Namespace, url: str, entries: list[dict[str, Any]], prompts: list[str]) -> dict:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    extra = {"negative_prompt": args.negative_prompt} if args.negative_prompt is not None else {}
    if args.model:
        extra["model"] = args.model
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)  # the load's, not the pool's
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=args.timeout, limits=limits) as http:
        server = await server_info(http)
        root = str(server["model"].get("root", ""))
        if root.startswith("tiny/") and (args.results == DEFAULT_RESULTS or args.docs == DEFAULT_DOCS):
            raise SystemExit(f"{root} is a tiny model: give --results and --docs outside the committed files")
        if args.warmup:
            warm = request_stream(entries, prompts, args.route, args.seed + 2, extra)
            outcomes, _ = await run_load(http, warm, args, args.warmup, args.seed + 3)
            print(f"warm-up: {sum(o.ok for o in outcomes)} of {len(outcomes)} completed", flush=True)
        before = await queue_seconds(http)
        requests = request_stream(entries, prompts, args.route, args.seed, extra)
        outcomes, elapsed = await run_load(http, requests, args, args.num_requests, args.seed + 1)
        after = await queue_seconds(http)
        queue = queue_report([o for o in outcomes if o.ok], before, after)
        health_after = (await http.get("/health")).json()
    return {**summarize(outcomes, elapsed, entries, queue), "server": {**server, "health_after": health_after}}


def _gpus() -> str | None:
    """The GPUs of this host (where the server runs when this script starts it)."""
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
    names = [line.strip() for line in done.stdout.splitlines() if line.strip()]
    return f"{len(names)}x {names[0]}" if names else None


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    target = parser.add_argument_group("server")
    target.add_argument("--base-url", default="http://127.0.0.1:8000", help="the server (%(default)s)")
    target.add_argument("--start-server", metavar="COMMAND", help="start this server command, run, stop it")
    target.add_argument("--server-timeout", type=float, default=1800, help="seconds to wait for /health 200")
    target.add_argument("--server-log", type=Path, help="the started server's log (default: a temporary file)")
    target.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY"), help="bearer key (env VLLM_API_KEY)")
    target.add_argument("--model", help="the request's `model` field (default: left out, the served model)")
    load = parser.add_argument_group("load")
    load.add_argument("--route", choices=list(ROUTES), default="images", help="unless an entry names its own")
    load.add_argument("--workload", default="mix", help=f"{' or '.join(WORKLOADS)}, a JSON file, or inline JSON")
    load.add_argument("--concurrency", type=int, default=1, help="clients in a loop (%(default)s)")
    load.add_argument("--request-rate", type=float, help="Poisson arrivals, requests/s (instead of --concurrency)")
    load.add_argument("--num-requests", type=int, help="requests to send")
    load.add_argument("--duration", type=float, help="seconds after which no request is sent")
    load.add_argument("--warmup", type=int, default=0, help="unmeasured requests first, at the same load")
    load.add_argument("--prompts", type=Path, help="a file of prompts, one a line (default: four built in)")
    load.add_argument("--negative-prompt", help="sent with every request (Qwen-Image: true CFG)")
    load.add_argument("--seed", type=int, default=0, help="the requests' and the arrivals' RNG seed")
    load.add_argument("--timeout", type=float, default=3600, help="seconds per request, polling included")
    load.add_argument("--poll-interval", type=float, default=0.1, help="seconds between video job polls")
    out = parser.add_argument_group("results")
    out.add_argument("--label", help="the row's key (default: from the load and workload)")
    out.add_argument("--results", type=Path, default=DEFAULT_RESULTS, help="results JSON (merged)")
    out.add_argument("--docs", type=Path, default=DEFAULT_DOCS, help="docs page (its serving section)")
    out.add_argument("--copy-to", type=Path, help="also copy the JSON and the docs page here")
    out.add_argument("--docs-only", action="store_true", help="rewrite the docs section from the JSON; no run")
    args = parser.parse_args(argv)
    if not args.docs_only:
        if args.num_requests is None and args.duration is None:
            parser.error("give --num-requests and/or --duration")
        if args.concurrency < 1 or (args.request_rate is not None and args.request_rate <= 0):
            parser.error("--concurrency must be at least 1 and --request-rate positive")
    return args


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Run one configuration and return its row (None with --docs-only)."""
    args = parse_args(argv)
    results = load_results(args.results)
    if args.docs_only:
        replace_section(args.docs, KEY, docs_section(results))
        return None
    workload, entries = load_workload(args.workload)
    prompts = PROMPTS
    if args.prompts:
        prompts = tuple(line.strip() for line in args.prompts.read_text().splitlines() if line.strip())
    label = args.label or f"{load_text(args)}, {workload}"
    with contextlib.ExitStack() as stack:
        url = args.base_url
        if args.start_server:
            log = args.server_log
            if log is None:
                fd, name = tempfile.mkstemp(prefix="serving-server-", suffix=".log")
                os.close(fd)
                log = Path(name)
            url = stack.enter_context(started_server(args.start_server, log, args.server_timeout))
        measured = asyncio.run(measure(args, url, entries, list(prompts)))
    row = {
        "label": label,
        "model": measured["server"]["model"].get("id", "n/a"),
        "server_summary": server_summary(measured["server"]),
        "route": args.route if all("route" not in e for e in entries) else "per entry",
        "load": load_text(args),
        "concurrency": None if args.request_rate is not None else args.concurrency,
        "request_rate": args.request_rate,
        "num_requests": args.num_requests,
        "duration_s": args.duration,
        "warmup": args.warmup,
        "workload": workload,
        "entries": entries,
        "prompts": str(args.prompts) if args.prompts else f"built-in ({len(PROMPTS)})",
        "negative_prompt": args.negative_prompt,
        "seed": args.seed,
        "start_server": args.start_server,
        "host": platform.node(),
        "gpus": _gpus(),
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        **measured,
    }
    results["runs"][label] = row
    save(results, args.results, args.docs, args.copy_to)
    print_report(row)
    print(f"results: {args.results}\ndocs: {args.docs}", flush=True)
    return row


if __name__ == "__main__":
    main()
