"""Replicas behind one server: `vllm-omni serve tiny/qwen-image --data-parallel-size 2` (CPU workers).

Rank 0 of whichever replica runs a request whose prompt is HOLD pauses at its first step until the
request is cancelled (the worker's VLLM_OMNI_TEST_FAULT hook), so one replica stays busy for as
long as the test needs: another request must then run, and finish, on the other replica. Its image
equals the one-replica engine's. Shutting the server down cancels the held request.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time

import httpx
import numpy as np
import pytest
from openai import InternalServerError, OpenAI
from server_process import HTTP_TIMEOUT_S, decode_image, start_server

pytestmark = pytest.mark.slow  # real server processes (started per module)

HOLD = "rank 0 holds this replica"
ARGS = dict(size="64x48", extra_body={"num_inference_steps": 2, "seed": 9, "response_format": "b64_json"})


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-replicas")
    fault = {"kind": "pause", "rank": 0, "step": 0, "prompt": HOLD}
    srv = start_server(
        ["tiny/qwen-image", "--data-parallel-size", "2", "--video-dir", str(root / "videos")],
        root / "server.log",
        VLLM_OMNI_TEST_FAULT=json.dumps(fault),
    )
    yield srv
    srv.close()


def hold_a_replica(client: OpenAI, server) -> tuple[threading.Thread, dict, str]:
    """A HOLD request in a thread, once it runs: the thread, where its error will be, its replica."""
    held: dict = {}

    def hold() -> None:
        try:
            client.images.generate(model="tiny/qwen-image", prompt=HOLD, **ARGS)
        except Exception as exc:  # noqa: BLE001 - the test reads it
            held["error"] = exc

    start = server.log_size()
    thread = threading.Thread(target=hold)
    thread.start()
    return thread, held, server.wait_for_log(r"Request img-\w+ running on replica (\d)", start).group(1)


def test_health_reports_each_replica(server):
    body = httpx.get(f"{server.url}/health", timeout=30).json()
    assert body["status"] == "ok" and [r["status"] for r in body["replicas"]] == ["ok", "ok"]


def test_killing_a_replicas_worker_fails_only_its_request_and_the_replica_comes_back(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
    thread, held, replica = hold_a_replica(client, server)
    # The held request's rank 0 (worker processes are named omni-worker-r<replica>-<rank>).
    pid = int(re.search(rf"omni-worker-r{replica}-0 .*?Worker rank 0 loaded .*?pid (\d+)", server.log()).group(1))
    os.kill(pid, signal.SIGKILL)
    thread.join(timeout=HTTP_TIMEOUT_S)
    assert isinstance(held.get("error"), InternalServerError), held
    assert "worker died" in str(held["error"])
    # The other replica serves meanwhile, and the dead one loads again alone.
    response = client.images.generate(model="tiny/qwen-image", prompt="a red fox", **ARGS)
    assert response.data[0].b64_json
    deadline = time.monotonic() + HTTP_TIMEOUT_S
    while True:
        body = httpx.get(f"{server.url}/health", timeout=30).json()
        states = [(r["status"], r.get("restarts", 0)) for r in body["replicas"]]
        if states[int(replica)] == ("ok", 1):
            break
        assert time.monotonic() < deadline, body
        time.sleep(0.1)  # polling a condition: the respawned group loads in the background
    assert body["status"] == "ok" and states[1 - int(replica)] == ("ok", 0)


def test_a_busy_replica_leaves_the_other_serving_and_results_equal_one_replicas(server):
    client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
    start = server.log_size()
    thread, held, _ = hold_a_replica(client, server)
    response = client.images.generate(model="tiny/qwen-image", prompt="a red fox", **ARGS)
    image = np.asarray(decode_image(response.data[0].b64_json).convert("RGB"), dtype=np.int16)
    replicas = set(re.findall(r"Request img-\w+ running on replica (\d)", server.log(start)))
    assert replicas == {"0", "1"}, server.log()[-2000:]
    assert thread.is_alive() and "error" not in held  # still held on its replica while the other served

    from vllm_omni import Omni

    with Omni("tiny/qwen-image") as omni:
        alone = omni.generate("a red fox", height=48, width=64, num_inference_steps=2, seed=9, output_type="uint8")[0]
    assert np.abs(image - alone.astype(np.int16)).max() <= 1  # PNG of the same uint8 pixels; 1: rounding

    server.close()  # cancels the held request
    thread.join(timeout=60)
    assert not thread.is_alive() and "error" in held
