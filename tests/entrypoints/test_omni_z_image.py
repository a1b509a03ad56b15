"""Z-Image through the offline engine on its tiny model: Ulysses 3 equals one process at a padded size
with CFG (the prompt encoded once, the cond and uncond rows of different caption lengths), and the
levers it refuses with their reasons. CPU workers over gloo.
"""

from __future__ import annotations

import os

import conformance
import numpy as np
import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

MODEL = "tiny/z-image"
# 64x48 -> 4 x 3 = 12 image tokens, which the model pads to 32 and Ulysses 3 to 33; the captions pad too.
HEIGHT, WIDTH = 64, 48
PROMPT = "a lighthouse on a cliff at dusk"


engines = conformance.engines_fixture(MODEL)


_generate = conformance.generator(PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=3, output_type="np")


def test_sp_with_cfg_equals_single_process_at_padded_size(engines):
    knobs = dict(guidance_scale=2.0, negative_prompt="blurry, dark")
    expected = _generate(engines(), **knobs)
    np.testing.assert_allclose(_generate(engines(3, "trim"), **knobs), expected, rtol=0, atol=1e-5)
    assert not np.allclose(_generate(engines(), guidance_scale=0.0), expected, atol=1e-3)  # CFG matters


@pytest.mark.parametrize(
    ("option", "words"),
    [
        (dict(cfg_parallel_size=2), "ZImagePipeline runs classifier-free guidance .* as one batched forward"),
        (dict(cache="first_block"), "ZImagePipeline does not fit diffusers' First-Block-Cache"),
    ],
)
def test_cfg_parallel_and_the_step_cache_are_refused_with_the_reason(option, words):
    with pytest.raises(ValueError, match=words):
        Omni(MODEL, **option)
