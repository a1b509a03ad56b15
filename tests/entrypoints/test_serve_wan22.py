"""Wan2.2 through the videos API: `vllm-omni serve tiny/wan2.2-t2v --ulysses-degree 2` (both experts
sharded) and `tiny/wan2.2-i2v`, with the `openai` client.

80x112 at 17 frames is 5 x 7 tokens x 5 latent frames = 175 video tokens: Ulysses 2 pads them.
Text-to-video runs through `create_and_poll`; the MP4 decodes (PyAV) to the frames and size
asked, at the model's 16 fps. Image-to-video takes the image as `input_reference`, and without a
size keeps its aspect ratio. The text-to-video server allows run-time adapters: a file per expert
(HIGH,LOW) loads through `/v1/load_lora_adapter` and serves by name (its exactness against diffusers:
tests/entrypoints/test_omni_lora.py).
"""

from __future__ import annotations

import io
from pathlib import Path

import httpx
import numpy as np
import pytest
from lora_files import make_adapter
from openai import BadRequestError, OpenAI
from PIL import Image
from server_process import HTTP_TIMEOUT_S, start_server
from test_serve_videos import decode_mp4, finished, poll_until

from vllm_omni.diffusion.model_source import resolve_model_path

PROMPT = "A paper boat drifts across a pond at dawn."
STEPS = {"num_inference_steps": 2, "seed": 3}

# slow: a real server process, started per module
pytestmark = [pytest.mark.slow, pytest.mark.filterwarnings("ignore:The Sora API:DeprecationWarning")]


def _client(root, model: str, *flags: str):
    server = start_server([model, "--video-dir", str(root / "videos"), *flags], root / "server.log")
    return server, OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


@pytest.fixture(scope="module")
def t2v(tmp_path_factory):
    root = tmp_path_factory.mktemp("serve-wan-t2v")
    server, client = _client(root, "tiny/wan2.2-t2v", "--ulysses-degree", "2", "--allow-runtime-lora")
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


def test_a_file_per_expert_loads_at_run_time_serves_by_name_and_leaves_the_base_model_unchanged(t2v, tmp_path):
    url = str(t2v.base_url).rstrip("/")
    model = resolve_model_path("tiny/wan2.2-t2v")
    high, low = (make_adapter(model, tmp_path / name, seed=seed) for seed, name in ((21, "high"), (22, "low")))

    def load(name: str, path) -> httpx.Response:
        return httpx.post(f"{url}/load_lora_adapter", json={"lora_name": name, "lora_path": path}, timeout=30)

    def video(model: str) -> bytes:
        body = {"model": model, "prompt": PROMPT, "size": "112x80", "num_frames": 5, **STEPS}
        response = httpx.post(f"{url}/videos/sync", json=body, timeout=HTTP_TIMEOUT_S)
        assert response.status_code == 200, response.text
        return response.content

    missing = tmp_path / "nope.safetensors"
    for path, words in [
        (f"{high},{low},{high}", "3 paths in"),
        ([str(high), str(missing)], f"adapter 'bad' (its low-noise file, for transformer_2): {missing} does not exist"),
    ]:
        response = load("bad", path)
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "lora_path" and words in error["message"], error
    assert load("pair", f"{high},{low}").status_code == 200  # vLLM's body, HIGH,LOW in its lora_path
    assert load("listed", [str(low), str(high)]).status_code == 200  # or a list
    roots = {card["id"]: card.get("root") for card in httpx.get(f"{url}/models").json()["data"]}
    assert roots["pair"] == f"{Path(high).resolve()},{Path(low).resolve()}" and "bad" not in roots

    base = video("tiny/wan2.2-t2v")
    pair, listed = video("pair"), video("listed")
    assert len({base, pair, listed}) == 3  # each file in its own expert: swapped, another video
    assert video("tiny/wan2.2-t2v") == base  # a request without the adapter is unchanged after one with it
