"""Video with sound through the videos API: `vllm-omni serve tiny/ltx-2 --ulysses-degree 2` and the `openai` client.

LTX-2 makes its sound with the video: the MP4 the API delivers has an H.264 video stream and an AAC audio stream
(24 kHz stereo), both as long as the requested `seconds`; an image (`input_reference`) runs image-to-video on the
same checkpoint, with sound too; POST /v1/videos/sync answers with the same file. 224x160 is 7x5 latent pixels;
1 s at 9 fps is 9 frames (8k + 1), 2 latent frames: 70 video tokens and 9 audio tokens, the audio stream padded at
Ulysses 2.
"""

from __future__ import annotations

import io

import av
import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image
from server_process import HTTP_TIMEOUT_S, sha256, start_server

MODEL = "tiny/ltx-2"
PROMPT = "A cat walks on the grass and meows, realistic style."
BODY = {"num_inference_steps": 2, "fps": 9, "seed": 7}

# slow: a real server process, started per module
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-ltx2")
    srv = start_server([MODEL, "--ulysses-degree", "2", "--video-dir", str(root / "videos")], root / "server.log")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def streams(data: bytes) -> dict:
    """What the MP4 holds: its video (codec, frames, size, rate, seconds) and audio (codec, rate, channels, seconds)."""
    with av.open(io.BytesIO(data)) as container:
        video, audio = container.streams.video[0], container.streams.audio[0]
        frames, samples = [], 0
        for frame in container.decode(video, audio):  # one pass over the interleaved packets
            if isinstance(frame, av.VideoFrame):
                frames.append(frame.to_ndarray(format="rgb24"))
            else:
                samples += frame.samples
        return {
            "video": (video.codec_context.name, len(frames), frames[0].shape, video.average_rate),
            "video_seconds": float(video.duration * video.time_base),
            "audio": (audio.codec_context.name, audio.rate, audio.channels),
            "audio_seconds": float(audio.duration * audio.time_base),
            "decoded_seconds": samples / audio.rate,
        }


@pytest.mark.parametrize("with_image", [False, True], ids=["text-to-video", "image-to-video"])
def test_the_delivered_mp4_has_a_video_and_an_audio_stream_of_the_requested_length(client, with_image):
    extra = {}
    if with_image:
        png = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (160, 224, 3), np.uint8)).save(png, format="PNG")
        extra["input_reference"] = ("cat.png", png.getvalue(), "image/png")
    video = client.videos.create_and_poll(
        model=MODEL, prompt=PROMPT, size="224x160", seconds="1", extra_body=BODY, poll_interval_ms=50, **extra
    )
    assert (video.status, video.size, video.model_extra["num_frames"]) == ("completed", "224x160", 9), video
    found = streams(client.videos.download_content(video.id).read())
    assert found["video"] == ("h264", 9, (160, 224, 3), 9)
    assert found["audio"] == ("aac", 24000, 2)
    assert found["video_seconds"] == pytest.approx(1.0, abs=1e-6)
    # The model's sound lasts the video's second, less its causal decoder's 3 of 100 mel frames a second; the AAC
    # encoder adds its priming frame when decoded.
    assert found["audio_seconds"] == pytest.approx(1.0, abs=0.05)
    assert found["decoded_seconds"] == pytest.approx(1.0, abs=0.1)


def test_the_sync_route_answers_the_same_mp4_with_its_sound(server, client):
    """POST /v1/videos/sync: the bytes the async route stores for the same seed, sound included."""
    body = dict(BODY, model=MODEL, prompt=PROMPT, size="224x160", seconds="1", seed=11)
    answer = httpx.post(f"{server.url}/v1/videos/sync", json=body, timeout=HTTP_TIMEOUT_S)
    assert answer.status_code == 200, answer.text
    found = streams(answer.content)
    assert found["audio"] == ("aac", 24000, 2) and found["video"][:2] == ("h264", 9)
    polled = client.videos.create_and_poll(
        model=MODEL, prompt=PROMPT, size="224x160", seconds="1", extra_body=dict(BODY, seed=11), poll_interval_ms=50
    )
    assert sha256(client.videos.download_content(polled.id).read()) == sha256(answer.content)
