"""`vllm-omni serve tiny/flux2 --ulysses-degree 2`: FLUX.2 over real HTTP with the openai client.

A generation at a size that pads at Ulysses 2, a reference-image edit (FLUX.2 takes optional
reference images on the edits endpoint), and the fields FLUX.2 does not take, refused by name.
"""

from __future__ import annotations

import io

import numpy as np
import openai
import pytest
from openai import OpenAI
from PIL import Image
from server_process import HTTP_TIMEOUT_S, decode_image, start_server

MODEL = "tiny/flux2"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = start_server([MODEL, "--ulysses-degree", "2"], tmp_path_factory.mktemp("serve-flux2") / "server.log")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def reference_png() -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (96, 128, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_generation_at_a_padded_size(client, server):
    # 176x208 -> 11x13 = 143 image tokens: padded by one at Ulysses 2.
    result = client.images.generate(
        model=MODEL,
        prompt="a lighthouse at dusk",
        size="176x208",
        extra_body={"num_inference_steps": 2, "guidance_scale": 3.5, "seed": 3},
    )
    image = decode_image(result.data[0].b64_json)
    assert image.size == (176, 208)
    assert "DiffusionEngine.step breakdown" in server.log()


def test_reference_image_edit_uses_the_reference(client):
    def edit(seed: int) -> np.ndarray:
        result = client.images.edit(
            model=MODEL,
            image=("ref.png", reference_png(), "image/png"),
            prompt="the same scene at night",
            size="176x208",
            extra_body={"num_inference_steps": 2, "seed": seed},
        )
        return np.asarray(decode_image(result.data[0].b64_json))

    edited = edit(3)
    assert edited.shape == (208, 176, 3)
    np.testing.assert_array_equal(edit(3), edited)  # same seed, same reference: same image
    plain = client.images.generate(
        model=MODEL, prompt="the same scene at night", size="176x208", extra_body={"num_inference_steps": 2, "seed": 3}
    )
    assert not np.array_equal(np.asarray(decode_image(plain.data[0].b64_json)), edited)


@pytest.mark.parametrize(("field", "value"), [("negative_prompt", "blurry"), ("true_cfg_scale", 4.0)])
def test_fields_flux2_does_not_take_are_400_naming_them(client, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model=MODEL, prompt="a cat", size="176x208", extra_body={field: value})
    assert err.value.body["param"] == field and "Flux2Pipeline" in err.value.body["message"]
