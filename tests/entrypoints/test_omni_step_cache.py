"""The step cache (First-Block-Cache, diffusion/worker/step_cache.py) under SP, CFG parallel and graphs, on CPU ranks.

Tiny Qwen-Image with true CFG at 208x272 (221 image tokens: padded at Ulysses 2 and 3), 8 steps, fp32. The
threshold sits between the first block's relative changes of the steps it skips (about 0.51 and 0.52) and
of those it computes (0.56 and up), far from each: U1 skips steps 3 and 5 of both branches. Every layout must
skip exactly those and give U1's image. CFG parallel runs with the simulated CUDA graphs, so the probe and
the graph's replay (CachedForward) run too.
"""

from __future__ import annotations

import json
import os
import threading

import numpy as np
import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.request import GenerationParams, RequestCancelled, RequestError, RequestFailed  # noqa: E402

MODEL = "tiny/qwen-image"
THRESHOLD = 0.55
STEPS = 8
SKIPPED = {"cond": [3, 5], "uncond": [3, 5]}
PAUSE_PROMPT, HANG_PROMPT = "rank 0 pauses at a skipped step", "rank 1 hangs at a skipped step"
STALL_S = 4.0


def _generate(omni: Omni, prompt: str = "a cat holding a sign", **fields) -> tuple[np.ndarray, dict | None]:
    images = omni.generate(
        prompt,
        negative_prompt="blurry",
        height=208,
        width=272,
        num_inference_steps=STEPS,
        seed=7,
        true_cfg_scale=4.0,
        output_type="np",
        **fields,
    )
    return np.stack(images), omni.last_output.step_cache


def same_decisions(report: dict, expected: dict) -> bool:
    """The same steps computed and skipped; the median change as measured in another layout (float sums)."""
    strip = {k: v for k, v in report.items() if k != "median_change"}
    return strip == {k: v for k, v in expected.items() if k != "median_change"} and report[
        "median_change"
    ] == pytest.approx(expected["median_change"], rel=1e-5)


@pytest.fixture(scope="module")
def reference_run():
    """U1's cached result, and its uncached image (the same engine at a threshold below every change)."""
    with Omni(MODEL, cache="first_block", cache_threshold=THRESHOLD) as omni:
        first = _generate(omni)
        assert omni.last_output.cfg_one_pass_steps == 0  # the cache decides each branch apart: two forwards
        # A request's own threshold: above every change but the first steps' (inf), it skips all it can.
        higher = _generate(omni, cache_threshold=10.0)[1]
        with pytest.raises(RequestError, match="cache_threshold must be a number > 0") as refused:
            _generate(omni, cache_threshold=0)
        assert refused.value.param == "cache_threshold"
        again = _generate(omni)
        # Below every change: every step computes, which is the uncached pipeline.
        uncached, lowest = _generate(omni, cache_threshold=1e-9)
    assert same_decisions(again[1], first[1])  # the next request has the server's threshold and empty caches again
    np.testing.assert_array_equal(again[0], first[0])
    assert higher["threshold"] == 10.0 and higher["forwards_skipped"] == 2 * (STEPS - 1), higher
    assert lowest["forwards_skipped"] == 0
    return first, uncached


@pytest.fixture(scope="module")
def reference(reference_run):
    return reference_run[0]


def test_one_process_skips_some_steps_and_reports_them(reference_run):
    (image, report), uncached = reference_run
    assert report == {
        "policy": "first_block",
        "threshold": THRESHOLD,
        "forwards_computed": 2 * STEPS - 4,
        "forwards_skipped": 4,
        "skipped_steps": SKIPPED,
        "median_change": report["median_change"],
    }
    assert 0.5 < report["median_change"] < 0.7  # the changes the threshold was chosen from (module doc)
    assert 0 < np.abs(image - uncached).max() < 0.05  # the skipped steps reused residuals: close, not equal


def test_ulysses_3_skips_the_steps_one_process_skips_and_gives_its_image(reference):
    with Omni(MODEL, ulysses_degree=3, cache="first_block", cache_threshold=THRESHOLD) as omni:
        image, report = _generate(omni)
    assert same_decisions(report, reference[1])
    np.testing.assert_allclose(image, reference[0], rtol=0, atol=1e-5)


def test_cfg_parallel_with_graphs_skips_the_same_steps_and_gives_the_same_image(reference, monkeypatch, capfd):
    """CFG parallel x Ulysses 2, simulated graphs: each group decides its own branch (group 1's "cond" context
    runs the negative prompt), every computed forward replays a graph, a skipped one replays none."""
    monkeypatch.setenv("VLLM_OMNI_TEST_CUDA_GRAPHS", "simulate")
    with Omni(MODEL, ulysses_degree=2, cfg_parallel_size=2, cache="first_block", cache_threshold=THRESHOLD) as omni:
        image, report = _generate(omni)
        failures = omni.engine.graph_capture_failures
        assert omni.last_output.cfg_one_pass_steps == 0  # CFG parallel splits the branches over the groups
    assert same_decisions(report, reference[1])
    np.testing.assert_allclose(image, reference[0], rtol=0, atol=1e-5)
    err = capfd.readouterr().err
    assert failures == 0 and "eagerly" not in err and "simulated CUDA graph capture" in err


@pytest.fixture(scope="module")
def faulty():
    """Ulysses 2 with the cache: rank 0 pauses (until cancelled) at step 3, a skipped step, for PAUSE_PROMPT;
    rank 1 hangs there for HANG_PROMPT."""
    faults = [
        {"kind": "pause", "rank": 0, "step": 3, "prompt": PAUSE_PROMPT},
        {"kind": "hang", "rank": 1, "step": 3, "prompt": HANG_PROMPT},
    ]
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_OMNI_TEST_FAULT", json.dumps(faults))  # inherited by every worker, restarted ones too
        with Omni(
            MODEL, ulysses_degree=2, cache="first_block", cache_threshold=THRESHOLD, stall_timeout_s=STALL_S
        ) as omni:
            yield omni


def test_ulysses_2_skips_the_same_steps(faulty, reference):
    image, report = _generate(faulty)
    assert same_decisions(report, reference[1])
    np.testing.assert_allclose(image, reference[0], rtol=0, atol=1e-5)


def _params(prompt: str) -> GenerationParams:
    return GenerationParams(
        prompt, negative_prompt="blurry", height=208, width=272, num_inference_steps=STEPS, seed=7, output_type="np"
    )


def test_a_cancel_at_a_skipped_step_stops_the_group(faulty, reference):
    engine = faulty.engine
    request = engine.preprocess(_params(PAUSE_PROMPT))
    reached = threading.Event()
    outcome: dict = {}

    def run() -> None:
        try:
            engine.step(request, on_progress=lambda done, total, *phase: done >= 3 and reached.set())
        except BaseException as exc:  # noqa: BLE001 - the test reads it
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    assert reached.wait(120), "the request never reached step 3"
    engine.cancel(request.request_id)
    thread.join(120)
    assert isinstance(outcome.get("error"), RequestCancelled) and "at step 4" in str(outcome["error"])
    assert engine.restarts == 0
    assert same_decisions(_generate(faulty)[1], reference[1])  # the next request starts with empty caches


def test_a_rank_hung_at_a_skipped_step_fails_at_the_stall_deadline_and_the_restarted_group_caches_alike(
    faulty, reference
):
    engine = faulty.engine
    with pytest.raises(RequestFailed, match=r"made no progress for 4 s \(stall_timeout_s\)"):
        engine.step(engine.preprocess(_params(HANG_PROMPT)))
    image, report = _generate(faulty)  # waits for the restarted group
    assert engine.restarts == 1 and same_decisions(report, reference[1])
    np.testing.assert_allclose(image, reference[0], rtol=0, atol=1e-5)


def test_wan22s_two_experts_cache_apart_and_ulysses_2_skips_what_one_process_skips():
    """Tiny Wan2.2 A14B (the expert changes at step 2: its cache starts empty there), 6 steps, CFG, 208x272.
    U1's changes: steps 1 and 3 about 0.097 and 0.123 (skipped), 4 and 5 about 0.136 and 0.141 (computed)."""
    results = []
    for degree in (1, 2):
        with Omni("tiny/wan2.2-t2v", ulysses_degree=degree, cache="first_block", cache_threshold=0.13) as omni:
            video = omni.generate(
                "a cat holding a sign", negative_prompt="blurry", num_frames=5, num_inference_steps=6, seed=7,
                height=208, width=272, output_type="np",
            )  # fmt: skip
            results.append((np.stack(video), omni.last_output.step_cache))
    (one, report), (two, report_2) = results
    assert report["skipped_steps"] == {"cond": [1, 3], "uncond": [1, 3]}, report
    assert same_decisions(report_2, report)
    np.testing.assert_allclose(two, one, rtol=0, atol=1e-5)


def test_flux2_is_refused_at_start_with_the_reason():
    with pytest.raises(ValueError, match="cache=first_block: Flux2Pipeline joins text and image"):
        Omni("tiny/flux2", cache="first_block")
