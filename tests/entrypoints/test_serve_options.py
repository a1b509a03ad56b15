"""Server options end to end: deploy YAML with flags over it, bearer auth, and the queue limit.

One server for the module: the YAML asks for Ulysses 3 with masked padding, 3 default steps and
the step cache; `--ulysses-degree 2` overrides the degree, `--cache-threshold` the cache's
threshold. `--api-key` turns auth on and `--max-queue 1` lets one request wait behind the
running one. `--served-model-name` gives the tiny model the real one's name; `--max-image-size
512` is below the model's default size. A simulated 64 MiB GPU (the memory plan's test doubles, with the
warm-up's measured step) sizes what it admits. The server reads the tiny model from a copy of its own, which the
last test breaks: workers that cannot be reloaded end the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import threading

import httpx
import openai
import pytest
from server_process import HTTP_TIMEOUT_S, decode_image, open_request, start_server

from vllm_omni.diffusion.model_source import resolve_model_path
from vllm_omni.testing.memory import TEST_GPU_MEMORY_ENV, TEST_MEASURED_STEP_ENV

pytestmark = pytest.mark.slow  # real server processes (started per module)

MODEL = "tiny/qwen-image"
SERVED = "Qwen/Qwen-Image"  # what clients of the real model send (CONTEXT.md's curl)
KEY = "sk-test-omni"
AUTH = {"Authorization": f"Bearer {KEY}"}
LONG_STEPS = 4000
DEPLOY_YAML = """\
stages:
  - stage_id: 0
    devices: "0,1,2"
    parallel_config:
      ulysses_degree: 3
      mask_sp_padding: true
    default_sampling_params:
      num_inference_steps: 3
    cache: {policy: first_block, threshold: 0.3}
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-options")
    (folder / "deploy.yaml").write_text(DEPLOY_YAML)
    # The tiny model's cache layout ($VLLM_OMNI_CACHE/tiny/<name>), in a copy this module may break.
    built = resolve_model_path(MODEL)
    cache = folder / "cache"
    shutil.copytree(built, cache / "tiny" / built.name)
    args = [MODEL, "--deploy-config", str(folder / "deploy.yaml"), "--ulysses-degree", "2", "--cache-threshold", "0.4"]
    args += ["--api-key", KEY, "--max-queue", "1", "--max-steps", str(LONG_STEPS), "--served-model-name", SERVED]
    args += ["--max-image-size", "512"]
    gpu = {TEST_GPU_MEMORY_ENV: "64MiB", TEST_MEASURED_STEP_ENV: "1.5"}  # a step measured at 1.5x the estimate
    srv = start_server(args, folder / "server.log", VLLM_OMNI_CACHE=str(cache), **gpu)
    srv.model_folder = cache / "tiny" / built.name
    yield srv
    srv.close()


def post(server, headers=AUTH, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "a red cube", "size": "80x48", "seed": 0}
    body.update(fields)
    return httpx.post(f"{server.url}/v1/images/generations", json=body, headers=headers, timeout=HTTP_TIMEOUT_S)


def test_flags_override_the_yaml_and_only_the_flags_given(server):
    card = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"][0]
    assert card["parallel_config"]["ulysses_degree"] == 2  # the flag
    assert card["parallel_config"]["sequence_parallel_size"] == 2
    assert card["parallel_config"]["mask_sp_padding"] is True  # the YAML; no flag given
    assert card["parallel_config"]["trim_sp_padding"] is True  # the default
    assert card["default_sampling_params"] == {"num_inference_steps": 3}
    assert card["cache"] == {"policy": "first_block", "threshold": 0.4}  # the YAML's, its threshold the flag's
    assert "Starting 2 worker(s) for tiny/qwen-image" in server.log()
    assert "ulysses_degree=2, ring_degree=1, cfg_parallel_size=1, padding=mask" in server.log()


def test_served_model_name_is_listed_and_both_names_are_accepted(server):
    models = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    assert [(m["id"], m["root"]) for m in models] == [(SERVED, MODEL)]
    assert post(server, model=SERVED).status_code == 200
    assert post(server, model=MODEL).status_code == 200
    response = post(server, model="Qwen/Qwen-Image-Edit")  # not served here: OpenAI's and vLLM's 404
    error = response.json()["error"]
    assert response.status_code == 404 and error["param"] == "model" and error["code"] == "model_not_found"


def test_yaml_default_steps_apply_when_the_request_gives_none(server):
    start = server.log_size()
    response = post(server)
    assert response.status_code == 200, response.text
    assert decode_image(response.json()["data"][0]["b64_json"]).size == (80, 48)
    server.wait_for_log(r"Request img-\w+ done: size=80x48, steps=3,", start)
    assert post(server, num_inference_steps=2).status_code == 200
    server.wait_for_log(r"Request img-\w+ done: size=80x48, steps=2,", start)


def test_v1_needs_the_api_key_and_health_does_not(server):
    assert httpx.get(f"{server.url}/health").status_code == 200
    assert httpx.get(f"{server.url}/v1/models").status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": KEY}).status_code == 401
    response = post(server, headers={})
    assert response.status_code == 401 and "API key" in response.json()["error"]["message"]
    assert response.headers["www-authenticate"] == "Bearer"
    # The videos routes alike, the synchronous one too; with the key, both answer this image model's 400.
    for path in ("/v1/videos", "/v1/videos/sync"):
        assert httpx.post(f"{server.url}{path}", json={"prompt": "a cat"}).status_code == 401
        response = httpx.post(f"{server.url}{path}", json={"prompt": "a cat"}, headers=AUTH)
        error = response.json()["error"]
        assert (response.status_code, error["param"], error["code"]) == (400, "model", "wrong_modality"), error


@pytest.mark.parametrize("scheme", ["bearer", "BEARER", "Bearer"])
def test_the_auth_scheme_is_case_insensitive(server, scheme):
    # RFC 7235: the scheme name is case-insensitive; the key is not.
    assert httpx.get(f"{server.url}/v1/models", headers={"Authorization": f"{scheme} {KEY}"}).status_code == 200
    wrong_case_key = {"Authorization": f"{scheme} {KEY.upper()}"}
    assert httpx.get(f"{server.url}/v1/models", headers=wrong_case_key).status_code == 401


def test_a_size_the_model_picks_itself_is_checked_against_the_largest_side(server):
    # No size: Qwen-Image would run at 1024x1024, above --max-image-size 512.
    response = post(server, size=None)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "size" and "1024x1024" in error["message"] and "512" in error["message"]


def test_models_reports_what_the_gpu_admits_as_the_start_line_says(server):
    """The envelope of a (simulated) 64 MiB GPU at Ulysses 2: the default 1024x1024 request (4096 tokens) fits, the
    warm-up measured a step at the largest square the size limit allows (512x512), and GET /v1/models says what one
    forward holds, in the words of the start line."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT_S)
    envelope = client.models.list().data[0].model_extra["envelope"]
    assert envelope["max_tokens_per_step"] >= 4096 and envelope["max_rows"] == 4, envelope
    assert "Measured one step at 512x512" in server.log()
    assert f"Serving {envelope['description']}" in server.log()


def test_openai_client_with_the_key_works_and_without_it_is_refused(server):
    good = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT_S)
    response = good.images.generate(model=MODEL, prompt="a red cube", size="80x48", extra_body={"seed": 1})
    assert decode_image(response.data[0].b64_json).size == (80, 48)
    bad = openai.OpenAI(base_url=f"{server.url}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.images.generate(model=MODEL, prompt="a red cube", size="80x48")


def test_a_requests_cache_threshold_is_reported_with_the_steps_it_skipped_and_counted_in_the_metrics(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT_S)

    def skipped_total() -> float:
        text = httpx.get(f"{server.url}/metrics", headers=AUTH, timeout=30).text
        line = next(
            x for x in text.splitlines() if x.startswith('vllm_omni_step_cache_forwards_total{decision="skipped"}')
        )
        return float(line.split()[-1])

    before = skipped_total()
    # Above every change: each step after the first (no negative prompt: one forward a step) is skipped.
    response = client.images.generate(
        model=MODEL, prompt="a red cube", size="80x48", extra_body={"cache_threshold": 10.0, "num_inference_steps": 4}
    )
    report = response.model_extra["step_cache"]
    assert report["threshold"] == 10.0 and report["forwards_computed"] == 1 and report["forwards_skipped"] == 3
    assert report["skipped_steps"] == {"cond": [1, 2, 3]} and report["median_change"] > 0
    assert skipped_total() - before == 3
    default = post(server).json()["step_cache"]
    assert default["threshold"] == 0.4 and default["forwards_computed"] + default["forwards_skipped"] == 3
    with pytest.raises(openai.BadRequestError) as refused:
        client.images.generate(model=MODEL, prompt="a red cube", size="80x48", extra_body={"cache_threshold": -1})
    assert refused.value.body["param"] == "cache_threshold" and "must be a number > 0" in refused.value.message


def test_full_queue_is_429_and_a_waiting_request_whose_client_left_is_dropped(server):
    start = server.log_size()
    body = {"prompt": "a red cube", "size": "80x48", "num_inference_steps": LONG_STEPS}
    running = open_request(server.url, "/v1/images/generations", body, AUTH)
    first = server.wait_for_log(rf"Request (img-\w+) queued: size=80x48, steps={LONG_STEPS}", start).group(1)
    server.wait_for_log(rf"Request {first} running", start)
    waiting = open_request(server.url, "/v1/images/generations", body, AUTH)
    second = server.wait_for_log(rf"Request ((?!{first})img-\w+) queued: size=80x48, steps={LONG_STEPS}", start).group(
        1
    )

    refused = post(server)
    assert refused.status_code == 429 and "queue is full" in refused.json()["error"]["message"]
    assert int(refused.headers["retry-after"]) >= 1

    waiting.close()
    server.wait_for_log(rf"Request {second} dropped from the queue: client disconnected", start)
    running.close()
    server.wait_for_log(rf"request {first} cancelled at step \d+", start)
    assert post(server).status_code == 200
    assert f"Request {second} running" not in server.log(start)


def test_workers_that_cannot_be_reloaded_fail_the_request_in_one_line_and_end_the_server(server):
    # Runs last: the server does not survive it.
    start = server.log_size()
    (server.model_folder / "model_index.json").unlink()  # a new worker fails early in its load
    outcome: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("response", post(server, num_inference_steps=LONG_STEPS))
    )
    thread.start()
    request_id = server.wait_for_log(rf"Request (img-\w+) queued: size=80x48, steps={LONG_STEPS}", start).group(1)
    server.wait_for_log(rf"Request {request_id} running", start)
    workers = server.worker_pids()
    assert workers
    os.kill(workers[-1], signal.SIGKILL)
    thread.join(timeout=HTTP_TIMEOUT_S)
    response = outcome["response"]
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "\n" not in message and "Traceback" not in message and 'File "' not in message, message
    assert server.wait_exit() == 1
    assert "Traceback" in server.log(start)  # the details went to the log
