"""Qwen-Image 2.1 through the offline engine on its tiny model, with the step cache on: Ulysses 3 (64x64 is
16 image tokens: padded) equals one process, cache decisions included; CFG parallel is refused. CPU workers
over gloo.

Engines are shared by the module; a request's `cache_threshold` picks uncached (every step computed) or
cached runs. At THRESHOLD the tiny model's first block changes by about 1.11 at the steps it skips and 1.27
at those it computes: U1 skips steps 1, 2 and 4 of both branches.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

MODEL = "tiny/qwen-image-2.1"
THRESHOLD = 1.2
UNCACHED = 1e-6  # below every change: every step computes
LAYOUTS = {"U1": dict(), "U3 trim": dict(ulysses_degree=3)}


@pytest.fixture(scope="module")
def engines():
    with ThreadPoolExecutor(max_workers=len(LAYOUTS)) as pool:  # the workers start together
        started = dict(zip(LAYOUTS, pool.map(lambda kw: Omni(MODEL, cache="first_block", **kw), LAYOUTS.values())))
    yield started
    with ThreadPoolExecutor(max_workers=len(started)) as pool:
        list(pool.map(lambda omni: omni.close(), started.values()))


def _generate(omni: Omni, threshold: float) -> tuple[np.ndarray, dict]:
    images = omni.generate(
        "a lighthouse on a cliff at dusk",
        negative_prompt="blurry",
        true_cfg_scale=3.0,
        height=64,
        width=64,
        num_inference_steps=6,
        seed=3,
        cache_threshold=threshold,
        output_type="np",
    )
    return np.stack(images), omni.last_output.step_cache


def test_ulysses_3_equals_one_process_with_and_without_the_step_cache(engines):
    for threshold in (UNCACHED, THRESHOLD):
        expected, expected_cache = _generate(engines["U1"], threshold)
        actual, cache = _generate(engines["U3 trim"], threshold)
        assert actual.shape == (1, 64, 64, 4)  # the VAE decodes RGBA
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
        assert cache["skipped_steps"] == expected_cache["skipped_steps"]
    assert expected_cache["skipped_steps"] == {"cond": [1, 2, 4], "uncond": [1, 2, 4]}
    assert not np.allclose(expected, _generate(engines["U1"], UNCACHED)[0], atol=1e-3)  # skipping changed it


def test_cfg_parallel_is_refused_at_start_with_the_reason():
    with pytest.raises(ValueError, match="QwenImage21Pipeline runs true CFG as two forwards, but .* differ in length"):
        Omni(MODEL, cfg_parallel_size=2)
