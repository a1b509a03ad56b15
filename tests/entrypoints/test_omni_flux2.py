"""FLUX.2 through the offline engine on its tiny model: SP equals one process at padded sizes,
reference images, the fields it refuses, and the unmasked-padding warning. CPU workers over gloo.
"""

from __future__ import annotations

import os

import conformance
import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

MODEL = "tiny/flux2"
# 208x176 -> 13x11 = 143 image tokens (padded at Ulysses 2 and 3); the 512 text tokens pad at Ulysses 3.
HEIGHT, WIDTH = 208, 176
PROMPT = "a lighthouse on a cliff at dusk"


engines = conformance.engines_fixture(MODEL)


_generate = conformance.generator(PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=3, output_type="np")


def _reference_image() -> Image.Image:
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8))


@pytest.mark.parametrize(("degree", "mode"), [(2, "trim"), (3, "trim"), (2, "mask")])
def test_sp_equals_single_process_at_padded_size(engines, degree, mode):
    expected = _generate(engines(), guidance_scale=3.0)
    np.testing.assert_allclose(_generate(engines(degree, mode), guidance_scale=3.0), expected, rtol=0, atol=1e-5)


def test_reference_image_generation_under_sp_equals_single_process(engines):
    image = _reference_image()
    expected = _generate(engines(), image=image)
    actual = _generate(engines(2, "trim"), image=image)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    assert not np.allclose(expected, _generate(engines()), atol=1e-3)  # the reference image matters


def test_without_a_size_the_output_takes_the_first_reference_size_as_the_pipeline_encodes_it(engines):
    omni = engines()
    wide = Image.new("RGB", (200, 150), "teal")  # floored to 16: 192x144, like the pipeline's own resizing
    images = omni.generate(PROMPT, image=[wide, _reference_image()], num_inference_steps=2, seed=3)
    assert images[0].size == (192, 144) and (omni.last_output.width, omni.last_output.height) == (192, 144)


@pytest.mark.parametrize(("field", "value"), [("negative_prompt", "blurry"), ("true_cfg_scale", 4.0)])
def test_fields_flux2_does_not_take_are_refused_by_name(engines, field, value):
    with pytest.raises(ValueError, match=f"{field} is not accepted by Flux2Pipeline"):
        engines().generate(PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=2, **{field: value})


def test_cfg_parallel_is_refused_for_a_distilled_model():
    with pytest.raises(ValueError, match="Flux2Pipeline runs no classifier-free guidance branches"):
        Omni(MODEL, cfg_parallel_size=2)


def test_unmasked_padding_is_close_not_equal_and_warns_once_per_worker(engines, capfd):
    expected = _generate(engines())
    with Omni(MODEL, ulysses_degree=2, trim_sp_padding=False) as omni:
        outputs = [_generate(omni), _generate(omni)]
    conformance.assert_engine_unmasked_padding_warns_once_per_worker(outputs, expected, capfd.readouterr().err)


def test_klein_kv_references_under_sp_equal_the_pipeline_in_process(omni_engines):
    """FLUX.2 klein KV through the engine at Ulysses 2: the references' K/V extracted at the first step and kept
    per rank (image and reference tokens padded), equal to diffusers' KV pipeline with our transformer in process."""
    import torch
    from diffusers import Flux2KleinKVPipeline

    from vllm_omni.diffusion.models.flux2.pipeline import FAMILY
    from vllm_omni.diffusion.models.flux2.tiny import tiny_model_path

    model = "tiny/flux2-klein-kv"
    rng = np.random.default_rng(1)
    references = [Image.fromarray(rng.integers(0, 256, (80, 80, 3), dtype=np.uint8)), _reference_image()]
    args = dict(image=references, height=HEIGHT, width=WIDTH, num_inference_steps=3, seed=3, output_type="np")
    actual = np.stack(omni_engines(model, 2, "trim").generate(PROMPT, **args))

    folder = tiny_model_path(model)
    transformer = FAMILY.denoisers["transformer"].from_pretrained(folder, subfolder="transformer")
    pipe = Flux2KleinKVPipeline.from_pretrained(folder, transformer=transformer)
    FAMILY.prepare_pipeline(pipe)
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        expected = pipe(
            prompt=PROMPT,
            image=references,
            height=HEIGHT,
            width=WIDTH,
            num_inference_steps=3,
            output_type="np",
            generator=torch.Generator().manual_seed(3),
        ).images
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
