"""Worker lifetime and deadlines under a real `vllm-omni serve tiny/qwen-image --ulysses-degree 2`.

SIGKILL of the server leaves none of its children (workers, multiprocessing's helpers) alive, whether the workers
were spawned or forked by a forkserver (VLLM_WORKER_MULTIPROC_METHOD). A
rank that fails while its peer waits in a collective costs one request (500) and a restart that
/health reports; an out-of-memory error costs one request (507, naming its size): the group serves
on where both ranks raised it at one agreed point (the prompt encoding's broadcast), and restarts
where one rank raised it alone (a step). SIGTERM while a rank hangs exits 0 without respawning the
workers. The faults
come from the worker's VLLM_OMNI_TEST_FAULT hook, keyed by prompt, so other requests run
normally; VLLM_OMNI_STALL_TIMEOUT_S shortens the deadline.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time

import httpx
import openai
import pytest
from process_tree import children_of, still_alive_after
from server_process import HTTP_TIMEOUT_S, START_TIMEOUT_S, ServerProcess, omni_command, server_env, start_server

pytestmark = pytest.mark.slow  # real server processes (started per module)

MODEL = "tiny/qwen-image"
RAISE_PROMPT = "rank 1 raises at step 1"
HANG_PROMPT = "rank 1 hangs at step 1"
TEXT_OOM_PROMPT = "rank 0 runs out of memory encoding this prompt"
STEP_OOM_PROMPT = "rank 1 runs out of memory at step 1"
STALL_S = 4
SLACK_S = 15.0  # a loaded 2-core CI machine; the point is "at the deadline", not "never"


def generate(server, prompt: str) -> httpx.Response:
    body = {"model": MODEL, "prompt": prompt, "size": "32x32", "num_inference_steps": 4, "seed": 1}
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=HTTP_TIMEOUT_S)


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_sigkill_of_the_server_leaves_no_worker_alive(tmp_path, method):
    server = start_server(
        [MODEL, "--ulysses-degree", "2"], tmp_path / "server.log", VLLM_WORKER_MULTIPROC_METHOD=method
    )
    try:
        children = children_of(server.proc.pid)
        grandchildren = [pid for child in children for pid in children_of(child)]
        if method == "spawn":
            assert len(server.worker_pids()) == 2 and set(server.worker_pids()) <= set(children)
        else:  # the workers are the forkserver's children; the signal follows it, and it ends with the server
            assert len(grandchildren) == 2, grandchildren
        os.kill(server.proc.pid, signal.SIGKILL)
        server.proc.wait(timeout=30)
        assert still_alive_after(children + grandchildren, 5) == []
    finally:
        server.kill()  # its process group: whatever a failure above left behind
        server.close()


def test_health_is_503_warming_up_until_requests_are_taken_and_never_200_before(tmp_path):
    """The warm-up forced on the CPU (on GPUs it is the default): every /health 200 is followed by
    a request that is taken, and the warm-up itself answers 503 "warming_up"."""
    server = ServerProcess(omni_command("serve", MODEL, "--warmup"), tmp_path / "server.log", server_env())
    try:
        states: list[str] = []
        deadline = time.monotonic() + START_TIMEOUT_S  # a hang guard
        while time.monotonic() < deadline:
            health = server.first_health()
            states.append(health.json()["status"])
            if health.status_code == 200:
                response = generate(server, "a cat")
                assert response.status_code == 200, (states, response.text)
                break
            assert health.status_code == 503 and states[-1] in ("loading", "warming_up"), health.text
        assert states[-1] == "ok" and "warming_up" in states, states
        assert states.index("warming_up") > 0 and "loading" not in states[states.index("warming_up") :], states
        server.wait_for_log(r"Warm-up done in")
    finally:
        server.close()


@pytest.fixture(scope="module")
def faulty_server(tmp_path_factory):
    faults = [
        {"kind": "raise", "rank": 1, "step": 1, "prompt": RAISE_PROMPT},
        {"kind": "hang", "rank": 1, "step": 1, "prompt": HANG_PROMPT},
        {"kind": "oom", "rank": 0, "step": 0, "phase": "text", "prompt": TEXT_OOM_PROMPT},
        {"kind": "oom", "rank": 1, "step": 1, "prompt": STEP_OOM_PROMPT},
    ]
    server = start_server(
        [MODEL, "--ulysses-degree", "2", "--device", "cpu"],  # the 4 s deadline is sized for CPU steps
        tmp_path_factory.mktemp("serve-lifetime") / "server.log",
        VLLM_OMNI_TEST_FAULT=json.dumps(faults),
        VLLM_OMNI_STALL_TIMEOUT_S=str(STALL_S),
    )
    yield server
    server.close()


def test_a_rank_failing_while_its_peer_waits_costs_one_request_and_a_restart_health_reports(faulty_server):
    server = faulty_server
    start = server.log_size()
    workers = server.worker_pids()
    begun = time.monotonic()
    response = generate(server, RAISE_PROMPT)
    assert time.monotonic() - begun < STALL_S + SLACK_S
    assert response.status_code == 500, response.text
    message = response.json()["error"]["message"]
    assert "RuntimeError: test fault on rank 1 at step 1" in message and "rank(s) [0] did not finish" in message

    health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["status"] == "restarting", health.text
    assert "test fault on rank 1" in health.json()["detail"]
    deadline = time.monotonic() + HTTP_TIMEOUT_S  # a hang guard: the new group loads, the watchdog sees it
    while health.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        health = httpx.get(f"{server.url}/health", timeout=30)
    body = health.json()
    assert (health.status_code, body["status"], body["restarts"]) == (200, "ok", 1), body
    assert "test fault on rank 1" in body["last_restart_reason"]
    server.wait_for_log(r"Restarting workers: request img-\w+ failed \(RuntimeError: test fault", start)
    assert set(server.worker_pids()).isdisjoint(workers)
    assert generate(server, "a cat").status_code == 200


def _out_of_memory(server, prompt: str) -> str:
    """The 507's message for a request of `prompt` at 48x32, n=2 (the openai client, no retries)."""
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=HTTP_TIMEOUT_S)
    with pytest.raises(openai.APIStatusError) as failure:
        client.images.generate(model=MODEL, prompt=prompt, size="48x32", n=2, extra_body={"num_inference_steps": 4})
    assert failure.value.status_code == 507, failure.value.response.text
    error = failure.value.response.json()["error"]
    assert error["code"] == "out_of_memory" and "(48x32, n=2)" in error["message"], error
    assert (
        "CUDA out of memory. Tried to allocate 20.00 GiB" in error["message"] and "a smaller size" in error["message"]
    )
    return error["message"]


def _health(server) -> dict:
    deadline = time.monotonic() + HTTP_TIMEOUT_S  # a hang guard: a new group loads, the watchdog sees it
    health = httpx.get(f"{server.url}/health", timeout=30)
    while health.status_code != 200 and time.monotonic() < deadline:
        time.sleep(0.1)
        health = httpx.get(f"{server.url}/health", timeout=30)
    assert health.status_code == 200, health.text
    return health.json()


def test_out_of_memory_at_an_agreed_point_fails_the_request_alone_and_restarts_nothing(faulty_server):
    server = faulty_server
    restarts = _health(server).get("restarts", 0)
    workers = server.worker_pids()
    message = _out_of_memory(server, TEXT_OOM_PROMPT)
    assert "ran out of memory on rank 0 while encoding the prompt" in message and "serves on" in message, message
    assert generate(server, "a cat").status_code == 200
    assert server.worker_pids() == workers and _health(server).get("restarts", 0) == restarts


def test_out_of_memory_on_one_rank_mid_request_fails_it_and_restarts_the_group(faulty_server):
    server = faulty_server
    restarts = _health(server).get("restarts", 0)
    workers = server.worker_pids()
    begun = time.monotonic()
    message = _out_of_memory(server, STEP_OOM_PROMPT)
    assert time.monotonic() - begun < STALL_S + SLACK_S  # at once, not after the stuck-rank wait
    assert "ran out of memory on rank 1 while denoising" in message and "workers are restarting" in message, message
    body = _health(server)
    assert body["restarts"] == restarts + 1 and "ran out of memory on rank 1" in body["last_restart_reason"]
    assert set(server.worker_pids()).isdisjoint(workers)
    assert generate(server, "a cat").status_code == 200


def test_sigterm_while_a_rank_hangs_exits_0_without_respawning_the_workers(faulty_server):
    # Stops the module's server: keep it last.
    server = faulty_server
    start = server.log_size()
    children = children_of(server.proc.pid)
    outcome: dict[str, httpx.Response] = {}
    thread = threading.Thread(target=lambda: outcome.setdefault("response", generate(server, HANG_PROMPT)))
    thread.start()
    server.wait_for_log(r"Test fault: rank 1 hangs at step 1", start)
    begun = time.monotonic()
    assert server.terminate() == 0
    assert time.monotonic() - begun < STALL_S + SLACK_S  # the stall deadline ended the request, nothing waited more
    thread.join(timeout=HTTP_TIMEOUT_S)
    assert outcome["response"].status_code == 503, outcome["response"].text
    log = server.log(start)
    assert "Not restarting the workers (shutting down): request" in log
    assert "Restarting workers" not in log
    assert still_alive_after(children, 5) == []  # multiprocessing's tracker leaves just after the server
