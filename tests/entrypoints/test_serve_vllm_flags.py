"""The flags and routes a vLLM user brings: one real server started with vLLM's server flags (HTTPS from
--ssl-keyfile/--ssl-certfile, --root-path, CORS from --allowed-origins, --disable-log-requests,
--uvicorn-log-level, --tensor-parallel-size 1, --download-dir), driven by the `openai` client; GET /version and
/ping; a model the server does not serve is a 404; --tensor-parallel-size above 1 is refused in one line."""

from __future__ import annotations

import re
import shutil
import ssl
import subprocess

import httpx
import openai
import pytest
from server_process import HTTP_TIMEOUT_S, REPO, omni_command, server_env, start_server

import vllm_omni

pytestmark = pytest.mark.slow  # real server processes (started per module)

MODEL = "tiny/qwen-image"
KEY = "vllm-flags-key"
ORIGIN = "https://app.example"


def self_signed_certificate(folder) -> tuple[str, str]:
    """(key file, certificate file) for 127.0.0.1, made by the openssl command."""
    key, cert = folder / "key.pem", folder / "cert.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1"]
        + ["-addext", "subjectAltName=IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
        check=True,
        capture_output=True,
    )
    return str(key), str(cert)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes this server's certificate")
    root = tmp_path_factory.mktemp("vllm-flags")
    key, cert = self_signed_certificate(root)
    args = [MODEL, "--api-key", KEY, "--ssl-keyfile", key, "--ssl-certfile", cert, "--root-path", "/api"]
    args += ["--allowed-origins", f'["{ORIGIN}"]', "--disable-log-requests", "--uvicorn-log-level", "warning"]
    args += ["--tensor-parallel-size", "1", "--download-dir", str(root / "hub")]
    srv = start_server(args, root / "server.log", verify=ssl.create_default_context(cafile=cert))
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    http = httpx.Client(verify=server.verify, timeout=HTTP_TIMEOUT_S)
    yield openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, http_client=http)
    http.close()


def get(server, path: str, **kwargs) -> httpx.Response:
    return httpx.request(kwargs.pop("method", "GET"), f"{server.url}{path}", verify=server.verify, **kwargs)


def test_the_openai_client_generates_over_https_and_requests_are_not_logged(server, client):
    start = server.log_size()
    result = client.images.generate(model=MODEL, prompt="a fox", size="32x32", extra_body={"num_inference_steps": 2})
    assert result.data[0].b64_json
    assert server.url.startswith("https://") and "Serving tiny/qwen-image on https://" in server.log()
    log = server.log(start)
    assert "Request img-" in log  # the workers' line, not the server's request log
    assert not re.search(r"Request img-\w+ (queued|running|done)", log)  # --disable-log-requests
    assert "POST /v1/images/generations" not in log  # uvicorn's access lines are info: --uvicorn-log-level warning


def test_a_model_not_served_is_404_model_not_found(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.images.generate(model="no-such/model", prompt="a fox", size="32x32")
    assert caught.value.status_code == 404
    assert (caught.value.code, caught.value.param) == ("model_not_found", "model")
    assert "not served here" in caught.value.message


def test_version_and_ping_answer_without_the_key(server):
    assert get(server, "/version").json() == {"version": vllm_omni.__version__}
    assert get(server, "/ping").status_code == 200 and get(server, "/ping", method="POST").status_code == 200


def test_the_root_path_is_the_apps_and_v1_still_takes_the_key(server):
    assert get(server, "/openapi.json").json()["servers"] == [{"url": "/api"}]
    assert get(server, "/v1/models").status_code == 401
    assert get(server, "/v1/models", headers={"Authorization": f"Bearer {KEY}"}).status_code == 200


def test_cors_answers_the_allowed_origin_only(server):
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    path = "/v1/images/generations"
    allowed = get(server, path, method="OPTIONS", headers={"Origin": ORIGIN, **preflight})
    assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == ORIGIN
    other = get(server, path, method="OPTIONS", headers={"Origin": "https://x.example", **preflight})
    assert other.status_code == 400 and "access-control-allow-origin" not in other.headers
    simple = get(server, "/v1/models", headers={"Origin": ORIGIN, "Authorization": f"Bearer {KEY}"})
    assert simple.headers["access-control-allow-origin"] == ORIGIN


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_tensor_parallel_above_1_is_refused_in_one_line_naming_the_flags_that_split(command):
    args = [MODEL, "--tensor-parallel-size", "2"] + (["--prompt", "x"] if command == "generate" else [])
    result = subprocess.run(
        omni_command(command, *args), capture_output=True, text=True, timeout=120, env=server_env(), cwd=REPO
    )
    assert result.returncode == 2 and result.stdout == ""
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "--ulysses-degree" in lines[0] and "--cfg-parallel-size" in lines[0], result.stderr
