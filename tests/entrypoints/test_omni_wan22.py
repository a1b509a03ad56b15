"""Wan2.2 through the offline engine on its tiny models: SP and CFG parallel equal one process at
padded shapes, for both experts (A14B) and per-token timesteps (TI2V-5B); image-to-video; the
unmasked mode close and warning once per worker; the sizes and frame rules. CPU workers.
"""

from __future__ import annotations

import io
import os
import re

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

PROMPT = "a paper boat drifting on a pond at dawn"
# A14B: 80x112 is 5x7 tokens a frame (16 px each), 17 frames are 5 latent frames: 175 video
# tokens, padded at Ulysses 2 and 3. TI2V-5B: 224x160 is 7x5 tokens (32 px each) x 1 latent frame
# (one frame): 35 tokens, padded at 2 and 3.
A14B = dict(height=80, width=112, num_frames=17)
FIVE_B = dict(height=160, width=224, num_frames=1)
CASES = {"tiny/wan2.2-t2v": A14B, "tiny/wan2.2-ti2v": FIVE_B, "tiny/wan2.2-i2v": A14B}


@pytest.fixture(scope="module")
def engines(omni_engines):
    return omni_engines


def _png(width: int, height: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


def _generate(omni: Omni, model: str, **kwargs) -> np.ndarray:
    args = dict(CASES[model], num_inference_steps=2, seed=5, output_type="np", negative_prompt="blurry")
    if model.endswith("-i2v"):
        args["image"] = _png(120, 90)
    args.update(kwargs)
    return np.stack(omni.generate(PROMPT, **args))


@pytest.mark.parametrize(
    ("model", "degree", "mode"),
    [
        ("tiny/wan2.2-t2v", 2, "trim"),
        ("tiny/wan2.2-t2v", 3, "trim"),
        ("tiny/wan2.2-ti2v", 2, "trim"),
        ("tiny/wan2.2-ti2v", 3, "mask"),
        ("tiny/wan2.2-i2v", 2, "trim"),
    ],
)
def test_sp_equals_single_process_at_padded_shape(engines, model, degree, mode):
    expected = _generate(engines(model), model)
    size = CASES[model]
    assert expected.shape == (1, size["num_frames"], size["height"], size["width"], 3)
    np.testing.assert_allclose(_generate(engines(model, degree, mode), model), expected, rtol=0, atol=1e-5)


def test_cfg_parallel_equals_one_group(engines):
    model = "tiny/wan2.2-t2v"
    expected = _generate(engines(model), model, guidance_scale=4.0)
    np.testing.assert_allclose(
        _generate(engines(model, 1, "trim", cfg=2), model, guidance_scale=4.0), expected, atol=1e-5
    )


def test_defaults_frame_rule_and_rounding(engines):
    omni = engines("tiny/wan2.2-t2v")
    omni.generate(PROMPT, height=90, width=120, num_frames=10, num_inference_steps=2, seed=1)
    out = omni.last_output
    # 90x120 rounds down to multiples of 16, 10 frames to 4k+1; A14B's frame rate is 16 fps.
    assert (out.height, out.width, out.num_frames, out.fps) == (80, 112, 9, 16)
    five_b = engines("tiny/wan2.2-ti2v")
    five_b.generate(PROMPT, height=180, width=230, num_frames=1, num_inference_steps=2, seed=1)
    out = five_b.last_output
    assert (out.height, out.width, out.fps) == (160, 224, 24)  # multiples of 32; 24 fps


def test_image_to_video_without_a_size_keeps_the_image_aspect_ratio(engines):
    omni = engines("tiny/wan2.2-i2v")
    with pytest.raises(ValueError, match=r"^image\b"):
        omni.generate(PROMPT, num_frames=5, num_inference_steps=2)  # the image is required
    omni.generate(PROMPT, image=_png(640, 360), num_frames=1, num_inference_steps=2, seed=2)
    out = omni.last_output
    assert (out.width, out.height) == (832, 480)  # 16:9 at 832x480's area (sides to 32)
    omni.generate(PROMPT, image=_png(300, 600), num_frames=1, num_inference_steps=2, seed=2)
    assert (omni.last_output.width, omni.last_output.height) == (448, 896)


def test_both_experts_run_and_unmasked_padding_is_close_not_equal_and_warns_once_per_worker(capfd):
    """A14B with 2 steps: step 1 (t=999) is the high-noise expert's, step 2 (t=750) the low-noise
    one's; with CFG each runs two forwards, on every rank of the Ulysses group."""
    # Both engines start here, after capfd: their workers' lines land in it.
    args = dict(height=80, width=112, num_frames=17, num_inference_steps=2, seed=7, output_type="np")
    with Omni("tiny/wan2.2-t2v") as omni:
        expected = omni.generate(PROMPT, **args)[0]
    with Omni("tiny/wan2.2-t2v", ulysses_degree=2, trim_sp_padding=False) as omni:
        for _ in range(2):
            actual = omni.generate(PROMPT, **args)[0]
    err = capfd.readouterr().err
    diff = float(np.abs(actual - expected).max())
    assert 0 < diff < 0.5, diff
    warnings = [line for line in err.splitlines() if "unmasked SP padding" in line]
    assert sorted(re.search(r"\[(omni-worker-\d)", w).group(1) for w in warnings) == ["omni-worker-0", "omni-worker-1"]
    served = re.findall(r"Request \S+: 2 step\(s\) in \S+ s \(forwards: (.*)\)", err)
    assert served == ["transformer 2, transformer_2 2"] * 3, served


def test_the_low_noise_expert_takes_its_own_guidance_scale(engines):
    model = "tiny/wan2.2-t2v"
    same = _generate(engines(model), model, guidance_scale=4.0)
    # The pipeline's default for guidance_scale_2 is guidance_scale: giving it equal changes nothing.
    np.testing.assert_array_equal(_generate(engines(model), model, guidance_scale=4.0, guidance_scale_2=4.0), same)
    other = _generate(engines(model), model, guidance_scale=4.0, guidance_scale_2=1.5)  # step 2 is transformer_2's
    assert np.abs(other - same).max() > 1e-3
    with pytest.raises(ValueError, match=r"^guidance_scale_2 is not accepted by WanPipeline"):
        engines("tiny/wan2.2-ti2v").generate(PROMPT, **FIVE_B, num_inference_steps=2, guidance_scale_2=2.0)
