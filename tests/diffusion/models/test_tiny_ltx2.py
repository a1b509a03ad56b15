"""The tiny LTX-2 models, and the diffusers pipelines with our transformer swapped in, end to end on CPU.

With our transformer in place of diffusers', each pipeline gives the video frames and the audio samples it gives with
its own (same tiny checkpoint, same seed, the pipelines' default guidance: CFG batched with the prompt, then the
spatio-temporal and the modality-isolated forwards). The family's call (`call_kwargs`, `pipeline_for`) and its text
encoded once (`encode_text` on the full pipeline, `with_text` on one without the text encoder) give the same.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from diffusers import LTX2ImageToVideoPipeline, LTX2Pipeline
from PIL import Image

from vllm_omni.diffusion.models.ltx2.pipeline import FAMILY
from vllm_omni.diffusion.models.ltx2.spec import FAMILY as SPECS
from vllm_omni.diffusion.models.ltx2.tiny import TINY_MODELS, build_tiny_model
from vllm_omni.diffusion.models.registry import REFUSED, spec_for
from vllm_omni.diffusion.request import DiffusionRequest

PROMPT = "a red kite over a beach"
SIZE = dict(height=64, width=96, num_frames=9)  # 2 x 3 latent pixels x 2 latent frames; 9 audio latent frames
CLASSES = {"tiny/ltx-2": LTX2Pipeline, "tiny/ltx-2-i2v": LTX2ImageToVideoPipeline}


def _image(width: int = 96, height: int = 64) -> Image.Image:
    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), np.uint8))


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny_ltx2")
    out = {}
    for name in TINY_MODELS:
        out[name] = root / name.split("/")[1]
        build_tiny_model(name, out[name])
    return out


def _run(pipe, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    pipe.set_progress_bar_config(disable=True)
    with torch.inference_mode():
        kwargs = dict(dict(num_inference_steps=2), **kwargs)
        result = pipe(generator=torch.Generator().manual_seed(0), output_type="np", **kwargs)
    return np.asarray(result.frames), result.audio.float().numpy()


def _ours(pipe):
    """`pipe`'s class on its components with our transformer, loaded from the same checkpoint."""
    transformer = FAMILY.denoisers["transformer"].from_pretrained(pipe.config._name_or_path, subfolder="transformer")
    return type(pipe)(**dict(pipe.components, transformer=transformer.eval()))


@pytest.mark.parametrize("name", sorted(CLASSES))
def test_our_transformer_gives_the_reference_frames_and_audio(folders, name):
    reference = CLASSES[name].from_pretrained(folders[name])
    kwargs = dict(prompt=PROMPT, negative_prompt="blurry", **SIZE)
    if name.endswith("-i2v"):
        kwargs["image"] = _image()
    frames, audio = _run(reference, **kwargs)
    ours_frames, ours_audio = _run(_ours(reference), **kwargs)
    assert frames.shape == (1, 9, 64, 96, 3)
    # 9 frames at 24 fps: 9 audio latent frames, 4x in time, less the causal decoder's 3, at 240 samples a mel frame.
    assert audio.shape == (1, 2, (9 * 4 - 3) * 240)
    np.testing.assert_allclose(ours_frames, frames, rtol=0, atol=1e-5)
    np.testing.assert_allclose(ours_audio, audio, rtol=0, atol=1e-5)


def test_the_family_call_with_text_encoded_once_gives_the_pipelines_output(folders):
    """Image-to-video on the text-to-video checkpoint (pipeline_for), two videos, the prompts encoded by the full
    pipeline and run by one without its text encoder (an SP peer): the full pipeline's own result, audio included."""
    path = folders["tiny/ltx-2"]
    full = _ours(LTX2Pipeline.from_pretrained(path))
    textless = _ours(LTX2Pipeline.from_pretrained(path, text_encoder=None, tokenizer=None))
    spec = spec_for("LTX2Pipeline")
    request = DiffusionRequest(
        request_id="r",
        prompt=PROMPT,
        negative_prompt="blurry",
        num_images=2,
        images=[_image()],
        fps=24,
        num_inference_steps=2,
        **SIZE,
    )
    for pipe in (full, textless):
        FAMILY.prepare_pipeline(pipe)
    kwargs = FAMILY.call_kwargs(full, request, spec)
    assert FAMILY.call_kwargs(textless, request, spec) == kwargs  # the same image quality on every rank
    assert kwargs["image_crf"] == 33 and kwargs["frame_rate"] == 24
    image_to_video = FAMILY.pipeline_for(full, request)
    assert isinstance(image_to_video, LTX2ImageToVideoPipeline) and image_to_video.transformer is full.transformer
    expected = _run(image_to_video, **kwargs)

    with torch.inference_mode():
        embeds = FAMILY.encode_text(full, kwargs, full.device)
    assert set(embeds) == {
        "prompt_embeds",
        "prompt_attention_mask",
        "negative_prompt_embeds",
        "negative_prompt_attention_mask",
    }
    assert embeds["prompt_embeds"].shape[0] == 2  # num_videos_per_prompt rows
    actual = _run(FAMILY.pipeline_for(textless, request), **FAMILY.with_text(kwargs, embeds))
    for got, want in zip(actual, expected):
        assert got.shape[0] == 2
        np.testing.assert_array_equal(got, want)
    sound = FAMILY.audio(full, type("Result", (), {"audio": torch.from_numpy(expected[1])})())
    assert sound.sample_rate == 24000 and sound.samples.dtype == np.float32


def test_spatio_temporal_guidance_without_perturbed_attention_is_left_out(folders):
    """LTX-2.0's transformer has no perturbed self-attention: the pipeline's spatio-temporal forward is the prompt's
    own, its guidance term zero up to rounding. The family's call leaves it out, one forward of three a step."""
    pipe = _ours(LTX2Pipeline.from_pretrained(folders["tiny/ltx-2"]))
    assert not pipe.transformer.config.perturbed_attn
    request = DiffusionRequest(request_id="r", prompt=PROMPT, num_inference_steps=2, fps=24, **SIZE)
    kwargs = FAMILY.call_kwargs(pipe, request, spec_for("LTX2Pipeline"))
    assert kwargs["stg_scale"] == kwargs["audio_stg_scale"] == 0.0
    calls = []
    pipe.transformer.register_forward_pre_hook(lambda module, args: calls.append(1))
    ours = _run(pipe, **kwargs)
    assert len(calls) == 2 * 2  # CFG (one batched forward) and modality guidance, two steps
    defaults = _run(pipe, **{k: v for k, v in kwargs.items() if "stg" not in k})  # diffusers' call
    assert len(calls) == 2 * 2 + 3 * 2
    for got, want in zip(ours, defaults):
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5)


def test_the_geometry_is_the_real_models(folders):
    pipe = LTX2Pipeline.from_pretrained(folders["tiny/ltx-2"])
    assert (pipe.vae_spatial_compression_ratio, pipe.vae_temporal_compression_ratio) == (32, 8)
    assert (pipe.audio_sampling_rate, pipe.audio_hop_length, pipe.audio_vae_temporal_compression_ratio) == (
        16000,
        160,
        4,
    )
    assert pipe.vocoder.config.output_sampling_rate == 24000 and pipe.vocoder.total_upsample_factor == 240
    config = pipe.transformer.config
    assert config.num_attention_heads == config.audio_num_attention_heads == 6 and config.rope_type == "split"
    assert pipe.connectors.video_connector.num_learnable_registers == 128
    ids = pipe.tokenizer(PROMPT, padding="max_length", max_length=1024).input_ids
    assert len(ids) == 1024 and pipe.tokenizer.bos_token_id in ids  # left-padded, <bos> first as Gemma's
    i2v = LTX2ImageToVideoPipeline.from_pretrained(folders["tiny/ltx-2-i2v"]).transformer.config
    assert {k: v for k, v in i2v.items() if k[0] != "_"} == {k: v for k, v in config.items() if k[0] != "_"}


def test_specs_and_the_two_stage_refusal():
    t2v, i2v = spec_for("LTX2Pipeline"), spec_for("LTX2ImageToVideoPipeline")
    assert (t2v.max_input_images, t2v.input_image_required, i2v.input_image_required) == (1, False, True)
    # 768x512 x 121 frames: 24 x 16 x 16 video tokens.
    assert t2v.tokens_per_step(*t2v.default_size, t2v.default_frames, []) == 6144
    assert t2v.output_size([(640, 360)]) == (832, 480)  # 16:9 at 768x512's area, sides on 32
    assert not t2v.cfg_parallel and "one batched forward" in t2v.cfg_parallel_refusal
    assert SPECS.refused.keys() == {"LTX2LatentUpsamplePipeline"} <= REFUSED.keys()
    with pytest.raises(ValueError, match="LTX2LatentUpsamplePipeline.*not served.*three pipeline calls"):
        spec_for("LTX2LatentUpsamplePipeline")
