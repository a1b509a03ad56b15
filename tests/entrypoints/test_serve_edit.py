"""`vllm-omni serve tiny/qwen-image-edit --ulysses-degree 2`: multipart edits over real HTTP.

One server for the module, with a 1 MB upload limit so an oversized upload is cheap to send,
and a largest side of 1248 (a 3:2 source's `size=auto`, 1248x832, fits; a 2:1 one's, 1440x736, does not).
Covers the openai client (one file as `image`, a list as `image[]`), CONTEXT.md's curl form,
`size=auto`, and input that must be refused: unreadable, oversized, a decompression bomb, very
thin sources, prompts beyond the token limit, an automatic size beyond the largest side, and
image data that only the workers find damaged (a 400, the workers keep serving).
"""

from __future__ import annotations

import io
import zlib

import httpx
import numpy as np
import pytest
from openai import OpenAI
from PIL import Image
from server_process import HTTP_TIMEOUT_S, decode_image, start_server

pytestmark = pytest.mark.slow  # real server processes (started per module)

MODEL = "tiny/qwen-image-edit"
PROMPT = "Add a cool hat to the cat."
UPLOAD_LIMIT = 1_000_000
MAX_SIDE = 1248


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-edit") / "server.log"
    args = [MODEL, "--ulysses-degree", "2", "--max-upload-bytes", str(UPLOAD_LIMIT), "--max-image-size", str(MAX_SIDE)]
    srv = start_server(args, log)
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def png(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def source_png(width: int = 300, height: int = 200) -> bytes:
    """A gradient, 300x200 by default (not square, so `size=auto` shows the aspect ratio is kept)."""
    gradient = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None].repeat(height, 0).repeat(3, 2)
    return png(Image.fromarray(gradient))


def bomb_png() -> bytes:
    """A few hundred bytes whose header claims 60000x60000 pixels."""
    data = bytearray(png(Image.new("RGB", (8, 8))))
    data[16:24] = (60000).to_bytes(4, "big") * 2  # IHDR width and height
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # a valid chunk CRC: readers check it
    return bytes(data)


def cut_jpeg() -> bytes:
    """A JPEG cut in half: its header reads well (so it is queued), its data does not decode (in the workers)."""
    buffer = io.BytesIO()
    Image.open(io.BytesIO(source_png())).save(buffer, format="JPEG")
    return buffer.getvalue()[: len(buffer.getvalue()) // 2]


def edit(server, files, **fields) -> httpx.Response:
    data = {"model": MODEL, "prompt": PROMPT, "size": "272x208", "num_inference_steps": "2", "seed": "5"}
    data.update({k: str(v) for k, v in fields.items()})
    return httpx.post(f"{server.url}/v1/images/edits", data=data, files=files, timeout=HTTP_TIMEOUT_S)


@pytest.mark.parametrize(
    "files,fields,param,words",
    [
        ({"image": ("a.png", b"definitely not an image", "image/png")}, {}, "image", "not a readable image"),
        ({"image": ("a.png", b"\x89PNG" + bytes(UPLOAD_LIMIT), "image/png")}, {}, "image", "upload limit"),
        ({"image": ("bomb.png", bomb_png(), "image/png")}, {}, "image", "pixels"),
        (None, {}, "image", "image is required"),
        ({"image": ("a.png", source_png(), "image/png"), "mask": ("m.png", source_png(), "image/png")}, {}, "mask", ""),
        (
            [("image[]", ("a.png", source_png(), "image/png")), ("image[]", ("b.png", source_png(), "image/png"))],
            {},
            "image",
            "at most 1 image",
        ),
        ({"image": ("a.png", source_png(), "image/png")}, {"size": "abc"}, "size", "WIDTHxHEIGHT"),
        ({"image": ("a.png", source_png(), "image/png")}, {"num_inference_steps": "0"}, "num_inference_steps", ""),
        ({"image": ("a.png", source_png(), "image/png")}, {"n": "two"}, "n", "integer"),
        ({"image": ("a.png", source_png(), "image/png")}, {"response_format": "url"}, "response_format", ""),
        # Found by a hostile-client probe:
        ({"image": ("a.png", source_png(1, 8000), "image/png")}, {}, "image", "100:1"),
        ({"image": ("a.png", source_png(8000, 1), "image/png")}, {}, "image", "100:1"),
        ({"image": ("a.png", source_png(), "image/png")}, {"prompt": " the" * 1025}, "prompt", "the limit is 1024"),
        ({"image": ("a.png", source_png(400, 200), "image/png")}, {"size": "auto"}, "size", "1440x736"),
        ({"image": ("a.jpg", cut_jpeg(), "image/jpeg")}, {}, "image", "cannot be decoded"),
    ],
    ids=[
        "unreadable",
        "oversized",
        "decompression-bomb",
        "no-image",
        "mask",
        "two-images-for-a-one-image-model",
        "bad-size",
        "zero-steps",
        "bad-n",
        "url-response",
        "thin-source-1x8000",
        "thin-source-8000x1",
        "prompt-beyond-the-token-limit",
        "auto-size-beyond-the-largest-side",
        "damaged-data-found-in-the-workers",
    ],
)
def test_bad_upload_or_field_is_400_naming_it(server, files, fields, param, words):
    response = edit(server, files, **fields)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]
    assert "object at 0x" not in error["message"]  # no Python reprs (an unreadable upload once said <_io.BytesIO ...>)


def test_a_model_not_served_is_404_model_not_found(server):
    response = edit(server, {"image": ("a.png", source_png(), "image/png")}, model="Qwen/Nope")
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found") and "not served here" in error["message"]


def test_json_body_on_the_edits_endpoint_is_400(server):
    response = httpx.post(f"{server.url}/v1/images/edits", json={"prompt": PROMPT}, timeout=30)
    assert response.status_code == 400 and "multipart/form-data" in response.json()["error"]["message"]


# The server keeps serving after all of the above.
def test_openai_client_edits_one_image_sent_as_image(server, client):
    start = server.log_size()
    response = client.images.edit(
        model=MODEL,
        image=("cat.png", source_png(), "image/png"),
        prompt=PROMPT,
        size="272x208",
        response_format="b64_json",
        extra_body={"num_inference_steps": 2, "seed": 5},
    )
    assert decode_image(response.data[0].b64_json).size == (272, 208)
    assert response.model_extra["seed"] == 5 and response.size == "272x208"
    server.wait_for_log(r"DiffusionEngine\.step breakdown: preprocess=", start)


def test_openai_client_sends_a_list_as_image_brackets_and_size_auto_keeps_the_aspect(server, client):
    # The client sends a list as `image[]` parts. size=auto: the source's 3:2 aspect ratio at about 1 MP.
    response = client.images.edit(
        model=MODEL,
        image=[("cat.png", source_png(), "image/png")],
        prompt=PROMPT,
        size="auto",
        extra_body={"num_inference_steps": 2, "seed": 6},
    )
    image = decode_image(response.data[0].b64_json)
    assert image.size == (response.model_extra["width"], response.model_extra["height"])
    assert image.width % 16 == 0 and image.height % 16 == 0
    assert abs(image.width / image.height - 1.5) < 0.05
    assert 0.8e6 < image.width * image.height < 1.2e6


def test_curl_form_from_context_md(server):
    # CONTEXT.md's curl -F form, with the tiny model, a smaller size and 2 steps.
    response = httpx.post(
        f"{server.url}/v1/images/edits",
        data={
            "model": MODEL,
            "prompt": PROMPT,
            "negative_prompt": "' '",
            "size": "272x208",
            "num_inference_steps": "2",
            "guidance_scale": "4.0",
            "seed": "42",
            "response_format": "b64_json",
        },
        files={"image": ("cat.png", source_png(), "image/png")},
        timeout=HTTP_TIMEOUT_S,
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["seed"] == 42 and body["size"] == "272x208"
    assert decode_image(body["data"][0]["b64_json"]).size == (272, 208)
