"""The engine's request checks (preprocess.py), without workers, on the tiny model folders.

Regressions of a hostile-client probe: lone surrogates, prompts longer than the pipeline reads
(refused, never cut or left to fail in a worker), very thin source images, sizes the pipeline
picks by itself (checked against the limits, then passed on), `n: true`, unreadable uploads,
and requests whose denoising steps no GPU finishes within the stall deadline (tokens per step,
reference images included). Also: queued requests carry the compressed upload, and the
registry's restated size, token and prompt rules agree with the diffusers pipelines they describe.
"""

from __future__ import annotations

import inspect
import io
import zlib

import pytest
from PIL import Image

from vllm_omni.diffusion.config import EngineLimits
from vllm_omni.diffusion.engine.preprocess import RequestPreprocessor
from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.models.registry import REGISTRY
from vllm_omni.diffusion.models.spec import bucket_size
from vllm_omni.diffusion.request import GenerationParams, RequestError

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


@pytest.fixture(scope="module")
def hunyuan():
    return preprocessor("tiny/hunyuan-video-1.5")


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
    assert refused(generate, priority=True).param == "priority"


def test_the_checked_request_carries_its_priority_and_its_work_for_the_fair_policy(generate, edit_plus):
    request = check(generate, width=272, height=208, num_inference_steps=3, n=2, priority=-5)
    assert request.priority == -5 and request.work == 3 * (17 * 13) * 2  # steps x tokens per step x images
    assert check(generate, width=272, height=208).priority == 0
    # Sources that join the sequence count: a 64x64 output (16 tokens), its source encoded at 1 MP (4096 tokens).
    assert check(edit_plus, image=png(64, 64), width=64, height=64, num_inference_steps=2).work == 2 * (16 + 4096)


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


# ---- the work of one denoising step ---------------------------------------------------------------


def test_a_video_no_gpu_steps_through_in_time_is_refused_naming_the_size(hunyuan):
    # 4096x4096 x 257 frames: 256 x 256 tokens x 65 latent frames, hours a step on any GPU.
    error = refused(hunyuan, width=4096, height=4096, num_frames=257)
    assert error.param == "width"  # over HTTP: `size`
    message = str(error)
    assert "4259840 tokens per denoising step" in message and "the limit is 131072" in message
    assert "--max-tokens-per-step" in message


def test_the_default_limits_admit_the_documented_sizes(hunyuan, generate, edit_plus):
    assert check(hunyuan, width=1280, height=720, num_frames=121).num_frames == 121  # 111600 tokens
    assert check(hunyuan, width=848, height=480, num_frames=257).num_frames == 257  # 103350
    assert check(generate, width=2048, height=2048).width == 2048  # 16384
    assert check(generate, width=4096, height=4096).width == 4096  # 65536: the size limit binds first
    assert check(edit_plus, image=[png(1024, 1024)] * 3, width=4096, height=4096).width == 4096
    # FLUX.2 at the largest size with four 1 MP references is exactly the default: 65536 + 4 x 4096.
    flux2 = preprocessor("tiny/flux2")
    assert check(flux2, image=[png(1024, 1024)] * 4, width=4096, height=4096).width == 4096
    error = refused(
        preprocessor("tiny/flux2", max_input_images=5), image=[png(1024, 1024)] * 5, width=4096, height=4096
    )
    assert error.param == "image" and "86016 tokens" in str(error) and "the limit is 81920" in str(error)


def test_a_request_at_the_limit_is_accepted_and_the_field_that_passes_it_is_named():
    # 848x480 x 121 frames is 53 x 30 x 31 = 49290 tokens.
    video = preprocessor("tiny/hunyuan-video-1.5", max_tokens_per_step=49290)
    assert check(video, width=848, height=480, num_frames=121).num_frames == 121
    error = refused(video, width=848, height=480, num_frames=125)  # 32 latent frames: the length passes it
    assert error.param == "num_frames" and "50880 tokens" in str(error) and "fewer frames" in str(error)
    error = refused(video, width=864, height=480, num_frames=121)  # 54 x 30 x 31: too large at the default length
    assert error.param == "width" and "smaller size" in str(error)

    image = preprocessor("tiny/qwen-image", max_tokens_per_step=6889)
    assert check(image, width=1328, height=1328).width == 1328  # 83 x 83 = 6889
    error = refused(image, width=1344, height=1328)
    assert error.param == "width" and "6972 tokens" in str(error)
    # Counted after rounding: 1789x1789 runs at 1776x1776, 111 x 111 = 12321 tokens.
    assert check(preprocessor("tiny/qwen-image", max_tokens_per_step=12321), width=1789, height=1789).width == 1776


def test_source_images_count_where_the_pipeline_joins_them_to_the_sequence():
    # 2048x2048 (16384) and a 1024x704 source, encoded at 1248x864 (4212): the 20596 tokens of
    # upstream's Qwen-Image-Edit log ("Auto-padded sequence from 20596 to 20600").
    source = png(1024, 704)
    assert check(preprocessor("tiny/qwen-image-edit", max_tokens_per_step=20596), image=source, width=2048, height=2048)
    error = refused(
        preprocessor("tiny/qwen-image-edit", max_tokens_per_step=20595), image=source, width=2048, height=2048
    )
    assert (
        error.param == "image"
        and "20596 tokens" in str(error)
        and "128 x 128 tokens + 4212 of the 1 input image(s)" in str(error)
    )


def test_image_to_video_counts_the_bucket_it_picks_and_names_the_frames():
    # The tiny checkpoint's target_size is 160: a 3:2 image runs at 192x128, 12 x 8 tokens a frame;
    # 121 frames (the default, passed on) are 31 latent frames: 2976 tokens.
    source = png(300, 200)
    request = check(preprocessor("tiny/hunyuan-video-1.5-i2v", max_tokens_per_step=2976), image=source)
    # The pipeline sizes the video itself; the request carries that size (the job reports it from the start).
    assert (request.num_frames, request.width, request.height) == (121, 192, 128)
    error = refused(preprocessor("tiny/hunyuan-video-1.5-i2v", max_tokens_per_step=2975), image=source)
    assert error.param == "num_frames" and "2976 tokens" in str(error)


def test_the_video_size_and_length_the_pipeline_would_pick_are_checked_and_passed_on(hunyuan):
    request = check(hunyuan)
    assert (request.width, request.height, request.num_frames) == (848, 480, 121)
    error = refused(preprocessor("tiny/hunyuan-video-1.5", max_frames=61))
    assert error.param == "num_frames" and "121 frames" in str(error) and "61" in str(error)


# ---- FLUX.2 reference images ------------------------------------------------------------------------


def test_flux2_references_without_a_size_are_checked_like_a_size():
    flux2 = preprocessor("tiny/flux2")
    # The output takes the first reference's size as the pipeline encodes it (shrunk to 1 MP, floored to 16).
    request = check(flux2, image=[png(3000, 2000), png(300, 200)])
    assert (request.width, request.height) == (1248, 832)
    assert (check(flux2).width, check(flux2).height) == (1024, 1024)  # no reference: the default

    small = preprocessor("tiny/flux2", max_image_size=512)
    error = refused(small, image=png(1000, 800))
    assert error.param == "width" and "992x800" in str(error) and "512" in str(error)
    assert check(small, image=png(1000, 800), width=512, height=512).width == 512

    # 288x192 out (216 tokens) and two 288x192 references: 648 tokens.
    assert check(preprocessor("tiny/flux2", max_tokens_per_step=648), image=[png(300, 200)] * 2)
    error = refused(preprocessor("tiny/flux2", max_tokens_per_step=647), image=[png(300, 200)] * 2)
    assert error.param == "image" and "648 tokens" in str(error)


def test_a_flux2_reference_too_small_to_encode_is_bad_input():
    error = refused(preprocessor("tiny/flux2"), image=png(8, 300), width=64, height=64)
    assert error.param == "image" and "0x288" in str(error)


def test_the_reference_and_bucket_rules_are_the_pipelines():
    from diffusers.pipelines.flux2.image_processor import Flux2ImageProcessor
    from diffusers.pipelines.hunyuan_video1_5.image_processor import HunyuanVideo15ImageProcessor

    flux2 = REGISTRY["Flux2Pipeline"]
    for size in [(3000, 2000), (1024, 1024), (1025, 1024), (300, 200), (4000, 16), (7, 5000)]:
        image = Image.new("RGB", size)
        if size[0] * size[1] > 1024 * 1024:
            image = Flux2ImageProcessor._resize_to_target_area(image, 1024 * 1024)
        multiple = 16  # Flux2Pipeline: vae_scale_factor * 2
        assert flux2.source_size(*size) == (image.width // multiple * multiple, image.height // multiple * multiple)

    buckets = HunyuanVideo15ImageProcessor(vae_scale_factor=16)
    for target in (160, 640, 960):
        for width, height in [(16, 9), (300, 200), (200, 300), (1, 1), (4000, 1000), (1000, 4000), (100, 1)]:
            picked_height, picked_width = buckets.calculate_default_height_width(height, width, target)
            assert bucket_size(width, height, target) == (picked_width, picked_height)
    assert REGISTRY["HunyuanVideo15Pipeline"].output_size([], 640) == (848, 480)  # the 480p default


def test_the_token_rule_gives_the_documented_counts():
    assert REGISTRY["QwenImagePipeline"].tokens_per_step(1328, 1328, None, []) == 6889
    assert REGISTRY["Flux2Pipeline"].tokens_per_step(2048, 2048, None, []) == 16384
    assert REGISTRY["HunyuanVideo15Pipeline"].tokens_per_step(848, 480, 121, []) == 49290


# ---- HunyuanVideo 1.5 prompts ------------------------------------------------------------------------


def test_a_hunyuan_prompt_longer_than_its_pipeline_reads_is_refused(hunyuan):
    assert check(hunyuan, words(hunyuan, 995), width=208, height=144).prompt
    error = refused(hunyuan, words(hunyuan, 996), width=208, height=144)
    assert error.param == "prompt" and "996 tokens; the limit is 995" in str(error)
    error = refused(hunyuan, negative_prompt=words(hunyuan, 996), width=208, height=144)
    assert error.param == "negative_prompt"


def test_the_hunyuan_prompt_limit_is_what_its_pipelines_read(hunyuan):
    import diffusers
    import torch

    pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(_folders["tiny/hunyuan-video-1.5"])
    kept, limit = pipe.tokenizer_max_length, REGISTRY["HunyuanVideo15Pipeline"].max_prompt_tokens

    def tokens_read(prompt_tokens: int) -> int:
        with torch.no_grad():
            _, mask = pipe._get_mllm_prompt_embeds(
                pipe.text_encoder,
                pipe.tokenizer,
                words(hunyuan, prompt_tokens),
                "cpu",
                tokenizer_max_length=kept + 1,  # one more than the pipeline keeps: shows what it would cut
                system_message=pipe.system_message,
                crop_start=pipe.prompt_template_encode_start_idx,
            )
        return int(mask.sum())

    assert tokens_read(limit) == kept  # the whole prompt and the template's end are read
    assert tokens_read(limit + 1) > kept  # one more token and the pipeline would cut the text
    i2v = diffusers.HunyuanVideo15ImageToVideoPipeline.from_pretrained(resolve_model_path("tiny/hunyuan-video-1.5-i2v"))
    read = (pipe.tokenizer_max_length, pipe.prompt_template_encode_start_idx, pipe.system_message)
    assert (i2v.tokenizer_max_length, i2v.prompt_template_encode_start_idx, i2v.system_message) == read
    assert REGISTRY["HunyuanVideo15ImageToVideoPipeline"].max_prompt_tokens == limit
