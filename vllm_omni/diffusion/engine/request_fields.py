"""The request fields, declared once: name, type, help, and how each surface spells it.

Every surface is derived from `SAMPLING_FIELDS` or checked against it by a test
(tests/diffusion/engine/test_request_fields.py): the HTTP bodies (entrypoints/openai/protocol.py),
the CLI flags of `vllm-omni generate` (entrypoints/cli/generate.py), `Omni.generate`'s
keyword arguments, the deploy YAML's `default_sampling_params` (entrypoints/deploy_config.py)
and `GenerationParams` (request.py). Which pipelines take a field is in each `PipelineSpec.fields`
(models/registry.py); the engine refuses a field a pipeline does not take, naming it.
Torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestField:
    name: str  # the GenerationParams / Omni.generate / YAML / JSON name
    type: type  # str, int, float, or dict (lora: an object in JSON, its name on the CLI)
    help: str
    cli_flag: str  # the `vllm-omni generate` flag (width and height share --size WxH)
    in_size: bool = False  # HTTP and CLI carry it inside `size` ("WIDTHxHEIGHT")
    video_only: bool = False  # not part of the image APIs


SAMPLING_FIELDS: tuple[RequestField, ...] = (
    RequestField(
        "negative_prompt",
        str,
        "what to steer away from; turns on true CFG (Qwen-Image) or is the CFG branch's prompt (video models)",
        "--negative-prompt",
    ),
    RequestField("width", int, "output width in pixels, rounded down to the model's multiple", "--size", True),
    RequestField("height", int, "output height in pixels, rounded down to the model's multiple", "--size", True),
    RequestField("num_inference_steps", int, "denoising steps (default: the model's)", "--steps"),
    RequestField(
        "guidance_scale",
        float,
        "guidance: embedded (distilled) guidance on FLUX.2, the CFG scale on HunyuanVideo 1.5 and Wan2.2, "
        "and only for checkpoints with guidance embeds on Qwen-Image",
        "--guidance-scale",
    ),
    RequestField(
        "guidance_scale_2",
        float,
        "Wan2.2 A14B: the CFG scale of the low-noise expert (transformer_2); default: guidance_scale",
        "--guidance-scale-2",
    ),
    RequestField(
        "true_cfg_scale",
        float,
        "Qwen-Image's classifier-free guidance scale, used with a negative prompt (default 4.0 with one)",
        "--true-cfg-scale",
    ),
    RequestField("n", int, "images (or videos) to generate for the prompt (default: 1)", "--n"),
    RequestField(
        "seed",
        int,
        "random seed; image i of n is drawn from seed + i (default: drawn by the engine and reported)",
        "--seed",
    ),
    RequestField(
        "cache_threshold",
        float,
        "the step cache's threshold for this request, on a server started with a cache (--cache): higher skips "
        "more steps (default: the server's)",
        "--cache-threshold",  # `vllm-omni generate`: the same flag sets the engine's
    ),
    RequestField(
        "lora",
        dict,
        'a served LoRA adapter: {"name": NAME, "scale": 1.0} (scale optional; or the adapter\'s name as `model`); '
        "the CLI takes its name",
        "--lora",
    ),
    RequestField(
        "priority",
        int,
        "the queue's order on a server started with --scheduling-policy priority: lower runs first, ties in "
        "arrival order (vLLM's field; default 0; elsewhere only 0 is taken)",
        "--priority",
    ),
    RequestField(
        "num_frames",
        int,
        "video frames, rounded down to k * 4 + 1 (default: the model's)",
        "--num-frames",
        video_only=True,
    ),
    RequestField("fps", int, "video frames per second, for the MP4 (default: the model's)", "--fps", video_only=True),
)

FIELDS_BY_NAME: dict[str, RequestField] = {f.name: f for f in SAMPLING_FIELDS}
