"""Wan2.2 through the videos API: `vllm-omni serve tiny/wan2.2-t2v --ulysses-degree 2` (both experts
sharded) and `tiny/wan2.2-i2v`, with the `openai` client.

80x112 at 17 frames is 5 x 7 tokens x 5 latent frames = 175 video tokens: Ulysses 2 pads them.
Text-to-video runs through `create_and_poll`; the MP4 decodes (PyAV) to the frames and size
asked, at the model's 16 fps. Image-to-video takes the image as `input_reference`, and without a
size keeps its aspect ratio.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from openai import BadRequestError, OpenAI
from PIL import Image
from server_process import HTTP_TIMEOUT_S, start_server
from test_serve_videos import decode_mp4, finished, poll_until

PROMPT = "A paper boat drifts across a pond at dawn."
STEPS = {"num_inference_steps": 2, "seed": 3}

# slow: a real server process, started per module
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


def _client(root, model: str, *flags: str):
    server = start_server([model, "--video-dir", str(root / "videos"), *flags], root / "server.log")
    return server, OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    server, client = _client(tmp_path_factory.mktemp("serve-wan-t2v"), "tiny/wan2.2-t2v", "--ulysses-degree", "2")
    yield client
    server.close()


@pytest.fixture(scope="module")
def i2v(tmp_path_factory):
    server, client = _client(tmp_path_factory.mktemp("serve-wan-i2v"), "tiny/wan2.2-i2v")
    yield client
    server.close()


def test_text_to_video_create_and_poll_then_download(t2v):
    video = t2v.videos.create_and_poll(
        model="tiny/wan2.2-t2v", prompt=PROMPT, size="112x80", seconds="1", extra_body=STEPS, poll_interval_ms=50
    )
    # One second at the A14B checkpoints' 16 fps is 16 frames, rounded to 4k+1: 17.
    assert (video.status, video.size, video.model_extra["num_frames"]) == ("completed", "112x80", 17), video
    frames, codec, rate = decode_mp4(t2v.videos.download_content(video.id).read())
    assert (len(frames), frames[0].shape, codec, rate) == (17, (80, 112, 3), "h264", 16)


def test_bad_text_to_video_input_names_the_field(t2v):
    with pytest.raises(BadRequestError) as info:
        t2v.videos.create(model="tiny/wan2.2-t2v", prompt=PROMPT, size="112x80", extra_body={"true_cfg_scale": 4})
    assert info.value.body["param"] == "true_cfg_scale"
    with pytest.raises(BadRequestError) as info:
        t2v.videos.create(model="tiny/wan2.2-t2v", prompt="word " * 600, size="112x80")
    assert info.value.body["param"] == "prompt" and "limit is 511" in info.value.body["message"]


def test_image_to_video_with_input_reference(i2v):
    gradient = np.linspace(0, 255, 200, dtype=np.uint8)[None, :, None].repeat(100, 0).repeat(3, 2)
    png = io.BytesIO()
    Image.fromarray(gradient).save(png, format="PNG")
    video = i2v.videos.create(
        model="tiny/wan2.2-i2v",
        prompt=PROMPT,
        size="128x64",
        seconds="0.5",
        input_reference=("boat.png", png.getvalue(), "image/png"),
        extra_body=dict(STEPS, fps=8),
    )
    done = poll_until(i2v, video.id, finished)
    assert (done.status, done.size, done.model_extra["num_frames"]) == ("completed", "128x64", 5), done
    frames, _, rate = decode_mp4(i2v.videos.download_content(video.id).read())
    assert (len(frames), frames[0].shape, rate) == (5, (64, 128, 3), 8)
    with pytest.raises(BadRequestError) as info:
        i2v.videos.create(model="tiny/wan2.2-i2v", prompt=PROMPT, size="128x64", seconds="0.5")
    assert info.value.body["param"] in ("image", "input_reference")
