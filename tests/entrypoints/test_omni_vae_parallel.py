"""The VAE decode split over the ranks, through the offline engine (CPU workers, gloo).

With `vae_parallel=True` the decode is tiled (one rank too), and with several ranks its tiles are
split over all of them (SP and CFG ranks): the output equals one rank's tiled decode. The tiny
VAEs tile at 256 pixels, so 272x208 (a 34 x 26 latent) is tiled. A cancel that lands during the
split decode stops the request at the next tile on every rank; a rank that fails inside the
decode fails the request and restarts the group, which then serves.
"""

from __future__ import annotations

import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.request import GenerationParams, RequestCancelled, RequestFailed  # noqa: E402
from vllm_omni.testing.memory import TEST_GPU_MEMORY_ENV  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

PROMPT = "a lighthouse on a cliff at dusk"
ARGS = dict(height=208, width=272, num_inference_steps=2, seed=4, output_type="np", negative_prompt="blurry")
PAUSE_PROMPT, RAISE_PROMPT = "rank 0 pauses in the decode", "rank 1 fails in the decode"


@pytest.fixture(scope="module")
def engines():
    """Engines by configuration, kept for the module. All start with the faults below (they fire only for
    their own prompts), so the faulty tests share the Ulysses 2 split-decode engine."""
    faults = [
        {"kind": "pause", "rank": 0, "step": 2, "phase": "decode", "prompt": PAUSE_PROMPT},
        {"kind": "raise", "rank": 1, "step": 1, "phase": "decode", "prompt": RAISE_PROMPT},
    ]
    started: dict[tuple, Omni] = {}

    def get(model: str, **kwargs) -> Omni:
        key = (model, tuple(sorted(kwargs.items())))
        if key not in started:
            started[key] = Omni(model, stall_timeout_s=60, **kwargs)
        return started[key]

    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("VLLM_OMNI_TEST_FAULT", json.dumps(faults))  # inherited by every worker, restarted ones too
        yield get
    # Each close waits for its workers to leave; together they wait once.
    with ThreadPoolExecutor(max_workers=max(len(started), 1)) as pool:
        list(pool.map(lambda omni: omni.close(), started.values()))


@pytest.mark.parametrize(
    ("model", "extra", "parallel"),
    [
        ("tiny/qwen-image", {}, dict(ulysses_degree=2)),
        ("tiny/qwen-image", {}, dict(ulysses_degree=1, cfg_parallel_size=2)),  # CFG ranks decode too
        ("tiny/wan2.2-t2v", {"num_frames": 5}, dict(ulysses_degree=3)),
    ],
)
def test_split_decode_equals_one_ranks_tiled_decode(engines, model, extra, parallel):
    args = dict(ARGS, **extra)
    tiled = np.stack(engines(model, vae_parallel=True).generate(PROMPT, **args))
    untiled = np.stack(engines(model).generate(PROMPT, **args))
    assert np.abs(tiled - untiled).max() > 1e-4  # the decode did tile (tile blending differs from one pass)
    split = np.stack(engines(model, vae_parallel=True, **parallel).generate(PROMPT, **args))
    np.testing.assert_allclose(split, tiled, rtol=0, atol=1e-5)
    # Without the flag, these small sizes stay under the default threshold: decoded whole on every rank.
    np.testing.assert_allclose(np.stack(engines(model, **parallel).generate(PROMPT, **args)), untiled, atol=1e-5)


@pytest.fixture(scope="module")
def faulty_engine(engines):
    return engines("tiny/qwen-image", vae_parallel=True, ulysses_degree=2).engine


def _params(prompt: str) -> GenerationParams:
    return GenerationParams(prompt, height=208, width=272, num_inference_steps=2, seed=0)


def test_a_cancel_during_the_split_decode_stops_every_rank_at_a_tile(faulty_engine):
    request = faulty_engine.preprocess(_params(PAUSE_PROMPT))
    done = threading.Event()

    def cancel_after_the_last_step(steps: int, total: int, phase: str) -> None:
        # The last step's cancel check has passed: from here only the decode's tile checks can see it.
        if steps == total and not done.is_set():
            done.set()
            faulty_engine.executor.cancel(request.cancel_token)

    # Seen at the first tile check after it lands; rank 0's pause at tile 3 keeps the decode from ending first.
    with pytest.raises(RequestCancelled, match=r"cancelled while decoding \(tile [123]\)"):
        faulty_engine.executor.execute(request, on_progress=cancel_after_the_last_step)
    assert faulty_engine.executor.restarts == 0  # every rank stopped at the same tile: nothing to restart
    images = faulty_engine.step(_params("a calm sea")).images
    assert len(images) == 1


def test_a_rank_failing_in_the_decode_restarts_the_group_which_then_serves(faulty_engine):
    restarts = faulty_engine.executor.restarts
    with pytest.raises(RequestFailed, match="test fault on rank 1 at decode 1"):
        faulty_engine.step(_params(RAISE_PROMPT))
    assert faulty_engine.executor.restarts == restarts + 1
    assert len(faulty_engine.step(_params("a calm sea")).images) == 1


def test_a_decode_the_rank_cannot_allocate_untiled_is_tiled(engines, monkeypatch):
    """By default one rank decodes whole, unless the untiled decode's measured peak (4240 bytes a pixel for
    Qwen-Image's VAE, 0.46 GiB at 272x208 in fp32) exceeds what it can allocate: a simulated device with 0.2 GiB
    free (the test double of memory_plan's tests; the tiny model's plan fits in it at a small token limit) gets the
    tiled decode."""
    tiled = np.stack(engines("tiny/qwen-image", vae_parallel=True).generate(PROMPT, **ARGS))
    monkeypatch.setenv(TEST_GPU_MEMORY_ENV, "8GiB,200MiB")
    omni = Omni("tiny/qwen-image", stall_timeout_s=60, max_tokens_per_step=1024)
    try:
        np.testing.assert_array_equal(np.stack(omni.generate(PROMPT, **ARGS)), tiled)
    finally:
        omni.close()
