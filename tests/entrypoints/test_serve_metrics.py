"""GET /metrics on a real server (`vllm-omni serve tiny/qwen-image --api-key ...`): the Prometheus
text parses with prometheus_client's own parser, it takes the API key like /v1/*, and its counters
move as requests run (the `openai` client makes them). The per-rank GPU memory gauges, which a CPU
server has no figures for, are read from ranks' reports without a server."""

from __future__ import annotations

from types import SimpleNamespace
from typing import get_args

import httpx
import pytest
from openai import BadRequestError, OpenAI
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families
from server_process import HTTP_TIMEOUT_S, start_server

from vllm_omni.diffusion.engine.core import DiffusionEngine
from vllm_omni.diffusion.engine.lifecycle import Health
from vllm_omni.diffusion.protocol import HealthState, Stats
from vllm_omni.entrypoints.openai.metrics import ServerMetrics

KEY = "metrics-test-key"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-metrics")
    args = ["tiny/qwen-image", "--api-key", KEY, "--video-dir", str(root / "videos"), "--max-batch-size", "4"]
    srv = start_server(args, root / "server.log")
    yield srv
    srv.close()


def scrape(server) -> dict[tuple[str, tuple], float]:
    response = httpx.get(f"{server.url}/metrics", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
    }


def test_metrics_need_the_key(server):
    assert httpx.get(f"{server.url}/metrics", timeout=30).status_code == 401
    assert httpx.get(f"{server.url}/health", timeout=30).status_code == 200  # still open


def test_the_exported_states_are_exactly_the_health_states(server):
    samples = scrape(server)
    server_states = {dict(labels)["state"] for name, labels in samples if name == "vllm_omni_server_state"}
    replica_states = {dict(labels)["state"] for name, labels in samples if name == "vllm_omni_replica_state"}
    assert server_states == replica_states == set(get_args(HealthState))
    assert sum(value for (name, _), value in samples.items() if name == "vllm_omni_server_state") == 1


def test_counters_move_as_requests_run(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT_S)
    before = scrape(server)
    completed = ("vllm_omni_requests_total", (("kind", "img"), ("outcome", "completed")))
    route_ok = (
        "vllm_omni_http_requests_total",
        (("method", "POST"), ("route", "/v1/images/generations"), ("status", "200")),
    )
    route_bad = (
        "vllm_omni_http_requests_total",
        (("method", "POST"), ("route", "/v1/images/generations"), ("status", "400")),
    )
    client.images.generate(model="tiny/qwen-image", prompt="a fox", size="64x64", extra_body={"num_inference_steps": 3})
    with pytest.raises(BadRequestError):
        client.images.generate(model="tiny/qwen-image", prompt="a fox", size="64x64", extra_body={"num_frames": 5})
    after = scrape(server)
    assert after[completed] - before.get(completed, 0) == 1
    assert after[route_ok] - before.get(route_ok, 0) == 1
    assert after[route_bad] - before.get(route_bad, 0) == 1
    assert after[("vllm_omni_denoising_steps_total", ())] - before.get(("vllm_omni_denoising_steps_total", ()), 0) == 3
    total = ("vllm_omni_request_total_seconds_count", (("kind", "img"),))
    assert after[total] - before.get(total, 0) == 1
    assert after[("vllm_omni_queue_length", ())] == 0 and after[("vllm_omni_running_requests", ())] == 0
    assert after[("vllm_omni_server_state", (("state", "ok"),))] == 1
    assert after[("vllm_omni_server_state", (("state", "loading"),))] == 0
    assert after[("vllm_omni_worker_restarts_total", ())] == 0
    # The phases inside the workers, the steps per second and the batch size, per completed request.
    for name in ("preprocess", "denoise", "decode"):
        count = (f"vllm_omni_request_{name}_seconds_count", (("kind", "img"),))
        assert after[count] - before.get(count, 0) == 1, name
    assert after[("vllm_omni_request_denoise_seconds_sum", (("kind", "img"),))] > 0
    rate = ("vllm_omni_request_steps_per_second_count", (("kind", "img"),))
    assert after[rate] - before.get(rate, 0) == 1
    batch = ("vllm_omni_batch_size_sum", ())
    assert after[batch] - before.get(batch, 0) == 1  # alone: a batch of one
    # One replica: its own series agree with the server's.
    assert after[("vllm_omni_replica_running_requests", (("replica", "0"),))] == 0
    assert after[("vllm_omni_replica_state", (("replica", "0"), ("state", "ok")))] == 1
    assert after[("vllm_omni_replica_worker_restarts_total", (("replica", "0"),))] == 0
    # Each rank's counts as of its last request: a CPU worker captures no CUDA graph and compiles nothing.
    assert after[("vllm_omni_graph_captures", (("rank", "0"), ("replica", "0")))] == 0
    assert after[("vllm_omni_compiles", (("rank", "0"), ("replica", "0")))] == 0


def test_vllms_names_are_exported_with_the_same_values(server):
    """Dashboards written for vLLM read its names: the gauges, the request counter by finished_reason and the
    latency histograms, labelled with the served model (and the replica as `engine`)."""
    client = OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT_S)
    model, engine = ("model_name", "tiny/qwen-image"), ("engine", "0")
    before = scrape(server)
    client.images.generate(model="tiny/qwen-image", prompt="a fox", size="32x32", extra_body={"num_inference_steps": 2})
    after = scrape(server)

    def moved(name: str, *labels: tuple[str, str]) -> float:
        key = (name, tuple(sorted(labels)))
        return after[key] - before.get(key, 0)

    assert after[("vllm:num_requests_running", (engine, model))] == 0
    assert after[("vllm:num_requests_waiting", (model,))] == 0
    assert moved("vllm:request_success_total", engine, ("finished_reason", "stop"), model) == 1
    for name in ("e2e_request_latency", "request_queue_time", "request_inference_time"):
        assert moved(f"vllm:{name}_seconds_count", engine, model) == 1, name
        assert moved(f"vllm:{name}_seconds_sum", engine, model) >= 0, name
    e2e = moved("vllm:e2e_request_latency_seconds_sum", engine, model)
    parts = moved("vllm:request_queue_time_seconds_sum", engine, model)
    parts += moved("vllm:request_inference_time_seconds_sum", engine, model)
    assert e2e > 0 and abs(e2e - parts) < 1e-6  # the queue and the engine make up the whole
    # Ours stay: the same request counted under our name too.
    assert moved("vllm_omni_requests_total", ("kind", "img"), ("outcome", "completed")) == 1


def test_each_ranks_gpu_memory_is_exported_from_its_last_report():
    """Peak, allocated and reserved bytes per rank, as each CUDA rank last reported them (protocol.Stats);
    a rank without figures (a CPU rank) has no series."""

    def stats(rank: int, peak: int | None, allocated: int | None, reserved: int | None) -> Stats:
        return Stats(rank, "req-1", {}, 0, 0, None, peak, allocated, reserved)

    class Engine(SimpleNamespace):  # DiffusionEngine's own reading of its executor's reports
        memory_bytes = DiffusionEngine.memory_bytes

    engine = Engine(
        executor=SimpleNamespace(rank_stats={0: stats(0, 9, 5, 8), 1: stats(1, 7, 3, 4), 2: stats(2, *[None] * 3)})
    )
    scheduler = SimpleNamespace(
        health=lambda: Health("ok"),
        queue_length=0,
        running=0,
        replica_states=lambda: [(Health("ok"), [], engine)],
    )
    samples = {
        (sample.name, sample.labels["rank"]): sample.value
        for family in text_string_to_metric_families(generate_latest(ServerMetrics(scheduler).registry).decode())
        for sample in family.samples
        if sample.name.startswith("vllm_omni_gpu_memory_")
    }
    assert samples == {
        ("vllm_omni_gpu_memory_peak_bytes", "0"): 9,
        ("vllm_omni_gpu_memory_allocated_bytes", "0"): 5,
        ("vllm_omni_gpu_memory_reserved_bytes", "0"): 8,
        ("vllm_omni_gpu_memory_peak_bytes", "1"): 7,
        ("vllm_omni_gpu_memory_allocated_bytes", "1"): 3,
        ("vllm_omni_gpu_memory_reserved_bytes", "1"): 4,
    }
