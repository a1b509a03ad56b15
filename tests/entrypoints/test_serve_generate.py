"""`vllm-omni serve tiny/qwen-image --ulysses-degree 2` end to end over real HTTP.

One server process for the module (CPU workers, debug logging). 272x208 is 17x13 = 221
image tokens: odd, so Ulysses 2 pads it by one. Covers the openai client, the curl form from
CONTEXT.md, readiness, bad input, FIFO under concurrency, cancellation on disconnect, worker
death (500, then served again), the watchdog, and SIGTERM.
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import httpx
import pytest
from openai import BadRequestError, OpenAI
from server_process import (
    HTTP_TIMEOUT_S,
    ServerProcess,
    decode_image,
    omni_command,
    open_request,
    process_alive,
    server_env,
)

pytestmark = pytest.mark.slow  # real server processes (started per module)

MODEL = "tiny/qwen-image"
PROMPT = "A cat holding a sign that says hello world."
SIZE = "272x208"  # 17x13 = 221 tokens, padded to 222 at Ulysses 2
SMALL_PADDED = "80x48"  # 5x3 = 15 tokens, padded to 16
LONG_STEPS = 4000  # far more than a test waits for: such a request only ends by being cancelled


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-generate") / "server.log"
    command = omni_command("serve", MODEL, "--ulysses-degree", "2", "--max-steps", str(LONG_STEPS))
    srv = ServerProcess(command, log, server_env(VLLM_LOGGING_LEVEL="DEBUG"))
    try:
        # Right after the port opens the workers are still loading (that takes seconds).
        srv.early_health = srv.first_health()
        srv.early_ping = httpx.get(f"{srv.url}/ping", timeout=30)
        srv.early_generation = httpx.post(
            f"{srv.url}/v1/images/generations", json={"prompt": PROMPT, "size": SIZE}, timeout=30
        )
        srv.wait_ready()
        yield srv
    finally:
        srv.close()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def generate(server, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": PROMPT, "size": SIZE, "num_inference_steps": 2, "seed": 1}
    body.update(fields)
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=HTTP_TIMEOUT_S)


def test_health_and_ping_answer_503_while_the_workers_load_then_200(server):
    assert server.early_health.status_code == 503
    assert server.early_health.json()["status"] == "loading"
    assert server.early_ping.status_code == 503  # vLLM's readiness route says the same
    assert server.early_generation.status_code == 503
    assert "loading" in server.early_generation.json()["error"]["message"]
    assert httpx.get(f"{server.url}/health").json() == {"status": "ok"}
    assert httpx.get(f"{server.url}/ping").status_code == 200


def test_openai_client_generates_at_a_padded_size(server, client):
    start = server.log_size()
    response = client.images.generate(
        model=MODEL,
        prompt=PROMPT,
        size=SIZE,
        n=1,
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 7},
    )
    image = decode_image(response.data[0].b64_json)
    assert image.format == "PNG" and image.size == (272, 208)
    assert response.size == SIZE
    assert response.model_extra["seed"] == 7
    assert (response.model_extra["width"], response.model_extra["height"]) == (272, 208)
    server.wait_for_log(r"Auto-padded sequence from 221 to 222 \(pad_size=1, world_size=2, dim=1\)", start)
    server.wait_for_log(
        r"DiffusionEngine\.step breakdown: preprocess=[\d.]+ ms, add_req_and_wait=[\d.]+ ms, "
        r"postprocess=[\d.]+ ms, total=[\d.]+ ms",
        start,
    )
    server.wait_for_log(r"Request img-\w+ done: size=272x208, steps=2, seed=7, n=1", start)


def test_image_i_of_n_is_drawn_from_seed_plus_i_and_says_so(client):
    """n=2 at seed 21 reports seeds 21 and 22, and its second image is the one n=1 at seed 22 makes."""
    extra = {"num_inference_steps": 2, "seed": 21}
    two = client.images.generate(model=MODEL, prompt=PROMPT, size="64x64", n=2, extra_body=extra)
    assert two.model_extra["seed"] == 21 and [item.model_extra["seed"] for item in two.data] == [21, 22]
    one = client.images.generate(model=MODEL, prompt=PROMPT, size="64x64", n=1, extra_body={**extra, "seed": 22})
    assert one.data[0].model_extra["seed"] == 22
    assert two.data[1].b64_json == one.data[0].b64_json  # the same PNG bytes, as alone
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], extra_body={**extra, "size": "64x64", "n": 2}
    )
    assert chat.model_extra["seeds"] == [21, 22]


def test_curl_form_from_context_md(server):
    # CONTEXT.md's curl, with the tiny model, a padded size and 2 steps instead of 50.
    response = httpx.post(
        f"{server.url}/v1/images/generations",
        headers={"Content-Type": "application/json"},
        content=(
            '{"model": "tiny/qwen-image", "prompt": "A cat holding a sign that says hello world.", '
            '"negative_prompt": " ", "size": "272x208", "num_inference_steps": 2, '
            '"guidance_scale": 0.0, "seed": 42, "response_format": "b64_json"}'
        ),
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert isinstance(body["created"], int) and body["seed"] == 42 and body["size"] == SIZE
    assert decode_image(body["data"][0]["b64_json"]).size == (272, 208)
    assert response.headers["x-request-id"] == body["id"]


def test_size_not_a_multiple_of_16_is_rounded_down_and_reported(server):
    response = generate(server, size="280x215")
    assert response.status_code == 200, response.text
    assert response.json()["size"] == SIZE
    assert decode_image(response.json()["data"][0]["b64_json"]).size == (272, 208)


def test_n_images_come_back_distinct(server):
    data = generate(server, n=2, size="64x48").json()["data"]
    assert len(data) == 2 and data[0]["b64_json"] != data[1]["b64_json"]
    assert {decode_image(d["b64_json"]).size for d in data} == {(64, 48)}


def test_concurrent_requests_each_get_the_image_of_their_own_seed(server):
    seeds = [11, 12, 13]
    together: dict[int, str] = {}

    def run(seed: int) -> None:
        response = generate(server, seed=seed, size=SMALL_PADDED)
        assert response.status_code == 200, response.text
        assert response.json()["seed"] == seed
        together[seed] = response.json()["data"][0]["b64_json"]

    threads = [threading.Thread(target=run, args=(seed,)) for seed in seeds]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert sorted(together) == seeds
    assert len(set(together.values())) == 3
    for seed in seeds:
        alone = generate(server, seed=seed, size=SMALL_PADDED).json()["data"][0]["b64_json"]
        assert alone == together[seed], f"seed {seed}: the concurrent result differs from the one made alone"


@pytest.mark.parametrize(
    "fields,param,words",
    [
        ({"size": "abc"}, "size", "WIDTHxHEIGHT"),
        ({"size": "0x0"}, "size", "positive"),
        ({"size": "99999x99999"}, "size", "at most 4096"),
        ({"size": "8x8"}, "size", "at least 16"),
        ({"num_inference_steps": 0}, "num_inference_steps", "between"),
        ({"num_inference_steps": 10000}, "num_inference_steps", "between"),
        ({"n": 100}, "n", "between"),
        ({"n": "many"}, "n", "integer"),
        ({"seed": -5}, "seed", "between"),
        ({"guidance_scale": 1000}, "guidance_scale", "between"),
        ({"cache_threshold": 0.1}, "cache_threshold", "needs a server with a step cache"),  # this one has none
        ({"response_format": "url"}, "response_format", "b64_json"),
        ({"prompt": ""}, "prompt", "non-empty"),
        ({"prompt": None}, "prompt", "string"),
        ({"num_steps": 4}, "num_steps", "unknown field"),
        ({"stream": True}, "stream", "not supported"),
        # Found by a hostile-client probe:
        ({"n": True}, "n", "expected a number"),
        ({"size": "\uff12\uff17\uff12x208"}, "size", "WIDTHxHEIGHT"),  # full-width digits
        ({"prompt": " the" * 508}, "prompt", "508 tokens; the limit is 507"),  # beyond what the pipeline reads
        ({"negative_prompt": " the" * 508}, "negative_prompt", "the limit is 507"),
        ({"prompt": "a" * 500_000}, "prompt", "far longer than the limit"),  # refused without tokenizing
    ],
)
def test_bad_input_is_400_naming_the_field_and_the_server_keeps_serving(server, fields, param, words):
    response = generate(server, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and param in error["message"] and words in error["message"]
    assert generate(server, size="32x32").status_code == 200


def test_a_model_not_served_is_404_model_not_found_and_the_server_keeps_serving(server):
    response = generate(server, model="no-such/model")
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found") and "not served here" in error["message"]
    assert generate(server, size="32x32").status_code == 200


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_a_lone_surrogate_in_the_text_is_400_naming_the_field(server, field):
    # JSON may spell a lone surrogate; it is bad input, not a crash in the tokenizer.
    content = f'{{"{field}": "cat \\ud800", "size": "32x32", "num_inference_steps": 2}}'
    if field != "prompt":
        content = content.replace("{", '{"prompt": "a cat", ', 1)
    response = httpx.post(
        f"{server.url}/v1/images/generations", content=content, headers={"Content-Type": "application/json"}
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field and "lone surrogate" in response.json()["error"]["message"]


def test_openai_client_sees_the_400_message(client):
    with pytest.raises(BadRequestError, match="size must be 'WIDTHxHEIGHT'"):
        client.images.generate(model=MODEL, prompt=PROMPT, size="abc")


def test_a_priority_on_a_server_not_scheduling_by_priority_is_a_400_naming_it(client):
    with pytest.raises(BadRequestError, match="--scheduling-policy priority") as refused:
        client.images.generate(model=MODEL, prompt=PROMPT, size="32x32", extra_body={"priority": 1})
    assert refused.value.body["param"] == "priority"


@pytest.mark.parametrize(
    "content,headers,words",
    [
        (b"{not json", {"Content-Type": "application/json"}, "not valid JSON"),
        (b"[1, 2]", {"Content-Type": "application/json"}, "JSON object"),
        (b"prompt=a+cat", {"Content-Type": "application/x-www-form-urlencoded"}, "JSON object"),
    ],
)
def test_body_that_is_not_a_json_object_is_400(server, content, headers, words):
    response = httpx.post(f"{server.url}/v1/images/generations", content=content, headers=headers, timeout=30)
    assert response.status_code == 400 and words in response.json()["error"]["message"]


@pytest.mark.parametrize(
    "method,path,content,status,words",
    [
        ("GET", "/v1/no-such-thing", None, 404, "no such endpoint: GET /v1/no-such-thing"),
        ("GET", "/v1/images/generations", None, 405, "GET is not allowed on /v1/images/generations; use POST"),
        ("POST", "/v1/images/generations", b'{"prompt": "caf\xe9"}', 400, "not UTF-8"),
        ("POST", "/v1/images/generations", b"[" * 100_000 + b"]" * 100_000, 400, "nested too deeply"),
    ],
    ids=["unknown-path", "wrong-method", "invalid-utf8", "deep-nesting"],
)
def test_every_error_answers_in_the_openai_shape(server, method, path, content, status, words):
    headers = {"Content-Type": "application/json"}
    response = httpx.request(method, f"{server.url}{path}", content=content, headers=headers, timeout=30)
    assert response.status_code == status
    body = response.json()
    assert set(body) == {"error"} and words in body["error"]["message"], body


def test_edit_endpoint_on_a_text_to_image_model_is_400(server):
    response = httpx.post(
        f"{server.url}/v1/images/edits",
        data={"prompt": PROMPT, "size": "32x32"},
        files={"image": ("a.png", _png_bytes(), "image/png")},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 400 and "image is not accepted" in response.json()["error"]["message"]


def _png_bytes() -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buffer, format="PNG")
    return buffer.getvalue()


def test_models_lists_the_served_model_with_its_effective_config(server):
    models = httpx.get(f"{server.url}/v1/models").json()
    assert models["object"] == "list" and [m["id"] for m in models["data"]] == [MODEL]
    card = models["data"][0]
    assert card["task"] == "generate" and card["ready"] is True
    assert card["parallel_config"]["ulysses_degree"] == 2
    assert card["parallel_config"]["mask_sp_padding"] is False and card["parallel_config"]["trim_sp_padding"] is True
    assert card["limits"]["max_steps"] == LONG_STEPS
    assert card["limits"]["max_tokens_per_step"] == 81920  # the model's default, as the engine applies it
    assert card["batching"] == {"max_batch_size": 1, "batch_wait_ms": 0.0}  # off: no --max-batch-size given
    assert card["quantization"] is None


def _queued_id(server, start: int, steps: int) -> str:
    return server.wait_for_log(rf"Request (img-\w+) queued: size={SIZE}, steps={steps}", start).group(1)


def _wait_until_denoising(server, request_id: str, start: int) -> None:
    """The workers are inside the request's denoising loop (debug logging shows each padded shard)."""
    running = server.wait_past(rf"Request {request_id} running", start)
    server.wait_for_log(r"Auto-padded sequence from", running)


def test_client_disconnect_cancels_the_running_request_at_the_next_step(server):
    start = server.log_size()
    body = {"prompt": PROMPT, "size": SIZE, "num_inference_steps": LONG_STEPS, "seed": 3}
    sock = open_request(server.url, "/v1/images/generations", body)
    request_id = _queued_id(server, start, LONG_STEPS)
    _wait_until_denoising(server, request_id, start)
    sock.close()  # the client goes away
    server.wait_for_log(rf"Request {request_id}: client disconnected, cancelling", start)
    step = int(server.wait_for_log(rf"request {request_id} cancelled at step (\d+)", start).group(1))
    assert step < LONG_STEPS
    server.wait_for_log(rf"Request {request_id} cancelled", start)
    response = generate(server, size="32x32")
    assert response.status_code == 200, response.text


def test_worker_death_mid_request_is_a_500_and_the_next_request_works(server):
    start = server.log_size()
    workers = server.worker_pids()
    assert len(workers) == 2
    outcome: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("response", generate(server, num_inference_steps=LONG_STEPS))
    )
    thread.start()
    request_id = _queued_id(server, start, LONG_STEPS)
    _wait_until_denoising(server, request_id, start)
    os.kill(workers[1], signal.SIGKILL)
    thread.join(timeout=HTTP_TIMEOUT_S)
    response = outcome["response"]
    assert response.status_code == 500, response.text
    assert "worker died" in response.json()["error"]["message"]
    assert generate(server, size="32x32").status_code == 200
    assert set(server.worker_pids()).isdisjoint(workers)


def test_watchdog_respawns_a_worker_that_died_while_idle(server):
    start = server.log_size()
    workers = server.worker_pids()
    os.kill(workers[0], signal.SIGKILL)
    statuses = set()
    deadline = time.monotonic() + HTTP_TIMEOUT_S  # a hang guard, not a timing check
    while time.monotonic() < deadline:  # unhealthy from the moment it died until the new group has loaded
        status = httpx.get(f"{server.url}/health", timeout=30).status_code
        statuses.add(status)
        if status == 200 and 503 in statuses:
            break
        time.sleep(0.05)
    assert statuses == {200, 503}
    server.wait_for_log(r"Restarting workers: worker rank \d exited", start)
    assert set(server.worker_pids()).isdisjoint(workers)
    assert generate(server, size="32x32").status_code == 200


def test_sigterm_cancels_work_closes_the_workers_and_exits_0(server):
    start = server.log_size()
    workers = server.worker_pids()
    outcome: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("response", generate(server, num_inference_steps=LONG_STEPS))
    )
    thread.start()
    request_id = _queued_id(server, start, LONG_STEPS)
    _wait_until_denoising(server, request_id, start)
    assert server.terminate() == 0
    thread.join(timeout=HTTP_TIMEOUT_S)
    assert outcome["response"].status_code == 503
    assert "shutting down" in outcome["response"].json()["error"]["message"]
    assert re.search(r"Workers shut down", server.log(start))
    assert not any(process_alive(pid) for pid in workers)
