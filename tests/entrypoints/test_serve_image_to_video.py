"""Image-to-video through the videos API: `vllm-omni serve tiny/hunyuan-video-1.5-i2v` and the `openai` client.

The video takes its size from the input image (the checkpoint's size buckets): a 300x200 image
runs at 192x128 on the tiny checkpoint. The job reports that size from the moment it is created,
not "auto" until it finishes.
"""

from __future__ import annotations

import io

import numpy as np
import pytest
from openai import OpenAI
from PIL import Image
from server_process import HTTP_TIMEOUT_S, start_server
from test_serve_videos import PROMPT, decode_mp4, finished, poll_until

MODEL = "tiny/hunyuan-video-1.5-i2v"

# slow: a real server process, started per module
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-i2v")
    server = start_server([MODEL, "--video-dir", str(root / "videos")], root / "server.log")
    yield OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)
    server.close()


def test_an_image_to_video_job_reports_its_real_size_at_once_and_delivers_it(client):
    gradient = np.linspace(0, 255, 300, dtype=np.uint8)[None, :, None].repeat(200, 0).repeat(3, 2)
    png = io.BytesIO()
    Image.fromarray(gradient).save(png, format="PNG")
    video = client.videos.create(
        model=MODEL,
        prompt=PROMPT,
        seconds="1",
        input_reference=("cat.png", png.getvalue(), "image/png"),
        extra_body={"num_inference_steps": 2, "fps": 8, "seed": 3},
    )
    assert (video.status, video.size) == ("queued", "192x128")
    done = poll_until(client, video.id, finished)
    assert (done.status, done.size, done.model_extra["num_frames"]) == ("completed", "192x128", 9), done
    frames, codec, _ = decode_mp4(client.videos.download_content(video.id).read())
    assert (len(frames), frames[0].shape, codec) == (9, (128, 192, 3), "h264")
