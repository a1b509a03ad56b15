"""The tiny Wan2.2 models, and the diffusers pipelines with our experts swapped in, end to end on CPU.

With our transformer (and transformer_2) in place of diffusers', each pipeline produces the frames
it produces with its own (same tiny checkpoint, same seed, CFG on); both experts run.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from diffusers import WanImageToVideoPipeline, WanPipeline
from PIL import Image

from vllm_omni.diffusion.models.wan22.pipeline import FAMILY
from vllm_omni.diffusion.models.wan22.tiny import TINY_MODELS, build_tiny_model

CASES = {  # pipeline class, call arguments
    "tiny/wan2.2-t2v": (WanPipeline, dict(height=48, width=80, num_frames=9)),
    "tiny/wan2.2-i2v": (WanImageToVideoPipeline, dict(height=48, width=80, num_frames=9)),
    "tiny/wan2.2-ti2v": (WanPipeline, dict(height=64, width=96, num_frames=9)),
}


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_wan22")
    out = {}
    for name in TINY_MODELS:
        out[name] = root / name.split("/")[1]
        build_tiny_model(name, out[name])
    return out


def _run(pipe, name: str) -> np.ndarray:
    cls, kwargs = CASES[name]
    if cls is WanImageToVideoPipeline:
        kwargs = dict(kwargs, image=Image.fromarray(np.random.default_rng(0).integers(0, 256, (48, 80, 3), np.uint8)))
    pipe.set_progress_bar_config(disable=True)
    return pipe(
        prompt="a red kite over a beach",
        num_inference_steps=2,
        guidance_scale=4.0,
        generator=torch.Generator().manual_seed(0),
        output_type="np",
        **kwargs,
    ).frames


@pytest.mark.parametrize("name", sorted(CASES))
def test_our_experts_give_the_reference_frames(folders, name):
    cls = CASES[name][0]
    reference = cls.from_pretrained(folders[name])
    index = json.loads((folders[name] / "model_index.json").read_text())
    ours = {
        component: model.from_pretrained(folders[name], subfolder=component)
        for component, model in FAMILY.denoisers.items()
        if index.get(component, [None])[0] is not None
    }
    assert set(ours) == ({"transformer"} if name.endswith("ti2v") else {"transformer", "transformer_2"})
    expected = _run(reference, name)
    config = {key: reference.config[key] for key in ("boundary_ratio", "expand_timesteps")}  # not components
    actual = _run(cls(**dict(reference.components, **ours), **config), name)
    frames = CASES[name][1]
    assert actual.shape == (1, frames["num_frames"], frames["height"], frames["width"], 3)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


def test_the_experts_differ_and_the_geometry_is_the_real_models(folders):
    t2v = WanPipeline.from_pretrained(folders["tiny/wan2.2-t2v"])
    first, second = t2v.transformer.state_dict(), t2v.transformer_2.state_dict()
    assert any(not torch.equal(first[k], second[k]) for k in first)
    assert t2v.config.boundary_ratio == 0.875 and t2v.vae_scale_factor_spatial == 8
    assert t2v.transformer.config.num_attention_heads % 6 == 0
    i2v = WanImageToVideoPipeline.from_pretrained(folders["tiny/wan2.2-i2v"])
    assert i2v.transformer.config.in_channels == 36 and i2v.config.boundary_ratio == 0.9
    ti2v = WanPipeline.from_pretrained(folders["tiny/wan2.2-ti2v"])
    assert ti2v.transformer_2 is None and ti2v.config.expand_timesteps and ti2v.vae_scale_factor_spatial == 16
    assert len(t2v.tokenizer("a kite", padding="max_length", max_length=512).input_ids) == 512
