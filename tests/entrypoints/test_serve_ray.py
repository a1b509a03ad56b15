"""`vllm-omni serve --distributed-executor-backend ray` end to end, on the docs' multi-node recipe.

docs/multinode.md followed on one machine: `ray start --head` and `ray start --address` make two
Ray nodes (one CPU each, so Ulysses 2 puts one rank on each), every node with the same token
(RAY_AUTH_MODE=token, RAY_AUTH_TOKEN), and the server joins them with `--ray-address`. It serves
a padded size (debug log lines come back from both actors), cancels a request whose client
disconnects at the next step, answers 500 for the request in flight when an actor is killed and
200 for the next; SIGKILLed, it leaves no actor alive (Ray ends a dead driver's actors). A
second server, on a private Ray instance (no address: the default), serves, and on SIGTERM exits 0
leaving none of its Ray processes behind.
"""

from __future__ import annotations

import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
from process_tree import children_of, still_alive_after
from server_process import (
    HTTP_TIMEOUT_S,
    ServerProcess,
    decode_image,
    free_port,
    omni_command,
    open_request,
    server_env,
    start_server,
)

pytestmark = pytest.mark.slow  # real server processes (started per module)

pytest.importorskip("ray")

MODEL = "tiny/qwen-image"
SIZE = "272x208"  # 17x13 = 221 tokens, padded to 222 at Ulysses 2
LONG_STEPS = 4000  # such a request only ends by being cancelled or failing
RAY_START_TIMEOUT_S = 120.0
# One CPU per node (Ulysses 2 puts a rank on each), on the loopback address (test traffic stays here).
NODE_FLAGS = ["--num-cpus=1", "--disable-usage-stats", "--node-ip-address=127.0.0.1"]
RANK_LINE = r"Rank (\d): Ray actor on node (\w+) \(([\d.:a-f]+)\), bundle (\d), pid (\d+)"


def ray_command(*args: str) -> list[str]:
    """The `ray` script of this Python (the docs' `ray start ...`)."""
    script = Path(sys.executable).with_name("ray")
    return [str(script) if script.exists() else "ray", *args]


class RayNode:
    """`ray start ... --block`: the node lives as long as this process, and SIGTERM stops all of it."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str]) -> None:
        self.log_path = log_path
        with open(log_path, "wb") as log:
            self.proc = subprocess.Popen(
                ray_command("start", *args, "--block"), stdout=log, stderr=subprocess.STDOUT, env=env
            )

    def wait_started(self) -> None:
        deadline = time.monotonic() + RAY_START_TIMEOUT_S
        while "Ray runtime started" not in self.log_path.read_text(errors="replace"):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"ray start failed:\n{self.log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.1)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The docs' recipe: a head, a second node (the same token on both), and the server joining them."""
    folder = tmp_path_factory.mktemp("serve-ray")
    env = server_env(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32), RAY_USAGE_STATS_ENABLED="0")
    address = f"127.0.0.1:{free_port()}"
    nodes = [RayNode(["--head", f"--port={address.rsplit(':', 1)[1]}", *NODE_FLAGS], folder / "head.log", env)]
    srv = None
    try:
        nodes[0].wait_started()
        nodes.append(RayNode([f"--address={address}", *NODE_FLAGS], folder / "node.log", env))
        # The server starts while the second node joins: it waits for the node's CPU if it is early.
        args = ["--ulysses-degree", "2", "--max-steps", str(LONG_STEPS)]
        command = omni_command("serve", MODEL, *args, "--distributed-executor-backend", "ray", "--ray-address", address)
        srv = ServerProcess(command, folder / "server.log", {**env, "VLLM_LOGGING_LEVEL": "DEBUG"})
        nodes[1].wait_started()
        srv.wait_ready()
        yield srv
    finally:
        if srv is not None:
            srv.close()
        for node in reversed(nodes):
            node.stop()


def ranks(server: ServerProcess, start: int = 0) -> dict[int, tuple[str, int]]:
    """Rank -> (node id, pid) of the latest group the server's log announces after `start`."""
    found = {}
    for rank, node, _ip, _bundle, pid in re.findall(RANK_LINE, server.log(start)):
        found[int(rank)] = (node, int(pid))
    return found


def generate(server: ServerProcess, **fields) -> httpx.Response:
    body = {"model": MODEL, "prompt": "a cat", "size": SIZE, "num_inference_steps": 2, "seed": 1, **fields}
    return httpx.post(f"{server.url}/v1/images/generations", json=body, timeout=HTTP_TIMEOUT_S)


def _start_long_request(server: ServerProcess, start: int) -> tuple[str, int]:
    """A request that runs until stopped; returns its id and the log offset once it is denoising."""
    request_id = server.wait_for_log(rf"Request (img-\w+) queued: size={SIZE}, steps={LONG_STEPS}", start).group(1)
    running = server.wait_past(rf"Request {request_id} running", start)
    # Debug lines from the actors: the ranks are inside the denoising loop.
    return request_id, server.wait_past(r"\[omni-ray-rank-\d .*Auto-padded sequence from", running)


def test_serves_a_padded_size_with_one_rank_on_each_node(server):
    start = server.log_size()
    response = generate(server, seed=7)
    assert response.status_code == 200, response.text
    assert decode_image(response.json()["data"][0]["b64_json"]).size == (272, 208)
    placed = ranks(server)
    assert sorted(placed) == [0, 1] and placed[0][0] != placed[1][0]  # two node ids
    # The actors' own log records reach the server's log (their VLLM_LOGGING_LEVEL travelled to them).
    server.wait_for_log(
        r"\[omni-ray-rank-\d .*Auto-padded sequence from 221 to 222 \(pad_size=1, world_size=2, dim=1\)", start
    )
    server.wait_for_log(r"Request img-\w+ done: size=272x208, steps=2, seed=7, n=1", start)


def test_client_disconnect_cancels_the_running_request_at_the_next_step(server):
    start = server.log_size()
    body = {"prompt": "a cat", "size": SIZE, "num_inference_steps": LONG_STEPS, "seed": 3}
    sock = open_request(server.url, "/v1/images/generations", body)
    request_id, _ = _start_long_request(server, start)
    sock.close()  # the client goes away
    server.wait_for_log(rf"Request {request_id}: client disconnected, cancelling", start)
    step = int(server.wait_for_log(rf"request {request_id} cancelled at step (\d+)", start).group(1))
    assert step < LONG_STEPS
    assert generate(server, size="32x32").status_code == 200


def test_a_killed_actor_fails_the_request_in_flight_and_the_next_request_succeeds(server):
    start = server.log_size()
    before = ranks(server)
    outcome: dict[str, httpx.Response] = {}
    thread = threading.Thread(
        target=lambda: outcome.setdefault("response", generate(server, num_inference_steps=LONG_STEPS))
    )
    thread.start()
    _, denoising = _start_long_request(server, start)
    os.kill(before[1][1], signal.SIGKILL)
    thread.join(timeout=HTTP_TIMEOUT_S)
    response = outcome["response"]
    assert response.status_code == 500, response.text
    assert "worker died" in response.json()["error"]["message"]
    server.wait_for_log(r"Restarting workers: worker rank 1 died", denoising)
    assert still_alive_after([pid for _, pid in before.values()], 10) == []  # the survivor is killed too
    assert generate(server, size="32x32").status_code == 200
    after = ranks(server, denoising)
    assert sorted(after) == [0, 1] and {pid for _, pid in after.values()}.isdisjoint(pid for _, pid in before.values())


def test_sigkill_of_the_server_leaves_no_actor_on_the_cluster(server):
    # Kills the module's server: keep it last of its tests. Ray ends the actors of a job whose driver is gone.
    actors = [pid for _, pid in ranks(server).values()]
    os.kill(server.proc.pid, signal.SIGKILL)
    server.proc.wait(timeout=30)
    assert still_alive_after(actors, 10) == []


def test_a_server_on_a_private_ray_instance_serves_and_sigterm_leaves_nothing_behind(tmp_path):
    args = [MODEL, "--ulysses-degree", "2", "--distributed-executor-backend", "ray"]
    server = start_server(args, tmp_path / "server.log")
    try:
        server.wait_for_log(r"Ray started \(a private instance on this machine\)")
        placed = ranks(server)
        assert sorted(placed) == [0, 1] and placed[0][0] == placed[1][0]  # one node: both ranks on it
        assert generate(server, size="32x32").status_code == 200
        # Ray's processes (GCS, raylet, agents) are the server's children; the actors their children.
        ray_processes = [pid for child in children_of(server.proc.pid) for pid in [child, *children_of(child)]]
        assert set(pid for _, pid in placed.values()) <= set(ray_processes)
        assert server.terminate() == 0
        assert still_alive_after(ray_processes, 15) == []
    finally:
        server.kill()  # its process group: whatever a failure above left behind
        server.close()
