"""The tiny GLM-Image model, and the diffusers pipeline with our DiT and our AR stage, end to end on CPU.

With our transformer in place of diffusers', the pipeline produces the image it produces with its
own (same tiny checkpoint, same seed, CFG on). The family's AR stage (`encode_text`, what an SP
group's rank 0 runs) gives the pipeline's own prior tokens, and a pipeline loaded without the AR
model and its processor, given them, gives the full pipeline's image bit for bit. The AR reports
every generated token and stops when its progress callback raises. With a source image (image-to-image),
the same holds for the AR's tokens of the source and the image.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
from unittest import mock

import numpy as np
import pytest
import torch
from diffusers import GlmImagePipeline
from PIL import Image

from vllm_omni.diffusion.models.glm_image.pipeline import FAMILY
from vllm_omni.diffusion.models.glm_image.tiny import build_tiny_model
from vllm_omni.diffusion.models.registry import REGISTRY
from vllm_omni.diffusion.request import DiffusionRequest

PROMPT = "a poster with the title 'OPEN' on a white wall"
SIZE = dict(height=64, width=96)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_glm_image") / "glm-image"
    build_tiny_model("tiny/glm-image", path)
    return path


@pytest.fixture(scope="module")
def reference(folder):
    pipe = GlmImagePipeline.from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _run(pipe, **kwargs) -> np.ndarray:
    args = dict(prompt=PROMPT, **SIZE, num_inference_steps=2, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        return pipe(**dict(args, **kwargs), output_type="np").images


def test_our_dit_gives_the_reference_image(folder, reference):
    ours = FAMILY.denoisers["transformer"].from_pretrained(folder, subfolder="transformer")
    pipe = GlmImagePipeline(**dict(reference.components, transformer=ours))
    pipe.set_progress_bar_config(disable=True)
    expected = _run(reference)
    assert expected.shape == (1, SIZE["height"], SIZE["width"], 3)
    np.testing.assert_allclose(_run(pipe), expected, rtol=0, atol=1e-5)


def test_the_geometry_is_the_real_models(reference):
    assert (
        reference.vae_scale_factor * reference.transformer.config.patch_size == REGISTRY["GlmImagePipeline"].token_side
    )
    assert reference.transformer.config.num_attention_heads % 6 == 0  # Ulysses 2 and 3
    # The AR cannot sample its end token: it always generates the full count.
    ar = reference.vision_language_encoder.config
    assert ar.text_config.vision_vocab_size <= ar.image_start_token_id < ar.image_end_token_id


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
@pytest.mark.parametrize("guidance_scale", [1.5, 1.0], ids=["cfg", "no-cfg"])
def test_prior_tokens_from_encode_text_give_the_full_pipelines_image(folder, reference, guidance_scale):
    spec = REGISTRY["GlmImagePipeline"]
    request = DiffusionRequest(
        request_id="r",
        prompt=PROMPT,
        **SIZE,
        num_inference_steps=2,
        seed=3,
        num_images=2,
        guidance_scale=guidance_scale,
    )
    assert FAMILY.uses_cfg(request) == (guidance_scale > 1)
    kwargs = dict(FAMILY.call_kwargs(reference, request, spec), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        embeds = FAMILY.encode_text(reference, kwargs, reference.device)
        own, _, _ = reference.generate_prior_tokens(
            PROMPT, **SIZE, device=torch.device("cpu"), generator=torch.Generator().manual_seed(3)
        )
    assert embeds.keys() == {"prior_token_ids"} and torch.equal(embeds["prior_token_ids"], own)

    textless = GlmImagePipeline.from_pretrained(folder, **dict.fromkeys(FAMILY.text_encoders))
    textless.set_progress_bar_config(disable=True)
    assert all(getattr(textless, name) is None for name in FAMILY.text_encoders)
    expected = _run(reference, **{**kwargs, "generator": torch.Generator().manual_seed(3)})
    actual = _run(textless, **{**FAMILY.with_text(kwargs, embeds), "generator": torch.Generator().manual_seed(3)})
    assert expected.shape[0] == 2
    np.testing.assert_array_equal(actual, expected)


def _source(width: int, height: int):
    pixels = np.random.RandomState(0).randint(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@contextlib.contextmanager
def per_image_vision_tokens(pipe):
    """diffusers 0.42.1's AR stage hands `get_image_tokens` the sources' features concatenated ([C, h, w] for one
    source), which transformers 5 reads per image: give it the one source's as the batch of one it expects."""
    ar = pipe.vision_language_encoder
    tokens = ar.get_image_tokens
    with mock.patch.object(ar, "get_image_tokens", lambda features, grid: tokens(features[None], grid)):
        yield


def test_image_to_image_gives_the_reference_pipelines_image(folder, reference):
    """A source (96x64: 6 x 4 DiT tokens) read by our AR stage gives the pipeline's own tokens; a pipeline with
    our DiT and without the AR, given them, gives the reference pipeline's image."""
    spec = REGISTRY["GlmImagePipeline"]
    request = DiffusionRequest(
        request_id="r", prompt=PROMPT, images=[_source(96, 64)], **SIZE, num_inference_steps=2, seed=3
    )
    kwargs = dict(FAMILY.call_kwargs(reference, request, spec), generator=torch.Generator().manual_seed(3))
    with torch.inference_mode():
        embeds = FAMILY.encode_text(reference, kwargs, reference.device)
    with torch.inference_mode(), per_image_vision_tokens(reference):
        generator = torch.Generator().manual_seed(3)
        own = reference.generate_prior_tokens(
            PROMPT, **SIZE, image=[kwargs["image"]], device=torch.device("cpu"), generator=generator
        )
        expected = _run(reference, **{**kwargs, "generator": torch.Generator().manual_seed(3)})
    assert torch.equal(embeds["prior_token_ids"], own[0])
    assert torch.equal(embeds["prior_token_image_ids"], own[1][0])
    assert torch.equal(embeds["source_image_grid_thw"], own[2][0])

    ours = FAMILY.denoisers["transformer"].from_pretrained(folder, subfolder="transformer")
    textless = GlmImagePipeline.from_pretrained(folder, transformer=ours, **dict.fromkeys(FAMILY.text_encoders))
    textless.set_progress_bar_config(disable=True)
    actual = _run(textless, **{**FAMILY.with_text(kwargs, embeds), "generator": torch.Generator().manual_seed(3)})
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    assert np.abs(expected - _run(reference)).max() > 1e-3  # the source conditions the image


def test_sources_go_on_the_32_pixel_grid_and_the_step_cache_refuses_them():
    spec = REGISTRY["GlmImagePipeline"]
    request = DiffusionRequest(request_id="r", prompt=PROMPT, images=[_source(100, 70), _source(96, 64)], **SIZE)
    resized, kept = FAMILY.pipeline_kwargs(request, spec)["image"]
    assert resized.size == (96, 64) and kept is request.images[1]
    with pytest.raises(ValueError, match="step cache"):  # the sources' K/V pass is no denoising step
        FAMILY.pipeline_kwargs(dataclasses.replace(request, cache_threshold=0.1), spec)


def test_the_ar_reports_every_token_and_stops_when_progress_raises(reference):
    kwargs = dict(prompt=PROMPT, **SIZE, generator=torch.Generator().manual_seed(0))
    # The preview grid (16 sqrt(r) x 16 / sqrt(r) for r = H/W), the 32-pixel grid, the end token.
    ratio = SIZE["height"] / SIZE["width"]
    total = int(16 * math.sqrt(ratio)) * int(16 / math.sqrt(ratio)) + (64 // 32) * (96 // 32) + 1
    seen = []
    with torch.inference_mode():
        FAMILY.encode_text(reference, kwargs, reference.device, progress=lambda done, of: seen.append((done, of)))
    assert seen == [(done, total) for done in range(1, total + 1)]

    class Cancelled(Exception):
        pass

    def cancel_at_ten(done: int, of: int) -> None:
        if done == 10:
            raise Cancelled

    calls = []
    hook = reference.vision_language_encoder.register_forward_hook(lambda *args: calls.append(1))
    try:
        with pytest.raises(Cancelled), torch.inference_mode():
            FAMILY.encode_text(reference, kwargs, reference.device, progress=cancel_at_ten)
    finally:
        hook.remove()
    assert len(calls) == 10  # the prefill (token 1) and 9 decode steps, then no more


@pytest.mark.parametrize("fault", ["past the codebook", "an early end"])
def test_ar_tokens_that_are_not_the_images_fail_the_request_with_a_clear_error(reference, fault):
    """An id past the DiT's codebook would be a device-side assert in its embedding lookup (the worker's GPU lost),
    and a short run a shape error far from its cause: both are refused where the AR sampled them."""
    kwargs = dict(prompt=PROMPT, **SIZE, generator=torch.Generator().manual_seed(0))
    model = reference.vision_language_encoder
    sample = model.generate
    codebook = reference.transformer.config.prior_vq_quantizer_codebook_size

    def faulty(**inputs):
        outputs = sample(**inputs)
        if fault == "an early end":
            return outputs[:, :-3]  # the end token and the last two image tokens never sampled
        outputs = outputs.clone()
        outputs[0, -2] = codebook  # the last image token (the end token follows it)
        return outputs

    with mock.patch.object(model, "generate", faulty), torch.inference_mode():
        match = "outside the DiT's codebook of" if fault == "past the codebook" else "stopped after 4 of the image's 6"
        with pytest.raises(RuntimeError, match=match):
            FAMILY.encode_text(reference, kwargs, reference.device)
    with torch.inference_mode():  # the same pipeline, as sampled
        assert FAMILY.encode_text(reference, kwargs, reference.device)["prior_token_ids"].shape == (1, 24)
