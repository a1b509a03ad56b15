"""The tiny HunyuanVideo 1.5 models and the pipeline adapter, end to end on CPU.

The diffusers pipelines with our transformer swapped in must produce what they produce with
theirs (same tiny checkpoint, same seed); the adapter maps a request onto the pipeline's
arguments and its guider.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import HunyuanVideo15ImageToVideoPipeline, HunyuanVideo15Pipeline
from PIL import Image
from safetensors.torch import load_file

from vllm_omni.diffusion.models.hunyuan_video_15.pipeline import FAMILY
from vllm_omni.diffusion.models.hunyuan_video_15.tiny import TINY_MODELS, build_tiny_model
from vllm_omni.diffusion.models.spec import PipelineSpec
from vllm_omni.diffusion.request import DiffusionRequest

HEIGHT, WIDTH, FRAMES = 144, 176, 9  # 3 x 9 x 11 latent grid
PROMPT = 'A neon sign that says "OPEN" above a shop window at night'  # quoted text: ByT5 glyph tokens


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_hunyuan_video_15")
    out = {}
    for name in TINY_MODELS:
        out[name] = root / name.split("/")[1]
        build_tiny_model(name, out[name])
    return out


def _pipelines(folder, cls):
    """The reference pipeline, and the same components with our transformer."""
    reference = cls.from_pretrained(folder)
    ours = cls(
        **dict(
            reference.components, transformer=FAMILY.denoisers["transformer"].from_pretrained(folder / "transformer")
        )
    )
    for pipe in (reference, ours):
        pipe.set_progress_bar_config(disable=True)
    return reference, ours


def _call(pipe, **kwargs):
    return pipe(num_inference_steps=2, num_frames=FRAMES, generator=torch.Generator().manual_seed(0), **kwargs).frames


def test_tiny_folder_is_small_and_deterministic(folders, tmp_path):
    name = "tiny/hunyuan-video-1.5"
    size = sum(f.stat().st_size for f in folders[name].rglob("*") if f.is_file())
    assert size < 30 * 2**20
    build_tiny_model(name, tmp_path)
    for part in ("transformer/diffusion_pytorch_model.safetensors", "text_encoder/model.safetensors"):
        first, second = load_file(folders[name] / part), load_file(tmp_path / part)
        assert first.keys() == second.keys() and all(torch.equal(first[k], second[k]) for k in first)


def test_prompt_template_crop_keeps_exactly_the_user_turn(folders):
    pipe = HunyuanVideo15Pipeline.from_pretrained(folders["tiny/hunyuan-video-1.5"])
    _, mask = pipe._get_mllm_prompt_embeds(pipe.text_encoder, pipe.tokenizer, "a red fox", "cpu")
    # After dropping the 108 template tokens, the valid tokens are the prompt and the assistant turn.
    user_turn = pipe.tokenizer("a red fox<|im_end|>\n<|im_start|>assistant\n")["input_ids"]
    assert mask.shape == (1, 1000) and int(mask.sum()) == len(user_turn)


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
def test_text_to_video_matches_reference_pipeline(folders):
    reference, ours = _pipelines(folders["tiny/hunyuan-video-1.5"], HunyuanVideo15Pipeline)
    kwargs = dict(prompt=PROMPT, negative_prompt="blurry", height=HEIGHT, width=WIDTH, output_type="latent")
    expected = _call(reference, **kwargs)
    assert reference.guider.num_conditions == 2  # CFG ran: two forwards per step
    torch.testing.assert_close(_call(ours, **kwargs), expected, rtol=0, atol=1e-5)


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
def test_image_to_video_matches_reference_pipeline(folders):
    reference, ours = _pipelines(folders["tiny/hunyuan-video-1.5-i2v"], HunyuanVideo15ImageToVideoPipeline)
    image = Image.fromarray(np.random.default_rng(0).integers(0, 256, (120, 150, 3), dtype=np.uint8))
    kwargs = dict(prompt=PROMPT, image=image, output_type="latent")
    torch.testing.assert_close(_call(ours, **kwargs), _call(reference, **kwargs), rtol=0, atol=1e-5)


def _request(**fields) -> DiffusionRequest:
    defaults = dict(request_id="r", prompt=PROMPT, negative_prompt="blurry", num_inference_steps=2, seed=0)
    return DiffusionRequest(**{**defaults, **fields})


def test_request_runs_through_the_adapter_to_frames(folders):
    """What the runner does: prepare the pipeline for a request, call it, get [n, F, H, W, 3] frames.

    Two videos per prompt: the t2v pipeline then passes one row of image embeddings for two
    rows of text, which the reference transformer cannot run and ours does.
    """
    _, ours = _pipelines(folders["tiny/hunyuan-video-1.5"], HunyuanVideo15Pipeline)
    spec = PipelineSpec("HunyuanVideo15Pipeline", "generate", 0, "unused:Runner")
    request = _request(height=HEIGHT, width=WIDTH, num_images=2, guidance_scale=1.0)
    kwargs = FAMILY.call_kwargs(ours, request, spec)
    assert ours.guider.num_conditions == 1  # scale 1.0: CFG off, the negative prompt is not encoded
    with torch.inference_mode():
        frames = ours(**kwargs, num_frames=5, generator=torch.Generator().manual_seed(0), output_type="np").frames
    assert frames.shape == (2, 5, HEIGHT, WIDTH, 3)
    assert np.isfinite(frames).all() and frames.min() >= 0 and frames.max() <= 1


def test_guidance_scale_goes_to_the_guider_and_back_to_the_checkpoints(folders):
    pipe = HunyuanVideo15Pipeline.from_pretrained(folders["tiny/hunyuan-video-1.5"])
    spec = PipelineSpec("HunyuanVideo15Pipeline", "generate", 0, "unused:Runner")
    checkpoint_guider = pipe.guider
    FAMILY.call_kwargs(pipe, _request(guidance_scale=3.5), spec)
    assert pipe.guider.guidance_scale == 3.5 and checkpoint_guider.guidance_scale == 6.0
    FAMILY.call_kwargs(pipe, _request(), spec)
    assert pipe.guider is checkpoint_guider


def test_pipeline_kwargs():
    t2v = PipelineSpec("HunyuanVideo15Pipeline", "generate", 0, "unused:Runner")
    i2v = PipelineSpec("HunyuanVideo15ImageToVideoPipeline", "edit", 1, "unused:Runner")
    kwargs = FAMILY.pipeline_kwargs(_request(height=480, width=848, num_images=2), t2v)
    assert kwargs == dict(
        prompt=PROMPT,
        negative_prompt="blurry",
        num_inference_steps=2,
        num_videos_per_prompt=2,
        height=480,
        width=848,
    )
    image = Image.new("RGB", (64, 48))
    kwargs = FAMILY.pipeline_kwargs(_request(images=[image]), i2v)
    assert kwargs["image"] is image and "height" not in kwargs and "width" not in kwargs
    with pytest.raises(ValueError, match="input image"):
        FAMILY.pipeline_kwargs(_request(), i2v)
