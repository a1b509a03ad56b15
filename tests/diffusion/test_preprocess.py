"""The engine's request checks (preprocess.py), without workers, on the tiny Qwen-Image folders.

Regressions of a hostile-client probe: lone surrogates, prompts longer than the pipeline reads
(refused, never cut or left to fail in a worker), very thin source images, sizes the pipeline
picks by itself (checked against the limits, then passed on), `n: true`, unreadable uploads.
Also: queued requests carry the compressed upload, and the registry's restated size and prompt
rules agree with the diffusers pipelines they describe.
"""

from __future__ import annotations

import inspect
import io
import zlib

import pytest
from PIL import Image

from vllm_omni.diffusion.data import EngineLimits, GenerationParams, RequestError
from vllm_omni.diffusion.loader import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.models.registry import REGISTRY
from vllm_omni.diffusion.preprocess import RequestPreprocessor

_folders: dict[str, object] = {}


def preprocessor(model: str, **limits) -> RequestPreprocessor:
    if model not in _folders:
        _folders[model] = resolve_model_path(model)
    path = _folders[model]
    return RequestPreprocessor(read_pipeline_spec(path), EngineLimits(**limits), path)


@pytest.fixture(scope="module")
def generate():
    return preprocessor("tiny/qwen-image")


@pytest.fixture(scope="module")
def edit_plus():
    return preprocessor("tiny/qwen-image-edit-plus")


def check(pre: RequestPreprocessor, prompt: str = "a cat", **fields):
    return pre(GenerationParams(prompt=prompt, **fields), "req-test", 1)


def refused(pre: RequestPreprocessor, prompt: str = "a cat", **fields) -> RequestError:
    with pytest.raises(RequestError) as caught:
        check(pre, prompt, **fields)
    return caught.value


def png(width: int, height: int) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (width, height), "orange").save(buffer, format="PNG")
    return buffer.getvalue()


def words(pre: RequestPreprocessor, count: int) -> str:
    """A prompt of exactly `count` tokens in the model's tokenizer."""
    text = " the" * count
    assert len(pre.tokens.tokenizer(text)["input_ids"]) == count
    return text


@pytest.mark.parametrize("field", ["prompt", "negative_prompt"])
def test_a_lone_surrogate_is_bad_input_naming_its_field(generate, field):
    fields = {"prompt": "cat \ud800"} if field == "prompt" else {"negative_prompt": "dog \udfff"}
    error = refused(generate, **fields)
    assert error.param == field and "lone surrogate" in str(error)


def test_a_prompt_longer_than_the_pipeline_reads_is_refused_not_cut(generate):
    # Qwen-Image keeps 512 text tokens: the prompt and the 5 that close its chat template.
    assert check(generate, words(generate, 507)).prompt
    error = refused(generate, words(generate, 508))
    assert error.param == "prompt" and "508 tokens; the limit is 507" in str(error)
    error = refused(generate, negative_prompt=words(generate, 600))
    assert error.param == "negative_prompt"


def test_edit_prompts_are_limited_by_the_server_not_left_to_fail_in_a_worker():
    edit = preprocessor("tiny/qwen-image-edit", max_prompt_tokens=300)
    source = png(300, 200)
    assert check(edit, words(edit, 300), image=source).prompt
    error = refused(edit, words(edit, 301), image=source)
    assert error.param == "prompt" and "301 tokens; the limit is 300" in str(error)
    assert preprocessor("tiny/qwen-image-edit").max_prompt_tokens == EngineLimits().max_prompt_tokens


def test_a_huge_prompt_is_refused_without_being_tokenized(generate, monkeypatch):
    def must_not_run(*args, **kwargs):
        raise AssertionError("tokenized a prompt that could only be refused")

    monkeypatch.setattr(generate.tokens, "tokenizer", must_not_run)
    error = refused(generate, "a" * 1_000_000)
    assert error.param == "prompt" and "1000000 characters" in str(error)


@pytest.mark.parametrize("size", [(1, 8000), (8000, 1), (1000, 1)])
def test_very_thin_sources_are_bad_input(edit_plus, size):
    error = refused(edit_plus, image=png(*size), height=64, width=64)
    assert error.param == "image" and "100:1" in str(error)


def test_sizes_the_pipeline_picks_itself_are_checked_against_the_limit(edit_plus):
    # A 100:1 source is usable at an explicit size; size=auto would make it 10240x96.
    assert (check(edit_plus, image=png(100, 1), height=64, width=64).width, 64) == (64, 64)
    error = refused(edit_plus, image=png(100, 1))
    assert error.param == "width" and "10240x96" in str(error) and "4096" in str(error)

    small = preprocessor("tiny/qwen-image", max_image_size=512)
    error = refused(small)
    assert error.param in ("width", "height") and "1024x1024" in str(error) and "512" in str(error)
    assert (check(small, height=512, width=512).height, 512) == (512, 512)

    edit = preprocessor("tiny/qwen-image-edit", max_image_size=512)
    error = refused(edit, image=png(400, 300))
    assert "1184x896" in str(error)  # a 4:3 source at about 1 MP


def test_the_size_the_pipeline_would_pick_is_passed_on_explicitly(generate):
    request = check(generate)
    assert (request.width, request.height) == (1024, 1024)
    edit = preprocessor("tiny/qwen-image-edit")
    request = check(edit, image=png(400, 300))
    assert (request.width, request.height) == (1184, 896)
    request = check(edit, image=png(400, 300), height=208)  # the missing side comes from the source
    assert (request.width, request.height) == (1184, 208)


def test_an_upload_stays_compressed_in_the_request(edit_plus):
    data = png(300, 200)
    request = check(edit_plus, image=[data, png(20, 30)], height=64, width=64)
    assert request.images[0] is data and isinstance(request.images[1], bytes)
    image = Image.new("RGB", (40, 30))
    assert check(edit_plus, image=image, height=64, width=64).images == [image]


def test_unreadable_or_damaged_uploads_are_bad_input_with_a_plain_message(edit_plus):
    error = refused(edit_plus, image=b"definitely not an image", height=64, width=64)
    assert error.param == "image" and "not a readable image" in str(error) and "object at" not in str(error)
    cut = png(300, 200)[:-20]  # the PNG's last chunks are missing
    error = refused(edit_plus, image=cut, height=64, width=64)
    assert error.param == "image" and "damaged or cut short" in str(error)
    damaged = bytearray(png(300, 200))
    damaged[-20] ^= 0xFF  # inside the image data: its chunk's CRC no longer matches
    assert "damaged" in str(refused(edit_plus, image=bytes(damaged), height=64, width=64))


def test_booleans_are_not_numbers(generate):
    assert refused(generate, n=True).param == "n"
    assert refused(generate, guidance_scale=True).param == "guidance_scale"
    assert refused(generate, seed=False).param == "seed"


def test_decompression_bomb_is_refused_from_its_header(edit_plus):
    data = bytearray(png(8, 8))
    data[16:24] = (7000).to_bytes(4, "big") * 2  # IHDR width and height
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")
    error = refused(edit_plus, image=bytes(data), height=64, width=64)
    assert error.param == "image" and "49000000 pixels" in str(error)


# ---- the registry's restated rules against the diffusers pipelines --------------------------------


def test_the_size_rules_are_the_pipelines():
    import diffusers
    from diffusers.pipelines.qwenimage.pipeline_qwenimage_edit import calculate_dimensions

    generate = diffusers.QwenImagePipeline(**dict.fromkeys(inspect.signature(diffusers.QwenImagePipeline).parameters))
    side = generate.default_sample_size * generate.vae_scale_factor
    assert REGISTRY["QwenImagePipeline"].output_size([]) == (side, side)
    for name in ("QwenImageEditPipeline", "QwenImageEditPlusPipeline"):
        spec = REGISTRY[name]
        for width, height in [(300, 200), (200, 300), (1, 1), (4000, 3000), (100, 1), (1, 100), (1789, 1000)]:
            sources = [(7, 5), (width, height)] if spec.auto_size_source == -1 else [(width, height), (7, 5)]
            assert spec.output_size(sources) == calculate_dimensions(1024 * 1024, width / height)[:2]


def test_the_prompt_limit_is_what_the_generation_pipeline_reads(generate):
    import diffusers
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    folder = _folders["tiny/qwen-image"]
    text_encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder / "text_encoder").eval()
    pipe = diffusers.QwenImagePipeline(
        scheduler=None, vae=None, text_encoder=text_encoder, tokenizer=generate.tokens.tokenizer, transformer=None
    )
    kept = inspect.signature(diffusers.QwenImagePipeline.__call__).parameters["max_sequence_length"].default
    limit = REGISTRY["QwenImagePipeline"].max_prompt_tokens

    def stream_length(tokens: int) -> int:
        with torch.no_grad():
            embeds, _ = pipe.encode_prompt(words(generate, tokens), device="cpu", max_sequence_length=10**6)
        return embeds.shape[1]

    assert stream_length(limit) == kept  # the whole prompt and the template's end are read
    assert stream_length(limit + 1) > kept  # one more token and the pipeline would cut the text
