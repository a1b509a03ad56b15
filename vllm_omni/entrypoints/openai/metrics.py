"""GET /metrics: the server's Prometheus metrics, through `prometheus_client` (text format 0.0.4).

One registry per app (so servers in one process never share counts). Scraping reads what the
server already holds and never asks the workers:

- HTTP: `vllm_omni_http_requests_total{route, method, status}`, counted by an ASGI middleware
  (`route` is the matched path template, `/v1/videos/{video_id}`, not the raw path).
- Jobs (the scheduler's observer): `vllm_omni_requests_total{kind, outcome}` for every job that
  finished (kind: the job's id prefix, `img` or `video`; outcome: completed, failed, cancelled),
  histograms of seconds `vllm_omni_request_queue_seconds`, `..._run_seconds` (in the engine)
  and `..._total_seconds` per kind, `..._suspended_seconds` (of its run, the time it waited between two
  of its steps while requests ran inside it: interleaving, --max-num-seqs); of the phases inside the
  workers, per completed request
  (rank 0's figures, engine/core.py): `vllm_omni_request_preprocess_seconds`, `..._encode_seconds`
  (text encoded once per SP group, before the pipeline call), `..._denoise_seconds` (the call up to
  its last step) and `..._decode_seconds` (the rest: the VAE); `vllm_omni_request_steps_per_second`
  (denoising steps over denoise seconds), `vllm_omni_batch_size` (requests per pipeline call,
  request batching), and `vllm_omni_denoising_steps_total` (steps/s of the server is its rate); with a
  step cache, `vllm_omni_step_cache_forwards_total{decision}` (computed, skipped: denoiser forwards).
- State, read at each scrape: `vllm_omni_queue_length` (the one queue every replica takes from),
  `vllm_omni_request_bodies_reading` (bodies being read, before their requests are queued),
  `vllm_omni_running_requests`, `vllm_omni_worker_restarts_total`,
  `vllm_omni_graph_capture_failures_total`, `vllm_omni_server_state{state}` (1 for the current one
  of protocol.HEALTH_STATES); per replica
  (data_parallel_size): `vllm_omni_replica_running_requests{replica}` (in flight on its group: with
  interleaving, the running one and those run inside it),
  `vllm_omni_replica_state{replica, state}`, `vllm_omni_replica_worker_restarts_total{replica}`;
  `vllm_omni_graph_captures{replica, rank}` and `vllm_omni_compiles{replica, rank}` (since the
  rank's group started), and on CUDA `vllm_omni_gpu_memory_peak_bytes{replica, rank}`, each rank's
  peak allocated memory in its last request, `vllm_omni_gpu_memory_allocated_bytes{replica, rank}`
  and `vllm_omni_gpu_memory_reserved_bytes{replica, rank}`, what it held once that request's
  tensors were dropped (allocated; reserved by the caching allocator): all reported by the rank with
  its result. Flat allocated bytes over requests is the no-leak check.

vLLM's names for the same things, labelled `model_name` (the served name) and `engine` (the replica), so
dashboards and autoscalers written for vLLM read them: `vllm:num_requests_running{model_name, engine}`,
`vllm:num_requests_waiting{model_name}` (the one queue), `vllm:request_success_total{model_name, engine,
finished_reason}` (stop: completed, abort: cancelled, error: failed), and the histograms
`vllm:e2e_request_latency_seconds`, `vllm:request_queue_time_seconds` and
`vllm:request_inference_time_seconds` (in the engine). Token counts, caches of keys and values and time to a
first token have no meaning for a diffusion request and are not exported.

The route takes the API key like /v1/* when the server has one (api_server.BearerAuth).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from vllm_omni.diffusion.protocol import HEALTH_STATES

if TYPE_CHECKING:
    from vllm_omni.diffusion.engine.job import Job
    from vllm_omni.diffusion.engine.scheduler import Scheduler

# Seconds, from a tiny model's fraction of a second to a long video's tens of minutes.
BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 25, 50, 100, 250, 500, 1000, 2500)

router = APIRouter()

# vLLM's finished_reason for a job's final status.
FINISHED_REASONS = {"completed": "stop", "cancelled": "abort", "failed": "error"}
VLLM_LABELS = ["model_name", "engine"]


class ServerMetrics:
    """The app's registry and metrics; `job_finished` / `steps_done` are the scheduler's observer calls."""

    def __init__(self, scheduler: Scheduler, model_name: str = "") -> None:
        self.registry = CollectorRegistry()
        self.model_name = model_name
        self.http = Counter(
            "vllm_omni_http_requests", "HTTP requests answered", ["route", "method", "status"], registry=self.registry
        )
        self.requests = Counter(
            "vllm_omni_requests", "generation requests finished", ["kind", "outcome"], registry=self.registry
        )
        times = {"queue": "in the queue", "run": "in the engine", "total": "from submit to the end"}
        self.seconds = {
            name: Histogram(
                f"vllm_omni_request_{name}_seconds",
                f"seconds a request spent {what}",
                ["kind"],
                buckets=BUCKETS,
                registry=self.registry,
            )
            for name, what in times.items()
        }
        phases = {
            "preprocess": "in the engine's checks",
            "encode": "encoding its text (once per SP group)",
            "denoise": "denoising (the pipeline call up to its last step)",
            "decode": "decoding (after its last step)",
            "onload": "moving offloaded weights onto the GPU (--cpu-offload encoders or model)",
        }
        self.phase_seconds = {
            name: Histogram(
                f"vllm_omni_request_{name}_seconds",
                f"seconds a completed request spent {what}",
                ["kind"],
                buckets=BUCKETS,
                registry=self.registry,
            )
            for name, what in phases.items()
        }
        self.suspended_seconds = Histogram(
            "vllm_omni_request_suspended_seconds",
            "seconds a request waited between two of its steps while requests ran inside it (--max-num-seqs)",
            ["kind"],
            buckets=BUCKETS,
            registry=self.registry,
        )
        self.steps_per_second = Histogram(
            "vllm_omni_request_steps_per_second",
            "a completed request's denoising steps per second",
            ["kind"],
            buckets=(0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64, 128),
            registry=self.registry,
        )
        self.batch_size = Histogram(
            "vllm_omni_batch_size",
            "requests that shared a pipeline call, per completed request",
            buckets=(1, 2, 3, 4, 6, 8, 12, 16),
            registry=self.registry,
        )
        self.steps = Counter("vllm_omni_denoising_steps", "denoising steps run", registry=self.registry)
        self.cache_forwards = Counter(
            "vllm_omni_step_cache_forwards",
            "denoiser forwards of completed requests the step cache computed or skipped",
            ["decision"],
            registry=self.registry,
        )
        self.bodies_reading = Gauge(  # the app sets its function: it reads routes/bodies.py's BodyReads
            "vllm_omni_request_bodies_reading",
            "request bodies being read now (at most --max-body-reads)",
            registry=self.registry,
        )
        self.vllm_success = Counter(
            "vllm:request_success",
            "finished requests (vLLM's name), by finished_reason",
            [*VLLM_LABELS, "finished_reason"],
            registry=self.registry,
        )
        vllm_times = {
            "e2e_request_latency": "from arrival to the end",
            "request_queue_time": "in the queue",
            "request_inference_time": "in the engine",
        }
        self.vllm_seconds = {
            name: Histogram(
                f"vllm:{name}_seconds",
                f"seconds a request spent {what} (vLLM's name)",
                VLLM_LABELS,
                buckets=BUCKETS,
                registry=self.registry,
            )
            for name, what in vllm_times.items()
        }
        self.registry.register(_StateCollector(scheduler, model_name))

    def job_finished(self, job: Job) -> None:
        kind = job.id.split("-", 1)[0]
        self.requests.labels(kind, job.status).inc()
        engine = str(job.replica or 0)  # a job cancelled in the queue ran nowhere: counted with the first
        self.vllm_success.labels(self.model_name, engine, FINISHED_REASONS.get(job.status, job.status)).inc()
        self.vllm_seconds["e2e_request_latency"].labels(self.model_name, engine).observe(
            job.completed_at - job.created_at
        )
        if job.started_at is not None:
            self.vllm_seconds["request_queue_time"].labels(self.model_name, engine).observe(
                job.started_at - job.created_at
            )
            self.vllm_seconds["request_inference_time"].labels(self.model_name, engine).observe(
                job.completed_at - job.started_at
            )
        if job.started_at is not None:
            self.seconds["queue"].labels(kind).observe(job.started_at - job.created_at)
            self.seconds["run"].labels(kind).observe(job.completed_at - job.started_at)
            self.suspended_seconds.labels(kind).observe(job.suspended_s)
        self.seconds["total"].labels(kind).observe(job.completed_at - job.created_at)
        if job.status != "completed" or job.result is None:
            return
        timings = job.result.timings_ms
        for name, histogram in self.phase_seconds.items():
            if name in timings:
                histogram.labels(kind).observe(timings[name] / 1e3)
        if timings.get("denoise"):
            self.steps_per_second.labels(kind).observe(job.request.num_inference_steps / (timings["denoise"] / 1e3))
        self.batch_size.observe(job.result.batch_size)
        cache = job.result.step_cache
        if cache is not None:
            self.cache_forwards.labels("computed").inc(cache["forwards_computed"])
            self.cache_forwards.labels("skipped").inc(cache["forwards_skipped"])

    def steps_done(self, count: int) -> None:
        self.steps.inc(count)


class _StateCollector:
    """Read at each scrape from the scheduler's own state (no worker is asked)."""

    def __init__(self, scheduler: Scheduler, model_name: str) -> None:
        self.scheduler = scheduler
        self.model_name = model_name

    def collect(self) -> Any:
        health = self.scheduler.health()
        yield GaugeMetricFamily("vllm_omni_queue_length", "requests waiting", value=self.scheduler.queue_length)
        waiting = GaugeMetricFamily(
            "vllm:num_requests_waiting", "requests waiting (vLLM's name)", labels=["model_name"]
        )
        waiting.add_metric([self.model_name], self.scheduler.queue_length)
        yield waiting
        vllm_running = GaugeMetricFamily(
            "vllm:num_requests_running", "requests running (vLLM's name)", labels=VLLM_LABELS
        )
        yield GaugeMetricFamily("vllm_omni_running_requests", "requests running", value=self.scheduler.running)
        yield CounterMetricFamily("vllm_omni_worker_restarts", "worker-group restarts", value=health.restarts)
        yield CounterMetricFamily(
            "vllm_omni_graph_capture_failures", "CUDA graph captures that failed", value=health.graph_capture_failures
        )
        state = GaugeMetricFamily("vllm_omni_server_state", "1 for the server's current state", labels=["state"])
        for name in HEALTH_STATES:
            state.add_metric([name], 1.0 if health.state == name else 0.0)
        yield state
        running = GaugeMetricFamily("vllm_omni_replica_running_requests", "requests running", labels=["replica"])
        states = GaugeMetricFamily("vllm_omni_replica_state", "1 for each replica's state", labels=["replica", "state"])
        restarts = CounterMetricFamily("vllm_omni_replica_worker_restarts", "worker-group restarts", labels=["replica"])
        counts = {
            name: GaugeMetricFamily(f"vllm_omni_{name}", what, labels=["replica", "rank"])
            for name, what in (
                ("graph_captures", "CUDA graphs the rank captured since its group started"),
                ("compiles", "graphs torch.compile compiled in the rank since its group started"),
            )
        }
        memory = {
            kind: GaugeMetricFamily(f"vllm_omni_gpu_memory_{kind}_bytes", what, labels=["replica", "rank"])
            for kind, what in (
                ("peak", "peak allocated GPU memory in the rank's last request"),
                ("allocated", "GPU memory the rank's tensors held after its last request"),
                ("reserved", "GPU memory the rank's caching allocator held after its last request"),
            )
        }
        for replica, (health, jobs, engine) in enumerate(self.scheduler.replica_states()):
            label = str(replica)
            running.add_metric([label], len(jobs))
            vllm_running.add_metric([self.model_name, label], len(jobs))
            for name in HEALTH_STATES:
                states.add_metric([label, name], 1.0 if health.state == name else 0.0)
            restarts.add_metric([label], health.restarts)
            for kind, family in memory.items():
                for rank, value in (engine.memory_bytes(kind) if hasattr(engine, "memory_bytes") else {}).items():
                    family.add_metric([label, str(rank)], value)
            for name, family in counts.items():
                for rank, count in (engine.rank_counts(name) if hasattr(engine, "rank_counts") else {}).items():
                    family.add_metric([label, str(rank)], count)
        yield from (running, vllm_running, states, restarts, *memory.values(), *counts.values())


class CountHTTP:
    """ASGI middleware: counts every answered request by route template, method and status."""

    def __init__(self, app: Any, metrics: ServerMetrics) -> None:
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}

        async def send_counting(message: dict) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_counting)
        finally:
            route = scope.get("route")
            path = getattr(route, "path", None) or "unmatched"
            self.metrics.http.labels(path, scope["method"], str(status["code"])).inc()


@router.get("/metrics", include_in_schema=False)
async def metrics(http: Request) -> Response:
    return Response(generate_latest(http.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)
