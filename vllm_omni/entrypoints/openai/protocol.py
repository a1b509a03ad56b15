"""Request and response bodies of the OpenAI-style image, chat-completion and video APIs, and the size parser.

The image generation body is JSON; the edit body is the same fields as multipart form values
(routes/images.py validates both with these models); the chat completion body is JSON with
`messages` (routes/chat.py); the video body is JSON or a multipart form (routes/videos.py). The
sampling fields come from the one declaration in diffusion/engine/request_fields.py. Responses follow
OpenAI's schemas (images: `created`, `data[].b64_json`; chat: `choices[].message.content`, here
a list of image parts; videos: the `video` job object, its list and its deletion) and add the
seed used and the real output size; also the model list and the LoRA load/unload bodies (vLLM's).
Used by the routes, the error handlers (errors.py) and the one-shot CLI (cli/generate.py, for `parse_size`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS

# ASCII digits only: Python's int() also reads full-width and other Unicode digits.
_SIZE = re.compile(r"^\s*(-?[0-9]+)\s*[xX]\s*(-?[0-9]+)\s*$")

# Numeric fields: pydantic's lax mode would read JSON true as 1 for them.
_NUMERIC_FIELDS = frozenset(
    {f.name for f in SAMPLING_FIELDS if f.type in (int, float)} | {"output_compression", "seconds"}
)
# Object fields (`lora`): a form (edits, multipart videos) carries them as JSON text.
_OBJECT_FIELDS = frozenset(f.name for f in SAMPLING_FIELDS if f.type is dict)


def parse_size(size: str, max_side: int) -> tuple[int, int]:
    """'WIDTHxHEIGHT' -> (width, height); a ValueError naming `size` for anything else."""
    match = _SIZE.match(size) if isinstance(size, str) else None
    if match is None:
        raise ValueError(f"size must be 'WIDTHxHEIGHT' (e.g. '1024x1024'), got {size!r}")
    width, height = int(match.group(1)), int(match.group(2))
    if width < 1 or height < 1:
        raise ValueError(f"size must have a positive width and height, got {size!r}")
    if width > max_side or height > max_side:
        raise ValueError(f"size {size!r} is too large: width and height must be at most {max_side}")
    return width, height


class _StrictBody(BaseModel):
    """A request body that refuses unknown fields and booleans given for numbers."""

    # Typos such as "num_steps" would otherwise be ignored silently and waste a GPU run.
    model_config = ConfigDict(extra="forbid")

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info: Any) -> Any:
        if isinstance(value, bool) and info.field_name in _NUMERIC_FIELDS:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        if isinstance(value, str) and info.field_name in _OBJECT_FIELDS and value.lstrip().startswith("{"):
            try:
                return json.loads(value)
            except ValueError:
                raise ValueError("expected a JSON object") from None
        return value


class _ImageOutputFields(_StrictBody):
    """What every image request may say besides the declared sampling fields and its prompt (the image APIs and
    chat completions). None: "the deploy's default, else the model's"."""

    model: str | None = None
    size: str | None = Field(None, description="'WIDTHxHEIGHT', or 'auto'")
    output_format: Literal["png", "jpeg", "webp"] | None = Field(None, description="default 'png'")
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg/webp quality, 0-100")
    stream: bool | None = None  # only false: images come back whole


class _ImageRequestBase(_ImageOutputFields):
    """Image API fields besides the declared sampling ones."""

    prompt: str
    response_format: str | None = Field("b64_json", description="only 'b64_json'")
    background: str | None = None  # only "auto" / "opaque": no transparent output
    # Sent by some OpenAI clients; accepted and ignored.
    user: str | None = None
    quality: str | None = None
    style: str | None = None
    moderation: str | None = None
    safety_identifier: str | None = None


def _with_sampling_fields(
    name: str,
    base: type[BaseModel],
    video: bool,
    exclude: frozenset[str] = frozenset(),
    sizes_apart: bool = False,
    extra: dict[str, Any] | None = None,
) -> type[BaseModel]:
    """`base` plus the declared request fields (request_fields.py) and `extra`; width and height travel in
    `size`, and also apart with `sizes_apart`."""
    fields = {
        f.name: (f.type | None, Field(None, description=f.help))
        for f in SAMPLING_FIELDS
        if (sizes_apart or not f.in_size) and (video or not f.video_only) and f.name not in exclude
    }
    return create_model(name, __base__=base, **fields, **(extra or {}))


_SamplingFields = _with_sampling_fields("_SamplingFields", _ImageRequestBase, video=False)


class ImageGenerationRequest(_SamplingFields):
    """POST /v1/images/generations (JSON)."""


class ImageEditRequest(_SamplingFields):
    """The text fields of POST /v1/images/edits (multipart); the images arrive as file parts."""


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None
    seed: int  # this image's own seed: image i of a request is drawn from its seed + i


class ImageResponse(BaseModel):
    """OpenAI's ImagesResponse plus what a diffusion client needs to reproduce the result."""

    created: int
    data: list[ImageData]
    output_format: Literal["png", "jpeg", "webp"] = "png"
    size: str  # the real output size, "WIDTHxHEIGHT" (after rounding down to the model's multiple)
    width: int
    height: int
    seed: int  # the seed used (drawn by the server when the request gave none)
    id: str  # the request id, also in the server log
    timings_ms: dict[str, float]
    # With a step cache: its policy and threshold, forwards computed and skipped, the skipped steps per branch
    step_cache: dict[str, Any] | None = None


# ---- chat completions -----------------------------------------------------------------------------

# Chat keys that steer an LLM's text and change nothing an image model makes: accepted and ignored.
CHAT_IGNORED_FIELDS = (
    "temperature",
    "top_p",
    "max_tokens",
    "max_completion_tokens",
    "presence_penalty",
    "frequency_penalty",
    "stop",
    "logit_bias",
    "user",
    "metadata",
    "store",
    "service_tier",
    "safety_identifier",
    "prompt_cache_key",
    "modalities",
    "stream_options",
    "parallel_tool_calls",
    "tool_choice",
    "function_call",
    "reasoning_effort",
)


class _ChatRequestBase(_ImageOutputFields):
    """Chat fields besides the declared sampling ones; routes/chat.py reads `messages` and refuses the others
    when they are set (they ask for what an image model cannot give)."""

    messages: list[Any] = Field(
        description="the prompt is the last user message: a string, or text and image_url (base64 data URL) parts"
    )
    logprobs: bool | None = None
    top_logprobs: int | None = None
    tools: list[Any] | None = None
    functions: list[Any] | None = None
    audio: Any = None
    response_format: Any = None  # only {"type": "text"}


_ChatSamplingFields = _with_sampling_fields(
    "_ChatSamplingFields",
    _ChatRequestBase,
    video=False,
    sizes_apart=True,  # upstream's clients send height and width
    extra={name: (Any, Field(None, description="accepted and ignored")) for name in CHAT_IGNORED_FIELDS},
)


class ChatCompletionRequest(_ChatSamplingFields):
    """POST /v1/chat/completions for image models. The sampling fields may also come nested in an
    `extra_body` object (merged into the top level by routes/chat.py)."""


class ChatImageURL(BaseModel):
    url: str  # "data:image/png;base64,..."


class ChatImagePart(BaseModel):
    type: Literal["image_url"] = "image_url"
    image_url: ChatImageURL


class ChatAssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: list[ChatImagePart]  # one part per image


class ChatChoice(BaseModel):
    index: int = 0
    message: ChatAssistantMessage
    finish_reason: Literal["stop"] = "stop"


class ChatUsage(BaseModel):
    """No tokens are sampled: the counts are 0 (clients that read `usage` find it)."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class ChatCompletion(BaseModel):
    """OpenAI's chat completion, its message's content the images; plus, as ImageResponse, what a diffusion client
    needs to reproduce the result."""

    id: str  # the request id, also in the server log
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: ChatUsage = Field(default_factory=ChatUsage)
    size: str  # the real output size, "WIDTHxHEIGHT"
    width: int
    height: int
    seed: int
    seeds: list[int]  # each image's own seed, in content order: image i is drawn from seed + i
    timings_ms: dict[str, float]
    step_cache: dict[str, Any] | None = None  # as in ImageResponse


class _VideoRequestBase(_StrictBody):
    """Videos API fields besides the declared sampling ones (`input_reference` arrives as a file part or a data URL)."""

    prompt: str
    model: str | None = None
    seconds: str | float | None = Field(
        None, description="clip length; num_frames = seconds * fps rounded to the model's frame rule"
    )
    size: str | None = Field(None, description="'WIDTHxHEIGHT'")

    @field_validator("seconds", mode="before")
    @classmethod
    def _seconds_is_text_or_a_number(cls, value: Any) -> Any:
        # Else pydantic answers for a union member ("seconds.str"), and floats a 400-digit integer to inf.
        if value is None or isinstance(value, (str, float)):
            return value
        if isinstance(value, int) and not isinstance(value, bool):
            if value.bit_length() > 64:
                raise ValueError("expected a number of seconds like '4', got an integer far too large")
            return value
        raise ValueError(f"expected a number of seconds like '4' (a string or a number), got {type(value).__name__}")


# One job is one video: `n` is not part of the videos API.
_VideoSamplingFields = _with_sampling_fields("_VideoSamplingFields", _VideoRequestBase, True, frozenset({"n"}))


class VideoCreateRequest(_VideoSamplingFields):
    """POST /v1/videos (JSON, or the same fields as multipart form values)."""


VideoStatus = Literal["queued", "in_progress", "completed", "failed"]


class VideoError(BaseModel):
    code: str  # invalid_request, server_error, cancelled, shutting_down, server_restarted
    message: str
    param: str | None = None


class Video(BaseModel):
    """OpenAI's video job object, plus what a diffusion client needs to reproduce the result."""

    id: str
    object: Literal["video"] = "video"
    status: VideoStatus
    progress: int  # percent of the denoising steps done
    created_at: int  # Unix times, seconds
    completed_at: int | None = None
    expires_at: int | None = None  # the file is deleted then (or earlier, when the storage limit evicts it)
    model: str
    prompt: str
    seconds: str  # as requested (or derived from num_frames / fps)
    size: str  # "WIDTHxHEIGHT": the requested size, "auto" until done when the pipeline picks it; then the real one
    error: VideoError | None = None
    remixed_from_video_id: str | None = None
    seed: int  # the seed used (drawn by the server when the request gave none)
    num_frames: int | None = None  # the frames asked for; once completed, the real count
    fps: int
    width: int | None = None  # the real size, once completed
    height: int | None = None
    timings_ms: dict[str, float] | None = None  # the engine's step breakdown, once completed ("total": inference time)
    step_cache: dict[str, Any] | None = None  # with a step cache, once completed: as in ImageResponse


class VideoList(BaseModel):
    """GET /v1/videos: OpenAI's cursor page (the client pages with `after=last_id`)."""

    object: Literal["list"] = "list"
    data: list[Video]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class VideoDeleted(BaseModel):
    """DELETE /v1/videos/{id}: `deleted` is true for a finished job (gone with its file); false when
    the job was queued or running: it is cancelled and stays, ending `failed` with code `cancelled`."""

    id: str
    object: Literal["video.deleted"] = "video.deleted"
    deleted: bool


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: str | int | None = None


class ErrorResponse(BaseModel):
    """OpenAI's error shape; its client reads `error.message`."""

    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vllm-omni"
    root: str  # the model as given on the command line
    parent: str | None = None  # a base model has none (vLLM's field; an adapter's card names its base)
    task: str | None = None  # "generate" or "edit", once the model folder is resolved
    ready: bool
    parallel_config: dict[str, Any]  # the effective one: deploy YAML with the flags applied
    default_sampling_params: dict[str, Any]
    limits: dict[str, int]
    batching: dict[str, Any]  # BatchingConfig: max_batch_size (1: off), batch_wait_ms
    quantization: str | None = None  # "fp8", or None (unquantized)
    cache: dict[str, Any] | None = None  # StepCacheConfig: policy, threshold; None: no step cache
    # What one forward holds on the deploy's GPUs (config.Envelope, and `description` in words); None: not sized
    # by a GPU's memory (a CPU), or not yet (still starting).
    envelope: dict[str, Any] | None = None


class AdapterCard(BaseModel):
    """A served LoRA adapter, listed as a model of its own (vLLM's shape): requests name it as `model`."""

    id: str  # the adapter's name
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "vllm-omni"
    root: str  # the adapter's file or folder; a file per expert: "HIGH,LOW"
    parent: str  # the base model's id


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard | AdapterCard]


class LoadLoraAdapterRequest(_StrictBody):
    """POST /v1/load_lora_adapter (vLLM's body): serve the adapter at `lora_path` (on the server's machine) as
    `lora_name`. A two-expert model also takes a file per expert: "HIGH,LOW" or ["HIGH", "LOW"]."""

    lora_name: str
    lora_path: str | list[str]


class UnloadLoraAdapterRequest(_StrictBody):
    """POST /v1/unload_lora_adapter (vLLM's body): stop serving `lora_name`."""

    lora_name: str
    lora_path: str | None = None  # accepted and ignored (clients send the load body back)
    lora_int_id: int | None = None  # vLLM's; accepted and ignored
