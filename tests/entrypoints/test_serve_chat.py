"""`POST /v1/chat/completions` over real HTTP, on a text-to-image and an edit model.

Five servers for the module, started together (one worker each: the route is the images routes'
path, the SP core is tested elsewhere): `tiny/qwen-image`, `tiny/qwen-image-edit` (a 1 MB upload
limit, so an oversized data URL is cheap to send), `tiny/glm-image` (an AR stage, then its DiT;
image-to-image too), `tiny/z-image` (text-to-image, and img2img for a request with a source image)
and `tiny/qwen-image-2.1` (RGBA images).
The same request through chat and through
/v1/images/generations or /v1/images/edits must give the same pixels; bad messages and parts are a
400 naming them; `stream: true` is a 400; a client that disconnects has its request cancelled.
"""

from __future__ import annotations

import base64
import io
import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest
from openai import BadRequestError, OpenAI
from PIL import Image
from server_process import HTTP_TIMEOUT_S, ServerProcess, decode_image, omni_command, open_request, server_env

from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS
from vllm_omni.entrypoints.openai.protocol import ChatCompletionRequest

pytestmark = pytest.mark.slow  # real server processes (started per module)

T2I, EDIT, GLM = "tiny/qwen-image", "tiny/qwen-image-edit", "tiny/glm-image"
ZIMAGE, QWEN21 = "tiny/z-image", "tiny/qwen-image-2.1"
PROMPT = "A cat holding a sign that says hello world."
EDIT_PROMPT = "Add a cool hat to the cat."
SIZE = {"height": 48, "width": 64}  # 4x3 tokens: the smallest useful run
UPLOAD_LIMIT = 1_000_000
LONG_STEPS = 4000  # only ends by being cancelled
PNG_URL = "data:image/png;base64,"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """{model: server}; both load at once, and stop at once."""
    logs = tmp_path_factory.mktemp("serve-chat")
    started = {
        T2I: ServerProcess(omni_command("serve", T2I, "--max-steps", str(LONG_STEPS)), logs / "t2i.log", server_env()),
        EDIT: ServerProcess(
            omni_command("serve", EDIT, "--max-upload-bytes", str(UPLOAD_LIMIT)), logs / "edit.log", server_env()
        ),
        GLM: ServerProcess(omni_command("serve", GLM), logs / "glm.log", server_env()),
        ZIMAGE: ServerProcess(omni_command("serve", ZIMAGE), logs / "z-image.log", server_env()),
        QWEN21: ServerProcess(omni_command("serve", QWEN21), logs / "qwen21.log", server_env()),
    }
    try:
        for server in started.values():
            server.wait_ready()
        yield started
    finally:
        with ThreadPoolExecutor(max_workers=len(started)) as pool:  # each close waits for its workers: together
            list(pool.map(lambda server: server.close(), started.values()))


def client_of(server) -> OpenAI:
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def pixels_of_url(url: str) -> np.ndarray:
    assert url.startswith(PNG_URL), url[:40]
    return np.asarray(decode_image(url[len(PNG_URL) :]))


def png_data_url(width: int = 300, height: int = 200) -> str:
    gradient = np.linspace(0, 255, width, dtype=np.uint8)[None, :, None].repeat(height, 0).repeat(3, 2)
    buffer = io.BytesIO()
    Image.fromarray(gradient).save(buffer, format="PNG")
    return PNG_URL + base64.b64encode(buffer.getvalue()).decode()


def chat(server, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/chat/completions", json=body, timeout=HTTP_TIMEOUT_S)


def images_generation(server, **fields) -> np.ndarray:
    return images_generations(server, **fields)[0]


def images_generations(server, **fields) -> list[np.ndarray]:
    response = httpx.post(f"{server.url}/v1/images/generations", json=fields, timeout=HTTP_TIMEOUT_S)
    assert response.status_code == 200, response.text
    return [np.asarray(decode_image(item["b64_json"])) for item in response.json()["data"]]


def test_the_chat_body_carries_the_declared_image_fields_with_width_and_height_apart():
    fields = ChatCompletionRequest.model_fields
    for f in SAMPLING_FIELDS:
        assert (f.name in fields) == (not f.video_only), f.name
        if f.name in fields:
            assert fields[f.name].annotation == (f.type | None), f.name
    assert "size" in fields


def test_openai_client_chat_gives_the_image_of_images_generations_for_the_same_seed(servers):
    server = servers[T2I]
    response = client_of(server).chat.completions.create(
        model=T2I,
        messages=[{"role": "user", "content": PROMPT}],
        extra_body={**SIZE, "num_inference_steps": 2, "seed": 7},
    )
    assert response.object == "chat.completion" and response.id.startswith("img-")
    choice = response.choices[0]
    assert choice.finish_reason == "stop" and choice.message.role == "assistant"
    content = choice.message.content  # the client keeps a list content as a list of dicts
    assert isinstance(content, list) and len(content) == 1 and content[0]["type"] == "image_url"
    image = pixels_of_url(content[0]["image_url"]["url"])
    assert image.shape == (48, 64, 3)
    assert response.model_extra["seed"] == 7 and response.model_extra["size"] == "64x48"
    reference = images_generation(server, prompt=PROMPT, size="64x48", num_inference_steps=2, seed=7)
    np.testing.assert_array_equal(image, reference)


def test_glm_image_through_chat_equals_images_generations_and_edits(servers):
    """Text-to-image, and image-to-image (a source as an image_url part, or a file on /v1/images/edits)."""
    server = servers[GLM]
    prompt = "a poster with the title 'OPEN'"
    response = client_of(server).chat.completions.create(
        model=GLM,
        messages=[{"role": "user", "content": prompt}],
        extra_body={"size": "64x64", "num_inference_steps": 2, "seed": 7},
    )
    image = pixels_of_url(response.choices[0].message.content[0]["image_url"]["url"])
    reference = images_generation(server, prompt=prompt, size="64x64", num_inference_steps=2, seed=7)
    np.testing.assert_array_equal(image, reference)

    # A 96x64 source (6 x 4 DiT tokens, 3 x 2 on the AR's grid); without a size the output takes its size.
    source = png_data_url(96, 64)
    parts = [{"type": "text", "text": prompt}, {"type": "image_url", "image_url": {"url": source}}]
    response = client_of(server).chat.completions.create(
        model=GLM,
        messages=[{"role": "user", "content": parts}],
        extra_body={"num_inference_steps": 2, "seed": 7},
    )
    edited = pixels_of_url(response.choices[0].message.content[0]["image_url"]["url"])
    assert edited.shape == (64, 96, 3) and response.model_extra["size"] == "96x64"
    files = client_of(server).images.edit(
        model=GLM,
        image=("source.png", base64.b64decode(source[len(PNG_URL) :]), "image/png"),
        prompt=prompt,
        extra_body={"num_inference_steps": 2, "seed": 7},
    )
    np.testing.assert_array_equal(np.asarray(decode_image(files.data[0].b64_json)), edited)
    without_source = images_generation(server, prompt=prompt, size="96x64", num_inference_steps=2, seed=7)
    assert np.abs(edited.astype(int) - without_source).max() > 0  # the source conditions the image

    off_grid = chat(server, model=GLM, messages=[{"role": "user", "content": prompt}], size="80x64")
    assert off_grid.status_code == 400 and off_grid.json()["error"]["param"] == "size", off_grid.text


def test_qwen_image_21_through_the_openai_client_images_and_chat_give_the_same_rgba_image(servers):
    client = client_of(servers[QWEN21])
    prompt = "a paper lantern floating on a lake"
    generated = client.images.generate(
        model=QWEN21, prompt=prompt, size="96x64", extra_body={"num_inference_steps": 2, "seed": 7}
    )
    image = np.asarray(decode_image(generated.data[0].b64_json))
    assert image.shape == (64, 96, 4)  # its VAE decodes RGBA: the PNG keeps the alpha channel
    response = client.chat.completions.create(
        model=QWEN21,
        messages=[{"role": "user", "content": prompt}],
        extra_body={"size": "96x64", "num_inference_steps": 2, "seed": 7},
    )
    np.testing.assert_array_equal(pixels_of_url(response.choices[0].message.content[0]["image_url"]["url"]), image)
    fields = {"num_inference_steps": 2, "seed": 7, "output_format": "jpeg"}
    jpeg = client.images.generate(model=QWEN21, prompt=prompt, size="96x64", extra_body=fields)
    assert np.asarray(decode_image(jpeg.data[0].b64_json)).shape == (64, 96, 3)  # JPEG has no alpha: dropped


def test_the_prompt_is_the_last_user_message_and_a_literal_extra_body_is_read(servers):
    server = servers[T2I]
    messages = [
        {"role": "system", "content": "You draw pictures."},
        {"role": "user", "content": "a dog"},
        {"role": "assistant", "content": [{"type": "text", "text": "here it is"}]},
        {"role": "user", "content": [{"type": "text", "text": "a red cat"}, {"type": "text", "text": "on a mat"}]},
    ]
    extra = {"size": "64x48", "num_inference_steps": 2, "seed": 9, "n": 2}
    response = chat(server, model=T2I, messages=messages, temperature=0.7, max_tokens=10, extra_body=extra)
    assert response.status_code == 200, response.text
    content = response.json()["choices"][0]["message"]["content"]
    assert len(content) == 2 and content[0]["image_url"]["url"] != content[1]["image_url"]["url"]
    # The reference is made the same way (n=2, one pipeline call of two rows): a call of one row sums its
    # floats in another order, and a uint8 value can round the other way.
    reference = images_generations(
        server, prompt="a red cat\non a mat", size="64x48", num_inference_steps=2, seed=9, n=2
    )
    for part, expected in zip(content, reference, strict=True):
        np.testing.assert_array_equal(pixels_of_url(part["image_url"]["url"]), expected)


def test_openai_client_chat_edit_with_an_image_part_equals_images_edits(servers):
    server, source = servers[EDIT], png_data_url()
    client = client_of(server)
    response = client.chat.completions.create(
        model=EDIT,
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": EDIT_PROMPT}, {"type": "image_url", "image_url": {"url": source}}],
            }
        ],
        extra_body={**SIZE, "num_inference_steps": 2, "seed": 5},
    )
    edited = pixels_of_url(response.choices[0].message.content[0]["image_url"]["url"])
    reference = client.images.edit(
        model=EDIT,
        image=("cat.png", base64.b64decode(source[len(PNG_URL) :]), "image/png"),
        prompt=EDIT_PROMPT,
        size="64x48",
        extra_body={"num_inference_steps": 2, "seed": 5},
    )
    np.testing.assert_array_equal(edited, np.asarray(decode_image(reference.data[0].b64_json)))


def test_z_image_generates_and_edits_through_the_openai_client_and_chat(servers):
    """Z-Image-Turbo's settings (guidance 0.0); an edit runs img2img from the source on the same checkpoint."""
    server, source = servers[ZIMAGE], png_data_url()
    client = client_of(server)
    knobs = {"num_inference_steps": 2, "guidance_scale": 0.0, "seed": 4}
    generated = client.images.generate(model=ZIMAGE, prompt=PROMPT, size="64x48", extra_body=knobs)
    image = np.asarray(decode_image(generated.data[0].b64_json))
    assert image.shape == (48, 64, 3)
    edited = client.images.edit(
        model=ZIMAGE,
        image=("cat.png", base64.b64decode(source[len(PNG_URL) :]), "image/png"),
        prompt=EDIT_PROMPT,
        size="64x48",
        extra_body=knobs,
    )
    edit = np.asarray(decode_image(edited.data[0].b64_json))
    assert edit.shape == (48, 64, 3) and not np.array_equal(edit, image)
    response = client.chat.completions.create(
        model=ZIMAGE,
        messages=[
            {
                "role": "user",
                "content": [{"type": "text", "text": EDIT_PROMPT}, {"type": "image_url", "image_url": {"url": source}}],
            }
        ],
        extra_body={**SIZE, **knobs},
    )
    np.testing.assert_array_equal(pixels_of_url(response.choices[0].message.content[0]["image_url"]["url"]), edit)


def test_stream_true_is_a_400_the_openai_client_raises(servers):
    with pytest.raises(BadRequestError, match="stream=true is not supported") as raised:
        client_of(servers[T2I]).chat.completions.create(
            model=T2I, messages=[{"role": "user", "content": PROMPT}], stream=True
        )
    assert raised.value.body["param"] == "stream"


def user(*parts) -> dict:
    """A body's messages: one user message of these content parts."""
    return {"messages": [{"role": "user", "content": list(parts)}]}


def image_part(url: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url}}


TEXT = {"type": "text", "text": PROMPT}
URL = "messages[0].content[1].image_url.url"  # the image part after TEXT
CASES = [  # model, what the body has (None: left out), the param named, words of the message
    (T2I, user(TEXT, image_part(png_data_url())), URL, "not accepted", "image-for-a-text-to-image-model"),
    (T2I, user(TEXT, image_part("https://example.com/cat.png")), URL, "data URL", "not-a-data-url"),
    (EDIT, user(TEXT, image_part(PNG_URL + "not base64!")), URL, "base64", "bad-base64"),
    (EDIT, user(TEXT, image_part(PNG_URL + base64.b64encode(b"abc").decode())), URL, "not a readable", "not-an-image"),
    (EDIT, user(TEXT, image_part(PNG_URL + "AAAA" * (UPLOAD_LIMIT // 3 + 2))), URL, "upload limit", "over-the-limit"),
    (EDIT, user(TEXT, {"type": "image_url", "image_url": "data:"}), URL[:-4], "object", "image-url-not-an-object"),
    (EDIT, user(TEXT), "messages[0].content", "image is required", "edit-without-an-image"),
    (T2I, user(TEXT, {"type": "input_audio"}), "messages[0].content[1].type", "'input_audio'", "unknown-part-type"),
    (T2I, user({"type": "text", "text": 5}), "messages[0].content[0].text", "string", "text-not-a-string"),
    (T2I, user("a cat"), "messages[0].content[0]", "object", "part-not-an-object"),
    (T2I, {"messages": [{"role": "user", "content": " "}]}, "messages[0].content", "non-empty", "empty-prompt"),
    (T2I, {"messages": [{"role": "user", "content": 5}]}, "messages[0].content", "or a list", "content-a-number"),
    (T2I, {"messages": [{"role": "wizard", "content": PROMPT}]}, "messages[0].role", "one of", "unknown-role"),
    (T2I, {"messages": [{"role": "system", "content": PROMPT}]}, "messages", "no user message", "no-user-message"),
    (T2I, {"messages": "a cat"}, "messages", "list", "messages-not-a-list"),
    (T2I, {"messages": None}, "messages", "required", "no-messages"),
    (T2I, {"size": "64x48", "width": None}, "size", "not both", "size-and-height"),
    (T2I, {"height": 0}, "height", "between", "zero-height"),
    (T2I, {"num_steps": 2}, "num_steps", "unknown field", "unknown-field"),
    (T2I, {"seed": 1, "extra_body": {"seed": 2}}, "seed", "given twice", "key-given-twice"),
    (T2I, {"extra_body": [1]}, "extra_body", "object", "extra-body-not-an-object"),
    (T2I, {"extra_body": {"extra_body": {}}}, "extra_body", "unknown field", "extra-body-in-extra-body"),
    (T2I, {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools", "no tools", "tools"),
    (T2I, {"logprobs": True}, "logprobs", "no tokens", "logprobs"),
    (T2I, {"response_format": {"type": "json_object"}}, "response_format", "images", "json-response-format"),
]


@pytest.mark.parametrize("model,body,param,words", [pytest.param(*case[:4], id=case[4]) for case in CASES])
def test_bad_messages_parts_and_fields_are_a_400_naming_them(servers, model, body, param, words):
    request = {"model": model, **user(TEXT), "num_inference_steps": 2, "seed": 1, **SIZE}
    request.update(body)
    request = {key: value for key, value in request.items() if value is not None}  # None: leave the key out
    response = chat(servers[model], **request)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_a_model_not_served_is_404_model_not_found(servers):
    response = chat(servers[T2I], model="no-such/model", **user(TEXT), num_inference_steps=2, **SIZE)
    assert response.status_code == 404, response.text
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("model", "model_not_found") and "not served here" in error["message"]


def test_a_client_that_disconnects_has_its_chat_request_cancelled(servers):
    server = servers[T2I]
    start = server.log_size()
    body = {"messages": [{"role": "user", "content": PROMPT}], **SIZE, "num_inference_steps": LONG_STEPS}
    sock = open_request(server.url, "/v1/chat/completions", body)
    request_id = server.wait_for_log(rf"Request (img-\w+) queued: size=64x48, steps={LONG_STEPS}", start).group(1)
    server.wait_for_log(rf"Request {request_id} running", start)
    sock.close()
    server.wait_for_log(rf"Request {request_id}: client disconnected, cancelling", start)
    step = int(server.wait_for_log(rf"request {request_id} cancelled at step (\d+)", start).group(1))
    assert step < LONG_STEPS


def test_chat_requests_are_counted_in_the_http_metrics(servers):
    text = httpx.get(f"{servers[T2I].url}/metrics").text
    counted = re.search(r'vllm_omni_http_requests_total\{[^}]*route="/v1/chat/completions"[^}]*status="200"', text)
    assert counted, text[-2000:]
