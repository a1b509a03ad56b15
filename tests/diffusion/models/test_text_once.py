"""Text encoded once: every family's `encode_text` / `with_text` against its own pipeline, per tiny model.

A pipeline loaded without the family's `text_encoders` components, called with the embeddings the
full pipeline's `encode_text` computed, must give the full pipeline's own output bit for bit (fp32,
same seed), with CFG on (a negative prompt) and off.
"""

from __future__ import annotations

import json

import diffusers
import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.models.registry import TINY_MODELS
from vllm_omni.diffusion.request import DiffusionRequest


def _image(width: int, height: int, seed: int = 0) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), np.uint8))


QWEN_CFG = dict(negative_prompt="blurry", true_cfg_scale=4.0)
VIDEO = dict(num_frames=5)
CASES = {  # (tiny model, case) -> request fields; "cfg" cases give a negative prompt and run CFG
    ("tiny/qwen-image", "cfg"): dict(height=64, width=64, num_images=2, **QWEN_CFG),
    ("tiny/qwen-image", "no-cfg"): dict(height=64, width=64, true_cfg_scale=4.0),  # no negative: no true CFG
    ("tiny/qwen-image-edit", "cfg"): dict(height=64, width=64, images=[_image(64, 48)], **QWEN_CFG),
    ("tiny/qwen-image-edit-plus", "cfg"): dict(height=64, width=64, images=[_image(40, 56)], **QWEN_CFG),
    ("tiny/qwen-image-2.1", "cfg"): dict(height=64, width=64, num_images=2, **QWEN_CFG),
    ("tiny/qwen-image-2.1", "no-cfg"): dict(height=64, width=96),  # sampled without guidance by default
    ("tiny/flux2", "no-cfg"): dict(height=64, width=64, num_images=2, images=[_image(80, 64)]),  # embedded guidance
    ("tiny/flux2-klein", "no-cfg"): dict(height=64, width=64, num_images=2, images=[_image(80, 64)]),  # distilled
    ("tiny/flux2-klein-kv", "no-cfg"): dict(height=64, width=64, images=[_image(80, 64)]),  # reference K/V kept
    ("tiny/hunyuan-video-1.5", "cfg"): dict(height=144, width=176, negative_prompt="blurry", **VIDEO),
    ("tiny/hunyuan-video-1.5", "no-cfg"): dict(height=144, width=176, guidance_scale=1.0, **VIDEO),
    ("tiny/hunyuan-video-1.5-i2v", "cfg"): dict(images=[_image(150, 120)], negative_prompt="blurry", **VIDEO),
    ("tiny/wan2.2-t2v", "cfg"): dict(height=48, width=80, num_images=2, negative_prompt="blurry", **VIDEO),
    ("tiny/wan2.2-t2v", "no-cfg"): dict(height=48, width=80, guidance_scale=1.0, **VIDEO),
    ("tiny/wan2.2-i2v", "cfg"): dict(height=48, width=80, images=[_image(80, 48)], negative_prompt="blurry", **VIDEO),
    ("tiny/wan2.2-ti2v", "cfg"): dict(height=64, width=96, guidance_scale=4.0, **VIDEO),  # default negative ""
}


def test_every_tiny_model_has_a_case():
    # GLM-Image shares its prior tokens, not embeddings: tests/diffusion/models/test_tiny_glm_image.py covers its
    # encode-once; Z-Image's (cfg and a batch of prompts) is in tests/diffusion/models/test_tiny_z_image.py; LTX-2's
    # (CFG batched in one forward, its sound too) in tests/diffusion/models/test_tiny_ltx2.py.
    batched_cfg = {"tiny/z-image", "tiny/ltx-2", "tiny/ltx-2-i2v"}
    assert {name for name, _ in CASES} == set(TINY_MODELS) - {"tiny/glm-image"} - batched_cfg


@pytest.fixture(scope="module")
def loaded():
    """name -> (spec, full pipeline, pipeline without the text encoders), each loaded once."""
    cache = {}

    def load(name: str):
        if name not in cache:
            path = resolve_model_path(name)
            spec = read_pipeline_spec(path)
            family = spec.family_pipeline()
            index = json.loads((path / "model_index.json").read_text())
            pipeline_class = getattr(diffusers, spec.diffusers_class)
            # The components this checkpoint has (Qwen-Image has no processor, its edits have one).
            dropped = {component: None for component in family.text_encoders if component in index}
            assert "text_encoder" in dropped
            full, textless = pipeline_class.from_pretrained(path), pipeline_class.from_pretrained(path, **dropped)
            assert all(getattr(textless, component) is None for component in dropped)
            for pipe in (full, textless):
                pipe.set_progress_bar_config(disable=True)
            cache[name] = spec, full, textless
        return cache[name]

    return load


def _output(pipe, spec, kwargs) -> np.ndarray:
    with torch.inference_mode():
        result = pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="np")
    return np.asarray(result.frames if spec.modality == "video" else result.images)


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
@pytest.mark.parametrize(("name", "case"), sorted(CASES), ids=[f"{n[5:]}-{c}" for n, c in sorted(CASES)])
def test_embeddings_from_the_full_pipeline_give_its_output(loaded, name, case):
    spec, full, textless = loaded(name)
    family = spec.family_pipeline()
    request = DiffusionRequest(
        request_id="r", prompt="a red kite over a beach", num_inference_steps=2, seed=0, **CASES[name, case]
    )
    kwargs = family.call_kwargs(full, request, spec)
    assert family.call_kwargs(textless, request, spec) == kwargs  # every rank sets its own pipeline up
    with torch.inference_mode():
        embeds = family.encode_text(full, kwargs, full.device)
    assert embeds and all(isinstance(tensor, torch.Tensor) for tensor in embeds.values())
    assert ("negative_prompt_embeds" in embeds) == family.uses_cfg(request) == (case == "cfg")

    expected = _output(full, spec, kwargs)
    actual = _output(textless, spec, family.with_text(kwargs, embeds))
    assert expected.shape[0] == request.num_images
    np.testing.assert_array_equal(actual, expected)


def test_with_text_leaves_a_call_without_embeddings_alone(loaded):
    spec, full, _ = loaded("tiny/wan2.2-t2v")
    kwargs = spec.family_pipeline().call_kwargs(full, DiffusionRequest(request_id="r", prompt="a kite"), spec)
    assert spec.family_pipeline().with_text(kwargs, {}) is kwargs
