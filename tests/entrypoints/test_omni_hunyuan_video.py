"""HunyuanVideo 1.5 through the offline engine on its tiny model: SP and CFG parallel equal one
process at padded shapes, video outputs, frame rules, bad input, and the CLI's MP4. CPU workers.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

import av
import conformance
import numpy as np
import pytest

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.request import RequestError  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

MODEL = "tiny/hunyuan-video-1.5"
# 208x144, 9 frames -> 13x9 tokens x 3 latent frames = 351 video tokens (padded at Ulysses 2);
# the prompt's 64-token bucket pads at Ulysses 3.
HEIGHT, WIDTH, FRAMES = 144, 208, 9
PROMPT = 'a paper boat on a pond, a sign that says "hello"'


engines = conformance.engines_fixture(MODEL)


_generate = conformance.generator(
    PROMPT, height=HEIGHT, width=WIDTH, num_frames=FRAMES, num_inference_steps=2, seed=5, output_type="np"
)


@pytest.mark.parametrize(("degree", "mode"), [(2, "trim"), (3, "trim")])  # mask mode: the transformer's tests
def test_sp_equals_single_process_at_padded_shape(engines, degree, mode):
    expected = _generate(engines(), negative_prompt="blurry")
    assert expected.shape == (1, FRAMES, HEIGHT, WIDTH, 3)
    np.testing.assert_allclose(_generate(engines(degree, mode), negative_prompt="blurry"), expected, rtol=0, atol=1e-5)


def test_cfg_parallel_equals_one_group(engines):
    expected = _generate(engines(), negative_prompt="blurry", guidance_scale=5.0)
    actual = _generate(engines(1, "trim", cfg=2), negative_prompt="blurry", guidance_scale=5.0)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


def test_outputs_frames_and_rounding(engines):
    omni = engines()
    clips = omni.generate(PROMPT, height=HEIGHT, width=WIDTH, num_frames=6, num_inference_steps=2, seed=1, n=2)
    out = omni.last_output
    assert (out.num_frames, out.fps, out.width, out.height) == (5, 24, WIDTH, HEIGHT)  # 6 -> 4k+1 = 5
    assert len(clips) == 2 and len(clips[0]) == 5 and clips[0][0].size == (WIDTH, HEIGHT)
    raw = omni.generate(
        PROMPT, height=HEIGHT, width=WIDTH, num_frames=5, num_inference_steps=2, fps=8, output_type="uint8"
    )
    assert raw[0].dtype == np.uint8 and raw[0].shape == (5, HEIGHT, WIDTH, 3) and omni.last_output.fps == 8


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"num_frames": 0}, "num_frames"),
        ({"num_frames": 100_000}, "num_frames"),
        ({"fps": 0}, "fps"),
        ({"true_cfg_scale": 4.0}, "true_cfg_scale"),
        ({"image": b"not an image"}, "image"),
    ],
)
def test_bad_video_input_names_the_field(engines, kwargs, field):
    with pytest.raises(ValueError, match=rf"^{field}\b"):
        engines().generate(PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=2, **kwargs)


def test_a_video_no_gpu_steps_through_in_time_is_refused_before_any_worker_runs(engines, monkeypatch):
    omni = engines()

    def must_not_run(*args, **kwargs):
        raise AssertionError("the workers were sent a request the engine must refuse")

    monkeypatch.setattr(omni.engine.executor, "execute", must_not_run)
    # 4096x4096 x 257 frames: 256 x 256 tokens x 65 latent frames, about 4.3M a step.
    with pytest.raises(RequestError) as refused:
        omni.generate(PROMPT, height=4096, width=4096, num_frames=257, num_inference_steps=2)
    assert refused.value.param == "width" and "4259840 tokens per denoising step" in str(refused.value)


def test_unmasked_padding_is_close_not_equal_and_warns_once_per_worker(engines, capfd):
    expected = _generate(engines())
    with Omni(MODEL, ulysses_degree=2, trim_sp_padding=False) as omni:
        outputs = [_generate(omni)]
    conformance.assert_engine_unmasked_padding_warns_once_per_worker(outputs, expected, capfd.readouterr().err)


def test_cli_generate_writes_a_playable_mp4(tmp_path):
    output = tmp_path / "clip.mp4"
    command = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "generate", MODEL, "--prompt", PROMPT]
    command += ["--size", f"{WIDTH}x{HEIGHT}", "--num-frames", "9", "--fps", "12", "--steps", "2", "--seed", "1"]
    command += ["--output", str(output)]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=300, env=dict(os.environ))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"Wrote {output} ({WIDTH}x{HEIGHT}, 9 frames at 12 fps" in proc.stdout
    with av.open(io.BytesIO(output.read_bytes())) as container:
        stream = container.streams.video[0]
        frames = list(container.decode(stream))
        assert stream.codec_context.name == "h264" and stream.average_rate == 12
    assert len(frames) == 9 and (frames[0].width, frames[0].height) == (WIDTH, HEIGHT)
