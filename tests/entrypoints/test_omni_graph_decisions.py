"""CUDA graph decisions under CFG parallel and across restarts, on CPU ranks (simulated graphs).

The workers run with VLLM_OMNI_TEST_CUDA_GRAPHS=simulate: the real graph cache, keys and
agreement (cuda_graphs.py) with a stand-in graph that re-runs the forward on its static inputs.
Under CFG parallel the two groups run different prompts (group 1 has the negative prompt as its
prompt), so their graph caches miss at different requests. When the capture decision was taken
over the whole world, one group's capture agreement met the other's per-step cancel check in
the same gloo collective: graphs went off on one side, a phantom cancel on the other, and the
collectives stayed out of step. Agreed within each SP group, nothing meets.
"""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

HEIGHT, WIDTH = 208, 272  # 13x17 = 221 image tokens: padded at Ulysses 2
SHORT, LONG = "a cat", "a cat holding a sign that says hello world, in a sunny garden"
# (prompt, negative prompt): group 0 misses at requests 1 and 2, group 1 at requests 1 and 3.
REQUESTS = [(SHORT, " "), (LONG, " "), (SHORT, "blurry, low quality")]
CAPTURE = re.compile(r"Rank (\d+): simulated CUDA graph capture (\d+)")


@pytest.fixture(scope="module")
def simulated_graphs():
    previous = os.environ.get("VLLM_OMNI_TEST_CUDA_GRAPHS")
    os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"] = "simulate"  # inherited by the workers when they spawn
    yield
    if previous is None:
        del os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"]
    else:
        os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"] = previous


def _generate_all(omni: Omni) -> list[np.ndarray]:
    args = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=7, output_type="np", true_cfg_scale=4.0)
    return [np.stack(omni.generate(prompt, negative_prompt=negative, **args)) for prompt, negative in REQUESTS]


def _short(omni: Omni) -> np.ndarray:
    return omni.generate(SHORT, height=32, width=32, num_inference_steps=2, seed=3, output_type="np")[0]


@pytest.fixture(scope="module")
def eager_results(simulated_graphs):
    """One group with no graphs (what the graph environment says does not matter to it): the REQUESTS'
    images, then the short request's."""
    with Omni("tiny/qwen-image", enforce_eager=True) as omni:
        return _generate_all(omni), _short(omni)


@pytest.fixture(scope="module")
def reference(eager_results):
    return eager_results[0]


@pytest.mark.parametrize("degree", [1, 2])
def test_cfg_groups_missing_their_graphs_at_different_requests_agree_and_match_one_group(
    simulated_graphs, reference, degree, capfd
):
    with Omni("tiny/qwen-image", ulysses_degree=degree, cfg_parallel_size=2, stall_timeout_s=120) as omni:
        outputs = _generate_all(omni)
        failures = omni.engine.graph_capture_failures
        reported = omni.engine.rank_counts("graph_captures")  # what /metrics exports, from each rank's report
    err = capfd.readouterr().err
    for actual, expected in zip(outputs, reference):
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    assert failures == 0 and "eagerly" not in err and "cancelled" not in err
    captures: dict[int, int] = {}
    for rank, _ in CAPTURE.findall(err):
        captures[int(rank)] = captures.get(int(rank), 0) + 1
    # Every rank captured twice: group 0 (ranks below `degree`) for the two prompts, group 1 for the
    # two negative prompts, each at a request where the other group replayed.
    assert captures == dict.fromkeys(range(2 * degree), 2), captures
    assert reported == captures


def test_a_failed_capture_is_reported_and_retried_by_the_restarted_group_after_its_warm_up(eager_results, capfd):
    """The first capture on rank 1 of each group fails (simulate:fail-rank=1): counted, that SP group
    runs eagerly (still exact), and the group a restart brings up warms up and captures again."""
    expected = eager_results[1]
    previous = os.environ.get("VLLM_OMNI_TEST_CUDA_GRAPHS")
    os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"] = "simulate:fail-rank=1"
    try:
        with Omni("tiny/qwen-image", ulysses_degree=2, warmup=True, warmup_size=(32, 32), stall_timeout_s=60) as omni:
            engine = omni.engine
            assert engine.graph_capture_failures == 1 and "rank 1" in engine.last_graph_capture_failure
            assert engine.health_status()[0] == "ok"
            actual = _short(omni)
            np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
            first = capfd.readouterr().err
            engine.executor._procs[1].kill()
            engine.executor._procs[1].join()
            actual = _short(omni)
            np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
            assert engine.restarts == 1 and engine.graph_capture_failures == 2
        second = capfd.readouterr().err
    finally:
        if previous is None:
            del os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"]
        else:
            os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"] = previous
    for log in (first, second):
        # Each group warmed up once, rank 0 captured (its first capture), rank 1's failed and both went eager.
        assert log.count("Warm-up done in") == 1, log[-3000:]
        assert [rank for rank, number in CAPTURE.findall(log) if number == "1"] == ["0"]
        assert "simulated capture failure on rank 1" in log
        assert "its ranks run the transformer eagerly until the worker group restarts" in log
