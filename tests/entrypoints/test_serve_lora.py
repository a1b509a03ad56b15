"""LoRA adapters over HTTP: `model: NAME` and `lora`, /v1/models, load and unload at run time, every error.

One server for the module: tiny/qwen-image with adapters "a" (a file) and "style" (the tiny adapter
`tiny/qwen-image-lora`, built on first use) from `--lora-modules`, `--allow-runtime-lora`,
`--max-lora-rank 8` and an API key. Adapters are random PEFT ones (tests/lora_files.py); images are compared
bit for bit at the same seed. The gate of the runtime routes and the start-up check of `--lora-modules` are
checked without a server.
"""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import httpx
import numpy as np
import openai
import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient
from lora_files import ATTENTION, make_adapter
from server_process import HTTP_TIMEOUT_S, decode_image, start_server

from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.model_source import resolve_model_path
from vllm_omni.entrypoints.openai.errors import install_error_handlers
from vllm_omni.entrypoints.openai.protocol import ImageEditRequest, VideoCreateRequest
from vllm_omni.entrypoints.openai.routes import models

pytestmark = pytest.mark.slow  # real server processes (started per module)

MODEL = "tiny/qwen-image"
KEY = "sk-lora"
AUTH = {"Authorization": f"Bearer {KEY}"}
FLUX2_TARGETS = (*ATTENTION, "to_qkv_mlp_proj")
REQUEST = {"size": "32x32", "num_inference_steps": 2, "seed": 7}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> SimpleNamespace:
    folder = tmp_path_factory.mktemp("lora-files")
    qwen = resolve_model_path(MODEL)
    corrupt = folder / "corrupt.safetensors"
    corrupt.write_bytes(b"\x07not a safetensors file" * 8)
    return SimpleNamespace(
        folder=folder,
        a=make_adapter(qwen, folder / "a", seed=0),
        b=make_adapter(qwen, folder / "b", seed=1),
        rank16=make_adapter(qwen, folder / "rank16", rank=16, seed=2),
        # The tiny models' attention layers share names and widths (the real ones differ in width): this one also
        # adapts FLUX.2's fused single-stream projection, which Qwen-Image has not.
        flux2=make_adapter(resolve_model_path("tiny/flux2"), folder / "flux2", seed=3, targets=FLUX2_TARGETS),
        corrupt=corrupt,
    )


@pytest.fixture(scope="module")
def server(files):
    modules = ["--lora-modules", f"a={files.a}", "style=tiny/qwen-image-lora"]
    args = [MODEL, *modules, "--allow-runtime-lora", "--max-lora-rank", "8"]
    srv = start_server([*args, "--api-key", KEY], files.folder / "server.log")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key=KEY, max_retries=0, timeout=HTTP_TIMEOUT_S)


def image(client: openai.OpenAI, model: str = MODEL, **extra) -> np.ndarray:
    response = client.images.generate(model=model, prompt="a red cube", extra_body={**REQUEST, **extra})
    return np.asarray(decode_image(response.data[0].b64_json))


def admin(server, route: str, **body) -> httpx.Response:
    return httpx.post(f"{server.url}/v1/{route}", json=body, headers=AUTH, timeout=HTTP_TIMEOUT_S)


def test_model_names_the_adapter_as_the_lora_field_does(client):
    base = image(client)
    by_model = image(client, "a")
    assert not np.array_equal(by_model, base)
    assert np.array_equal(image(client, lora={"name": "a"}), by_model)
    half = image(client, lora={"name": "a", "scale": 0.5})
    assert not np.array_equal(half, by_model) and not np.array_equal(half, base)
    assert np.array_equal(image(client, "a", lora={"scale": 0.5}), half)  # `model` names it, `lora` scales it
    chat = client.chat.completions.create(
        model="a", messages=[{"role": "user", "content": "a red cube"}], extra_body=REQUEST
    )
    url = chat.choices[0].message.content[0]["image_url"]["url"]
    assert np.array_equal(np.asarray(decode_image(url.split(",", 1)[1])), by_model)


def test_the_tiny_adapter_serves_by_its_name_and_changes_the_image(client):
    styled = image(client, "style")
    assert styled.shape == (32, 32, 3) and not np.array_equal(styled, image(client))


def test_models_lists_each_adapter_with_its_parent(client, server, files):
    assert [m.id for m in client.models.list().data] == [MODEL, "a", "style"]
    cards = httpx.get(f"{server.url}/v1/models", headers=AUTH).json()["data"]
    assert cards[0]["parent"] is None
    assert {k: cards[1][k] for k in ("id", "parent", "root")} == {
        "id": "a",
        "parent": MODEL,
        "root": str(files.a.resolve()),
    }
    assert cards[2]["parent"] == MODEL and (Path(cards[2]["root"]) / "pytorch_lora_weights.safetensors").is_file()


def test_an_adapter_loaded_at_run_time_serves_until_it_is_unloaded(client, server, files):
    response = admin(server, "load_lora_adapter", lora_name="b", lora_path=str(files.b))
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'b' added successfully."
    assert [m.id for m in client.models.list().data] == [MODEL, "a", "b", "style"]
    assert not np.array_equal(image(client, "b"), image(client, "a"))
    response = admin(server, "unload_lora_adapter", lora_name="b")
    assert response.status_code == 200 and response.text == "Success: LoRA adapter 'b' removed successfully."
    with pytest.raises(openai.NotFoundError) as caught:
        image(client, lora={"name": "b"})
    assert (caught.value.param, caught.value.code) == ("lora", "model_not_found")
    with pytest.raises(openai.NotFoundError) as caught:
        image(client, "b")  # a model name not served: 404, as vLLM answers
    assert (caught.value.param, caught.value.code) == ("model", "model_not_found")
    assert "not served here" in caught.value.message


@pytest.mark.parametrize(
    "model,lora,error,param",
    [
        (MODEL, {"name": "zz"}, openai.NotFoundError, "lora"),
        (MODEL, {"name": "a", "scale": "x"}, openai.BadRequestError, "lora"),
        (MODEL, {"name": "a", "scale": 1000}, openai.BadRequestError, "lora"),
        (MODEL, {"name": "a", "rank": 4}, openai.BadRequestError, "lora"),
        ("a", {"name": "zz"}, openai.BadRequestError, "lora"),  # model and lora name different adapters
        (MODEL, {"name": "a", "path": "/etc/passwd"}, openai.BadRequestError, "lora"),  # no loading by request
        (MODEL, "a", openai.BadRequestError, "lora"),  # an object, not a name
    ],
)
def test_a_bad_adapter_choice_names_its_field(client, model, lora, error, param):
    with pytest.raises(error) as caught:
        image(client, model, lora=lora)
    assert caught.value.param == param, caught.value.message


def test_a_bad_load_or_unload_names_its_field_and_the_server_keeps_serving(client, server, files):
    load, unload = "load_lora_adapter", "unload_lora_adapter"
    cases = [
        (load, {"lora_name": "m", "lora_path": str(files.folder / "missing")}, 400, "lora_path", "does not exist"),
        (load, {"lora_name": "c", "lora_path": str(files.corrupt)}, 400, "lora_path", "not a LoRA"),
        (load, {"lora_name": "f", "lora_path": str(files.flux2)}, 400, "lora_path", "to_qkv_mlp_proj"),
        (load, {"lora_name": "r", "lora_path": str(files.rank16)}, 400, "lora_path", "rank 16"),
        (load, {"lora_name": "a", "lora_path": str(files.b)}, 400, "lora_name", "already loaded"),
        (load, {"lora_name": "x"}, 400, "lora_path", "required"),
        (load, {"lora_name": "t", "lora_path": "tiny/nope-lora"}, 400, "lora_path", "unknown tiny adapter"),
        (unload, {"lora_name": "zz"}, 404, "lora_name", "not loaded"),
    ]
    for route, body, status, param, words in cases:
        response = admin(server, route, **body)
        assert response.status_code == status, (body, response.text)
        error = response.json()["error"]
        assert error["param"] == param and words in error["message"], (body, error)
    unauthorized = httpx.post(f"{server.url}/v1/load_lora_adapter", json=cases[1][1], timeout=HTTP_TIMEOUT_S)
    assert unauthorized.status_code == 401
    assert [m.id for m in client.models.list().data] == [MODEL, "a", "style"]
    assert image(client, "a").shape == (32, 32, 3)


@pytest.mark.parametrize("body", [ImageEditRequest, VideoCreateRequest])
def test_a_form_carries_lora_as_json_text(body):
    fields = {"prompt": "a red cube", "lora": '{"name": "a", "scale": 0.5}'}  # a form's values are text
    assert body.model_validate(fields).lora == {"name": "a", "scale": 0.5}


def test_runtime_routes_are_404_without_allow_runtime_lora():
    app = FastAPI()
    app.state.settings = SimpleNamespace(engine=EngineArgs(model=MODEL))  # the flag's default: off
    install_error_handlers(app)
    app.include_router(models.router)
    for route in ("load_lora_adapter", "unload_lora_adapter"):
        response = TestClient(app).post(f"/v1/{route}", json={})  # the gate answers before the body is read
        assert response.status_code == 404 and "--allow-runtime-lora" in response.json()["error"]["message"]


def test_a_bad_lora_modules_path_stops_the_start_naming_it(tmp_path):
    from vllm_omni.diffusion.engine.core import DiffusionEngine

    missing = tmp_path / "nope.safetensors"
    config = EngineArgs(model=MODEL, lora_modules=(f"x={missing}",)).validate().engine_config()
    with pytest.raises(ValueError, match=rf"--lora-modules x={missing}: .*does not exist"):
        DiffusionEngine(config)  # checked before any worker starts
