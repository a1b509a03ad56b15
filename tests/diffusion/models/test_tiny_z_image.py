"""The tiny embedded Z-Image model and the Z-Image pipeline adapter, run end to end on CPU.

The tiny folder is built once per session and loaded with the real diffusers pipelines (text-to-image,
and img2img on the same folder); our SP transformer swapped in must give the reference pipelines' images, and
the call with prompt embeddings encoded once (`encode_text`) must give the images of the call
that encodes its prompts itself.
"""

from __future__ import annotations

import json
import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import ZImageImg2ImgPipeline, ZImagePipeline
from PIL import Image

from vllm_omni.diffusion.models.z_image import pipeline as z_image_pipeline
from vllm_omni.diffusion.models.z_image.tiny import TINY_MODELS, tiny_model_path
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.entrypoints.deploy_config import load_deploy_config

FAMILY = z_image_pipeline.FAMILY
# 64x48 -> 4 x 3 = 12 image tokens (16 px a token), which the model pads to 32.
HEIGHT, WIDTH = 64, 48
SPECS = {
    "generate": SimpleNamespace(diffusers_class="ZImagePipeline", task="generate", max_input_images=1),
    "edit": SimpleNamespace(diffusers_class="ZImageImg2ImgPipeline", task="edit", max_input_images=1),
}
CLASSES = {"generate": ZImagePipeline, "edit": ZImageImg2ImgPipeline}


@pytest.fixture(scope="session")
def tiny_folder(tmp_path_factory) -> pathlib.Path:
    return tiny_model_path("tiny/z-image", str(tmp_path_factory.mktemp("tiny_z_image_cache")))


def _load(folder: pathlib.Path, task: str, ours: bool):
    components = {}
    if ours:
        components["transformer"] = FAMILY.denoisers["transformer"].from_pretrained(folder, subfolder="transformer")
    pipe = CLASSES[task].from_pretrained(folder, **components)
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipes(tiny_folder) -> dict[tuple[str, str], object]:
    return {(task, kind): _load(tiny_folder, task, kind == "ours") for task in CLASSES for kind in ("ref", "ours")}


def _source(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def _request(**fields) -> DiffusionRequest:
    values = dict(request_id="r", prompt="a red fox in the snow", height=HEIGHT, width=WIDTH, num_inference_steps=2)
    return DiffusionRequest(**{**values, **fields})


def _run(pipe, request: DiffusionRequest, task: str = "generate", shared_text: bool = False) -> np.ndarray:
    kwargs = FAMILY.call_kwargs(pipe, request, SPECS[task])
    pipe = FAMILY.pipeline_for(pipe, request)
    if isinstance(request.prompt, list):
        kwargs["prompt"] = request.prompt  # a batch of requests: the runner passes each row's prompt
    with torch.inference_mode():
        if shared_text:
            kwargs = FAMILY.with_text(kwargs, FAMILY.encode_text(pipe, kwargs, pipe.device))
        out = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np")
    return out.images


# Turbo (no CFG, two images); CFG with a negative prompt (rows of different caption lengths).
CASES = {
    "turbo": dict(guidance_scale=0.0, num_images=2),
    "cfg": dict(guidance_scale=3.0, negative_prompt="blurry, dark"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_our_transformer_gives_the_reference_images(pipes, case):
    request = _request(**CASES[case])
    expected = _run(pipes["generate", "ref"], request)
    actual = _run(pipes["generate", "ours"], request)
    assert actual.shape == (request.num_images, HEIGHT, WIDTH, 3)
    assert np.isfinite(actual).all() and 0 < actual.mean() < 1
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("loaded", ["generate", "edit"])
def test_img2img_gives_the_reference_images_and_uses_the_source(pipes, loaded):
    """img2img from a checkpoint of either pipeline (text-to-image: built on its components per request)."""
    request = _request(images=[_source(WIDTH, HEIGHT)], guidance_scale=0.0, num_inference_steps=3)
    expected = _run(pipes["edit", "ref"], request, "edit")
    assert isinstance(FAMILY.pipeline_for(pipes[loaded, "ours"], request), ZImageImg2ImgPipeline)
    actual = _run(pipes[loaded, "ours"], request, loaded)
    assert actual.shape == (1, HEIGHT, WIDTH, 3)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    other = _run(
        pipes["edit", "ours"], _request(images=[_source(WIDTH, HEIGHT, seed=1)], num_inference_steps=3), "edit"
    )
    assert np.abs(actual - other).max() > 1e-3


def test_img2img_at_another_size_resizes_the_source_first(pipes):
    """The pipeline encodes a source at its own size: the adapter resizes it to the request's size."""
    request = _request(images=[_source(100, 70)], guidance_scale=0.0)
    kwargs = FAMILY.call_kwargs(pipes["edit", "ours"], request, SPECS["edit"])
    assert kwargs["image"].size == (WIDTH, HEIGHT)
    assert _run(pipes["edit", "ours"], request, "edit").shape == (1, HEIGHT, WIDTH, 3)
    # A source already at the size (its sides floored to 16) is passed as is.
    source = _source(WIDTH + 5, HEIGHT + 3)
    assert FAMILY.call_kwargs(pipes["edit", "ours"], _request(images=[source]), SPECS["edit"])["image"] is source


@pytest.mark.parametrize("case", ["cfg", "batch"])
def test_text_encoded_once_gives_the_same_images(pipes, case):
    """The call with `encode_text`'s embeddings (what SP peers receive) equals the call that encodes itself."""
    fields = dict(CASES["cfg"]) if case == "cfg" else dict(prompt=["a red fox", "a lighthouse on a cliff at dusk"])
    request = _request(**fields)
    pipe = pipes["generate", "ours"]
    embeds = FAMILY.encode_text(pipe, FAMILY.call_kwargs(pipe, request, SPECS["generate"]), pipe.device)
    rows = 1 if case == "cfg" else 2
    assert sorted(embeds) == sorted(
        [f"prompt_embeds.{i}" for i in range(rows)] + [f"negative_prompt_embeds.{i}" for i in range(rows)]
    )
    np.testing.assert_allclose(_run(pipe, request, shared_text=True), _run(pipe, request), rtol=0, atol=1e-6)
    if case == "batch":
        assert not np.allclose(*_run(pipe, request), atol=1e-3)  # two prompts, two images


def test_pipeline_kwargs_map_the_request():
    assert FAMILY.pipeline_kwargs(_request(), SPECS["generate"]) == {
        "prompt": "a red fox in the snow",
        "height": HEIGHT,
        "width": WIDTH,
        "num_inference_steps": 2,
        "num_images_per_prompt": 1,
    }
    kwargs = FAMILY.pipeline_kwargs(_request(guidance_scale=0.0, negative_prompt="dark"), SPECS["generate"])
    assert kwargs["guidance_scale"] == 0.0 and kwargs["negative_prompt"] == "dark"
    source = _source(32, 32)
    assert FAMILY.pipeline_kwargs(_request(images=[source]), SPECS["generate"])["image"] is source


def test_folder_keeps_the_real_geometry(tiny_folder, pipes):
    folder = tiny_folder
    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    text = json.loads((folder / "text_encoder" / "config.json").read_text())
    assert json.loads((folder / "model_index.json").read_text())["_class_name"] == TINY_MODELS["tiny/z-image"]
    # 8x VAE, 2x2 patches: 16 px a token, 1024x1024 -> 4096 image tokens; heads that 2 and 3 divide.
    pipe = pipes["generate", "ours"]
    assert pipe.vae_scale_factor * transformer["all_patch_size"][0] == 16
    assert pipe.vae.config.latent_channels == transformer["in_channels"] == 16
    assert (
        transformer["n_heads"] % 6 == 0
        and sum(transformer["axes_dims"]) == transformer["dim"] // transformer["n_heads"]
    )
    assert text["architectures"] == ["Qwen3Model"] and transformer["cap_feat_dim"] == text["hidden_size"]
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 8 * 2**20


def test_turbo_deploy_defaults_are_diffusers_example_settings():
    deploy = load_deploy_config("z_image_turbo")
    assert deploy.default_sampling_params == {
        "width": 1024,
        "height": 1024,
        "num_inference_steps": 8,
        "guidance_scale": 0.0,
    }
    assert 30 % deploy.options["ulysses_degree"] == 0  # Z-Image's 30 heads
    assert len(deploy.devices) == deploy.options["ulysses_degree"]


def test_unknown_name_raises():
    with pytest.raises(ValueError, match="tiny/z-image"):
        tiny_model_path("tiny/not-a-model")
