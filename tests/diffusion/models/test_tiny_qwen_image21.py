"""The tiny embedded Qwen-Image 2.1 model and its pipeline adapter, run end to end on CPU.

The tiny folder is built once per session and loaded with the real `QwenImage21Pipeline`; our SP
transformer swapped in must give the reference pipeline's images (its prefix KV cache on, as
diffusers runs it by default, against ours with the cache off, as the family runs it).
"""

from __future__ import annotations

import pathlib
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers import QwenImage21Pipeline

from vllm_omni.diffusion.models.qwen_image21 import pipeline as qwen21_pipeline
from vllm_omni.diffusion.models.qwen_image21.tiny import tiny_model_path
from vllm_omni.diffusion.request import DiffusionRequest

HEIGHT, WIDTH = 64, 96  # 4 x 6 tokens of 16 pixels
SPEC = SimpleNamespace(diffusers_class="QwenImage21Pipeline")


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> pathlib.Path:
    return tiny_model_path("tiny/qwen-image-2.1", cache_dir=str(tmp_path_factory.mktemp("tiny_qwen21_cache")))


@pytest.fixture(scope="module")
def pipes(folder) -> dict[str, QwenImage21Pipeline]:
    ours = qwen21_pipeline.FAMILY.denoisers["transformer"].from_pretrained(folder, subfolder="transformer")
    pipes = {
        "reference": QwenImage21Pipeline.from_pretrained(folder),
        "ours": QwenImage21Pipeline.from_pretrained(folder, transformer=ours),
    }
    for pipe in pipes.values():
        pipe.set_progress_bar_config(disable=True)
    return pipes


def _run(pipe: QwenImage21Pipeline, request: DiffusionRequest, **overrides) -> np.ndarray:
    kwargs = {**qwen21_pipeline.FAMILY.call_kwargs(pipe, request, SPEC), **overrides}
    with torch.inference_mode():
        return pipe(**kwargs, generator=torch.Generator().manual_seed(request.seed), output_type="np").images


@pytest.mark.parametrize("prompt", ["a red fox in the snow", ["a red fox", "an old wooden boat on a quiet lake"]])
def test_our_transformer_gives_the_reference_images_with_true_cfg(pipes, prompt):
    # A list of prompts of different lengths: the padded one's mask reaches the transformer.
    request = DiffusionRequest(
        request_id="r",
        prompt=prompt,
        negative_prompt="blurry" if isinstance(prompt, str) else ["blurry", "dark"],
        true_cfg_scale=3.0,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        num_images=2 if isinstance(prompt, str) else 1,
        seed=5,
    )
    expected = _run(pipes["reference"], request, use_kv_cache=True)
    actual = _run(pipes["ours"], request)
    assert actual.shape == (2, HEIGHT, WIDTH, 4)  # the VAE decodes RGBA
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    assert not np.array_equal(actual[0], actual[1])


def test_a_checkpoints_sigma_grid_gives_way_to_the_requested_steps(pipes):
    pipe = pipes["ours"]
    request = DiffusionRequest(request_id="r", prompt="a kite", height=HEIGHT, width=WIDTH, num_inference_steps=3)
    assert "sigmas" not in qwen21_pipeline.FAMILY.call_kwargs(pipe, request, SPEC)  # the tiny model has no grid
    configured = SimpleNamespace(config={"sample_sigmas": [1.0, 0.5]})
    kwargs = qwen21_pipeline.FAMILY.call_kwargs(configured, request, SPEC)
    assert kwargs["sigmas"] == pytest.approx([1.0, 2 / 3, 1 / 3]) and kwargs["use_kv_cache"] is False
    request = DiffusionRequest(request_id="r", prompt="a kite", height=HEIGHT, width=WIDTH, num_inference_steps=2)
    assert "sigmas" not in qwen21_pipeline.FAMILY.call_kwargs(configured, request, SPEC)


def test_tiny_geometry_is_the_real_models(folder, pipes):
    assert (folder / "model_index.json").is_file()
    pipe = pipes["reference"]
    assert pipe.vae_scale_factor == 16 and pipe.transformer.config.patch_size == 1
    assert pipe.transformer.config.in_channels == pipe.vae.config.z_dim == 64
    assert pipe.transformer.config.context_in_dim == pipe.text_encoder.config.text_config.hidden_size
    heads = pipe.transformer.config.num_attention_heads
    assert heads % 2 == 0 and heads % 3 == 0
