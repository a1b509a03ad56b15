"""`vllm-omni serve tiny/flux2 --ulysses-degree 2` (and tiny/flux2-klein-kv): FLUX.2 over real HTTP with
the openai client.

A generation at a size that pads at Ulysses 2, a reference-image edit (FLUX.2 takes optional
reference images on the edits endpoint; klein KV keeps their keys and values after the first step),
and the fields FLUX.2 does not take, refused by name. One server per model, shared by its tests.
"""

from __future__ import annotations

import io

import numpy as np
import openai
import pytest
from openai import OpenAI
from PIL import Image
from server_process import HTTP_TIMEOUT_S, decode_image, start_server

pytestmark = pytest.mark.slow  # real server processes (started per module)

MODELS = ["tiny/flux2", "tiny/flux2-klein-kv"]
# Extra fields per model: FLUX.2-dev's embedded guidance; klein KV (step-distilled) takes none.
GUIDANCE = {"tiny/flux2": {"guidance_scale": 3.5}, "tiny/flux2-klein-kv": {}}


@pytest.fixture(scope="module", params=MODELS)
def model(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    srv = start_server([model, "--ulysses-degree", "2"], tmp_path_factory.mktemp("serve-flux2") / "server.log")
    yield srv
    srv.close()


@pytest.fixture(scope="module")
def client(server):
    return OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)


def reference_png(width: int = 128, height: int = 96) -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


def test_generation_at_a_padded_size(client, server, model):
    # 176x208 -> 11x13 = 143 image tokens: padded by one at Ulysses 2.
    result = client.images.generate(
        model=model,
        prompt="a lighthouse at dusk",
        size="176x208",
        extra_body={"num_inference_steps": 2, "seed": 3, **GUIDANCE[model]},
    )
    image = decode_image(result.data[0].b64_json)
    assert image.size == (176, 208)
    assert "DiffusionEngine.step breakdown" in server.log()


# klein KV: a second 5x5-token reference pads the reference stream at Ulysses 2 (step 1 extracts, step 2 reuses).
EXTRA_REFERENCES = {"tiny/flux2": [], "tiny/flux2-klein-kv": [("ref2.png", reference_png(80, 80), "image/png")]}


def test_reference_image_edit_uses_the_reference(client, model):
    def edit(seed: int) -> np.ndarray:
        result = client.images.edit(
            model=model,
            image=[("ref.png", reference_png(), "image/png"), *EXTRA_REFERENCES[model]],
            prompt="the same scene at night",
            size="176x208",
            extra_body={"num_inference_steps": 2, "seed": seed},
        )
        return np.asarray(decode_image(result.data[0].b64_json))

    edited = edit(3)
    assert edited.shape == (208, 176, 3)
    np.testing.assert_array_equal(edit(3), edited)  # same seed, same reference: same image
    plain = client.images.generate(
        model=model, prompt="the same scene at night", size="176x208", extra_body={"num_inference_steps": 2, "seed": 3}
    )
    assert not np.array_equal(np.asarray(decode_image(plain.data[0].b64_json)), edited)


@pytest.mark.parametrize(("field", "value"), [("negative_prompt", "blurry"), ("true_cfg_scale", 4.0)])
def test_fields_flux2_does_not_take_are_400_naming_them(client, model, field, value):
    with pytest.raises(openai.BadRequestError) as err:
        client.images.generate(model=model, prompt="a cat", size="176x208", extra_body={field: value})
    assert err.value.body["param"] == field and "Flux2" in err.value.body["message"]
