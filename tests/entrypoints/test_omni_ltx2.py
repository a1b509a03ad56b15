"""LTX-2 through the offline engine on its tiny models: SP equals one process, video frames and audio samples, at
sizes where the video stream, the audio stream or both pad; image-to-video (its own checkpoint, and a text-to-video
checkpoint given an image); the step cache on both streams; the sizes, the frame rule and the sound's length.
CPU workers.
"""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

PROMPT = "a paper boat drifting on a pond at dawn, water lapping"
# 224x160 is 7x5 tokens a frame (32 px each). 17 frames are 3 latent frames: 105 video tokens (pads at Ulysses 2);
# at 25 fps they last 0.68 s: 17 audio tokens (25 a second; pads at 2 and 3). 9 frames at 24 fps: 70 video tokens
# (pads at 3) and 9 audio tokens (pads at 2).
BOTH_PAD_AT_2 = dict(height=160, width=224, num_frames=17, fps=25)
ONE_PADS_EACH = dict(height=160, width=224, num_frames=9, fps=24)


@pytest.fixture(scope="module")
def engines(omni_engines):
    return omni_engines


def _png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _generate(omni, size: dict, **kwargs) -> tuple[np.ndarray, np.ndarray]:
    """Frames [n, F, H, W, 3] (float32) and sound [n, 2, samples] of one request."""
    args = dict(size, num_inference_steps=2, seed=5, output_type="np", negative_prompt="blurry")
    args.update(kwargs)
    frames = np.stack(omni.generate(PROMPT, **args))
    output = omni.last_output
    assert output.audio_sample_rate == 24000 and len(output.audio) == len(frames)
    return frames, np.stack(output.audio)


@pytest.mark.parametrize(
    ("model", "size", "degree", "mode"),
    [
        ("tiny/ltx-2", BOTH_PAD_AT_2, 2, "trim"),
        ("tiny/ltx-2", BOTH_PAD_AT_2, 2, "mask"),
        ("tiny/ltx-2", ONE_PADS_EACH, 2, "trim"),  # the audio stream pads
        ("tiny/ltx-2", ONE_PADS_EACH, 3, "trim"),  # the video stream pads
        ("tiny/ltx-2-i2v", BOTH_PAD_AT_2, 2, "trim"),
    ],
)
def test_sp_equals_single_process_frames_and_sound(engines, model, size, degree, mode):
    image = {"image": _png(120, 90)} if model.endswith("-i2v") else {}
    frames, sound = _generate(engines(model), size, **image)
    assert frames.shape == (1, size["num_frames"], size["height"], size["width"], 3)
    sp_frames, sp_sound = _generate(engines(model, degree, mode), size, **image)
    np.testing.assert_allclose(sp_frames, frames, rtol=0, atol=1e-5)
    np.testing.assert_allclose(sp_sound, sound, rtol=0, atol=1e-5)


def test_the_text_to_video_checkpoint_runs_image_to_video_given_an_image(engines):
    t2v, i2v = engines("tiny/ltx-2"), engines("tiny/ltx-2-i2v")
    image = _png(120, 90)
    with_image = _generate(t2v, BOTH_PAD_AT_2, image=image)
    # The two tiny checkpoints hold the same weights: an image on either gives the same video and sound.
    for got, want in zip(with_image, _generate(i2v, BOTH_PAD_AT_2, image=image)):
        np.testing.assert_array_equal(got, want)
    assert np.abs(with_image[0] - _generate(t2v, BOTH_PAD_AT_2)[0]).max() > 1e-3  # and it is conditioned on it
    with pytest.raises(ValueError, match=r"^image\b"):
        i2v.generate(PROMPT, **BOTH_PAD_AT_2, num_inference_steps=2)  # the image-to-video model needs one


def test_defaults_sizes_and_the_sound_lasts_as_long_as_the_video(engines):
    omni = engines("tiny/ltx-2")
    omni.generate(PROMPT, height=180, width=230, num_frames=12, num_inference_steps=2, seed=1)
    out = omni.last_output
    # Sides down to multiples of 32, 12 frames to 8k + 1, 24 fps by default.
    assert (out.height, out.width, out.num_frames, out.fps) == (160, 224, 9, 24)
    seconds = out.num_frames / out.fps
    assert out.audio[0].shape[0] == 2  # stereo
    assert out.audio[0].shape[1] / out.audio_sample_rate == pytest.approx(seconds, abs=0.05)
    # Without a size: 768x512; an image without a size keeps its aspect ratio at that area.
    omni.generate(PROMPT, image=_png(640, 360), num_frames=1, num_inference_steps=2, seed=2)
    assert (omni.last_output.width, omni.last_output.height) == (832, 480)
    # One step would be NaN (the scheduler's terminal stretch divides by zero): refused before it runs.
    with pytest.raises(ValueError, match=r"^num_inference_steps must be between 2 and"):
        omni.generate(PROMPT, num_frames=1, num_inference_steps=1)


def test_the_step_cache_skips_steps_on_both_streams_and_keeps_their_shapes():
    """First-Block-Cache: the audio stream is the blocks' second stream (kept and reused as a joint block's text)."""
    from vllm_omni import Omni

    args = dict(BOTH_PAD_AT_2, num_inference_steps=6, seed=3, output_type="np")
    with Omni("tiny/ltx-2", ulysses_degree=2, cache="first_block", cache_threshold=10.0) as omni:
        frames = omni.generate(PROMPT, **args)[0]
        out = omni.last_output
    assert out.step_cache["forwards_skipped"] > 0, out.step_cache
    assert frames.shape == (17, 160, 224, 3) and np.isfinite(frames).all()
    assert out.audio[0].shape[0] == 2 and np.isfinite(out.audio[0]).all()
