"""RayExecutor on two simulated nodes: the multiprocessing executor's images, and a dead actor's restart.

One Ray cluster for the module: ray.cluster_utils.Cluster runs two raylets on this machine (two
nodes sharing one IP), one CPU each, so every two-rank world puts one rank on each node, as a
multi-node deploy would. tiny/qwen-image at 208x272 (221 image tokens, padded at Ulysses 2),
2 steps, fp32, one CPU thread per rank: the Ray executor's result equals the multiprocessing
executor's bit for bit, at Ulysses 2 (trim) and under CFG parallel.
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest

ray = pytest.importorskip("ray")

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from ray.cluster_utils import Cluster  # noqa: E402

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.executor.ray import forwarded_env, rank_order  # noqa: E402

pytestmark = pytest.mark.slow  # Ray clusters and whole engines on them

MODEL = "tiny/qwen-image"
HEIGHT, WIDTH = 208, 272  # 13x17 = 221 image tokens: padded by one at Ulysses 2
PROMPT = "a cat holding a sign that says hello world"
CFG = {"negative_prompt": "blurry, low quality", "true_cfg_scale": 4.0}
OBJECT_STORE_BYTES = 100 * 1024 * 1024  # Ray's minimum; keeps the store in a small /dev/shm
LAYOUTS = {
    "trim": dict(ulysses_degree=2),
    "cfg": dict(cfg_parallel_size=2),
}


@pytest.fixture(scope="module")
def two_nodes():
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": OBJECT_STORE_BYTES})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=OBJECT_STORE_BYTES)
        ray.init(address=cluster.address, log_to_driver=False)
        yield cluster
    finally:
        ray.shutdown()
        cluster.shutdown()


@pytest.fixture(scope="module")
def ray_engine(two_nodes):
    """The Ray engine of a layout; one at a time (each world takes both nodes' only CPU)."""
    current: dict[str, Omni] = {}

    def get(layout: str) -> Omni:
        if layout not in current:
            for omni in current.values():
                omni.close()
            current.clear()
            current[layout] = Omni(MODEL, distributed_executor_backend="ray", **LAYOUTS[layout])
        return current[layout]

    yield get
    for omni in current.values():
        omni.close()


def _generate(omni: Omni, **kwargs) -> np.ndarray:
    args = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=7, output_type="np")
    return np.stack(omni.generate(PROMPT, **args, **kwargs))


def _process_alive(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while _process_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.02)
    return not _process_alive(pid)


# The padding mode is the workers' business, the same under either executor (test_omni.py covers
# mask); trim last: the next test goes on with its engine.
@pytest.mark.parametrize("layout", ["cfg", "trim"])
def test_ray_equals_multiprocessing_with_one_rank_per_node(ray_engine, layout):
    kwargs = CFG if layout == "cfg" else {}
    with Omni(MODEL, **LAYOUTS[layout]) as omni:
        expected = _generate(omni, **kwargs)
    omni = ray_engine(layout)
    placements = omni.engine.executor.placements
    assert sorted(placements) == [0, 1]
    assert len({p.node_id for p in placements.values()}) == 2  # one rank on each simulated node
    assert {p.bundle_index for p in placements.values()} == {0, 1}
    actual = _generate(omni, **kwargs)
    assert actual.shape == (1, HEIGHT, WIDTH, 3) and actual.flags.writeable
    np.testing.assert_array_equal(actual, expected)


def test_a_dead_actor_is_seen_at_once_while_idle_the_group_restarts_and_shutdown_frees_the_cluster(ray_engine):
    omni = ray_engine("trim")
    executor = omni.engine.executor
    old = dict(executor.placements)
    os.kill(old[1].pid, signal.SIGKILL)  # a crash, not a polite ray.kill
    killed = time.monotonic()
    while executor.status().state == "ok" and time.monotonic() - killed < 30:  # a hang guard
        time.sleep(0.01)
    assert time.monotonic() - killed < 5  # seen while idle, without a request to notice it
    status = executor.status()
    assert status.state == "unhealthy" and "worker rank 1 died" in status.detail, status

    omni.engine.check_workers()  # what the server's watchdog calls: the whole group goes, a new one loads
    assert executor.status().state == "restarting" and executor.restarts == 1
    # The survivor is killed too (under NCCL it would hang); Ray kills asynchronously: 30 s is a hang guard, as below
    assert _gone_within(old[0].pid, 30)
    # (The server test runs a request on a restarted group.) Shutdown while it loads leaves nothing:
    omni.close()
    assert executor.status().state == "shutting_down"
    deadline = time.monotonic() + 30  # a hang guard: the cluster learns of freed bundles asynchronously
    while ray.available_resources().get("CPU", 0) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ray.available_resources().get("CPU", 0) == 2  # no actor, no placement group holds a CPU


def test_ranks_of_a_node_are_consecutive_and_named_by_node_id_not_ip():
    # Bundles 0 and 2 on node "b", 1 and 3 on node "a": b's ranks first (it holds bundle 0).
    assert rank_order({0: "b", 1: "a", 2: "b", 3: "a"}, 4) == [0, 2, 1, 3]
    assert rank_order({0: "a", 1: "a"}, 2) == [0, 1]


def test_only_vllm_omni_settings_travel_to_the_actors(monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_TEST_FAULT", "[]")
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    monkeypatch.setenv("VLLM_API_KEY", "secret")
    env = forwarded_env()
    assert env["VLLM_OMNI_TEST_FAULT"] == "[]" and env["VLLM_LOGGING_LEVEL"] == "DEBUG"
    assert "VLLM_API_KEY" not in env and "PATH" not in env
