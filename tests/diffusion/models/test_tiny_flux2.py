"""The tiny embedded FLUX.2 model and the FLUX.2 pipeline adapter, run end to end on CPU.

The tiny folder is built once per session and loaded with the real `Flux2Pipeline`; our SP
transformer swapped in must give the reference pipeline's images, alone and under SP.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import Flux2Pipeline
from PIL import Image
from safetensors.torch import load_file

from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state, use_parallel_state
from vllm_omni.diffusion.models.flux2 import pipeline as flux2_pipeline
from vllm_omni.diffusion.models.flux2.tiny import TINY_MODELS, build_tiny_model, tiny_model_path
from vllm_omni.diffusion.request import DiffusionRequest

# 13 x 11 = 143 image tokens (16 px a token): neither 2 nor 3 ranks divide them.
HEIGHT, WIDTH = 208, 176
SPEC = SimpleNamespace(diffusers_class="Flux2Pipeline", max_input_images=4)


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> pathlib.Path:
    return tiny_model_path("tiny/flux2", cache_dir=str(tmp_path_factory.mktemp("tiny_flux2_cache")))


def _load(folder: pathlib.Path, ours: bool) -> Flux2Pipeline:
    components = {}
    if ours:
        components["transformer"] = flux2_pipeline.FAMILY.denoisers["transformer"].from_pretrained(
            folder, subfolder="transformer"
        )
    pipe = Flux2Pipeline.from_pretrained(folder, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipes(tiny_folder) -> dict[str, Flux2Pipeline]:
    return {"reference": _load(tiny_folder, ours=False), "ours": _load(tiny_folder, ours=True)}


def _reference_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _request(**fields) -> DiffusionRequest:
    values = dict(request_id="r", prompt="a red fox in the snow", height=HEIGHT, width=WIDTH, num_inference_steps=2)
    return DiffusionRequest(**{**values, **fields})


def _run(pipe: Flux2Pipeline, request: DiffusionRequest) -> np.ndarray:
    kwargs = flux2_pipeline.FAMILY.pipeline_kwargs(request, SPEC)
    with torch.inference_mode():
        out = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np")
    return out.images


def test_our_transformer_gives_the_reference_images(pipes):
    request = _request(num_images=2, guidance_scale=2.5)
    expected = _run(pipes["reference"], request)
    actual = _run(pipes["ours"], request)
    assert actual.shape == (2, HEIGHT, WIDTH, 3)
    assert np.isfinite(actual).all() and 0 <= actual.min() and actual.max() <= 1
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6)
    assert not np.array_equal(actual[0], actual[1])  # two images per prompt, two latents


def test_reference_image_is_used_and_matches_reference(pipes):
    request = _request(images=[_reference_image(200, 150, seed=0)])
    expected = _run(pipes["reference"], request)
    actual = _run(pipes["ours"], request)
    assert actual.shape == (1, HEIGHT, WIDTH, 3)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-6)
    without = _run(pipes["ours"], _request())
    assert np.abs(actual - without).max() > 1e-3


def test_pipeline_kwargs_map_the_request():
    assert flux2_pipeline.FAMILY.pipeline_kwargs(_request(), SPEC) == {
        "prompt": "a red fox in the snow",
        "height": HEIGHT,
        "width": WIDTH,
        "num_inference_steps": 2,
        "num_images_per_prompt": 1,
    }
    images = [_reference_image(64, 64, seed=i) for i in range(2)]
    kwargs = flux2_pipeline.FAMILY.pipeline_kwargs(
        _request(height=None, width=None, guidance_scale=3.0, num_images=3, images=images), SPEC
    )
    assert kwargs["image"] == images and kwargs["guidance_scale"] == 3.0 and kwargs["num_images_per_prompt"] == 3
    assert kwargs["height"] is None and kwargs["width"] is None
    # FLUX.2 has no true CFG: a negative prompt is not a pipeline argument.
    assert "negative_prompt" not in flux2_pipeline.FAMILY.pipeline_kwargs(_request(negative_prompt="blurry"), SPEC)
    with pytest.raises(ValueError, match="at most 4 reference images"):
        flux2_pipeline.FAMILY.pipeline_kwargs(_request(images=images * 3), SPEC)


def test_folder_keeps_the_real_geometry(tiny_folder, pipes):
    transformer = json.loads((tiny_folder / "transformer" / "config.json").read_text())
    vae = json.loads((tiny_folder / "vae" / "config.json").read_text())
    text = json.loads((tiny_folder / "text_encoder" / "config.json").read_text())["text_config"]
    assert json.loads((tiny_folder / "model_index.json").read_text())["_class_name"] == TINY_MODELS["tiny/flux2"]

    # 8x VAE, 2x2 latent patches: 16 px a token, 1328x1328 -> 6889 image tokens.
    pipe = pipes["ours"]
    assert pipe.vae_scale_factor * vae["patch_size"][0] == 16 and (1328 // 16) ** 2 == 6889
    assert transformer["in_channels"] == np.prod(vae["patch_size"]) * vae["latent_channels"]
    assert pipe.vae.bn.num_features == transformer["in_channels"]
    assert transformer["num_attention_heads"] % 6 == 0
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"]
    # Prompt embeddings stack hidden states 10, 20 and 30 of the text encoder.
    assert text["num_hidden_layers"] >= 30
    assert transformer["joint_attention_dim"] == 3 * text["hidden_size"]
    embeds, text_ids = pipe.encode_prompt("a red fox", device=torch.device("cpu"))
    assert embeds.shape == (1, 512, transformer["joint_attention_dim"]) and text_ids.shape == (1, 512, 4)

    size = sum(f.stat().st_size for f in tiny_folder.rglob("*") if f.is_file())
    assert size < 15 * 2**20


def test_build_is_deterministic(tiny_folder, tmp_path):
    build_tiny_model("tiny/flux2", tmp_path)
    for weights in (
        "transformer/diffusion_pytorch_model.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
        "text_encoder/model.safetensors",
    ):
        first, second = load_file(tiny_folder / weights), load_file(tmp_path / weights)
        assert first.keys() == second.keys()
        assert all(torch.equal(first[k], second[k]) for k in first)
    assert (tiny_folder / "tokenizer/tokenizer.json").read_text() == (tmp_path / "tokenizer/tokenizer.json").read_text()


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="tiny/flux2"):
        tiny_model_path("tiny/not-a-model")


# ---- under SP (gloo workers) ----------------------------------------------------------------

_worker_pipes: dict = {}


def sp_generate(folder: str, request: DiffusionRequest) -> np.ndarray:
    """Worker side: the pipeline with our transformer, under the worker's SP group (trim mode)."""
    if folder not in _worker_pipes:
        _worker_pipes[folder] = _load(pathlib.Path(folder), ours=True)
    state = get_parallel_state()
    config = state.config.replace(mask_sp_padding=False, trim_sp_padding=True)
    with use_parallel_state(dataclasses.replace(state, config=config)):
        return _run(_worker_pipes[folder], request)


def test_pipeline_under_sp_matches_single_process(sp_pool, tiny_folder, pipes):
    if sp_pool.world_size != 3:
        pytest.skip("3 ranks pad both streams (251 image, 512 text tokens); 2 ranks pad only the image")
    request = _request(images=[_reference_image(200, 150, seed=0)])
    expected = _run(pipes["ours"], request)
    for images in sp_pool.run(sp_generate, str(tiny_folder), request):
        np.testing.assert_allclose(images, expected, rtol=0, atol=1e-5)
