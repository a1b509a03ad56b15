"""Request and response bodies of the OpenAI-style image API, and the size parser.

The generation body is JSON; the edit body is the same fields as multipart form values (the
routes in routes/images.py validate both with these models). The sampling fields come from the
one declaration in diffusion/request_fields.py. Responses follow OpenAI's images schema
(`created`, `data[].b64_json`) and add the seed used and the real output size. Used by the
routes, the error handlers (errors.py) and the one-shot CLI (cli/generate.py, for `parse_size`).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator

from vllm_omni.diffusion.request_fields import SAMPLING_FIELDS

# ASCII digits only: Python's int() also reads full-width and other Unicode digits.
_SIZE = re.compile(r"^\s*(-?[0-9]+)\s*[xX]\s*(-?[0-9]+)\s*$")

# Numeric fields: pydantic's lax mode would read JSON true as 1 for them.
_NUMERIC_FIELDS = frozenset({f.name for f in SAMPLING_FIELDS if f.type in (int, float)} | {"output_compression"})


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


class _ImageRequestBase(BaseModel):
    """Image API fields besides the declared sampling ones. None: "the deploy's default, else the model's"."""

    # Typos such as "num_steps" would otherwise be ignored silently and waste a GPU run.
    model_config = ConfigDict(extra="forbid")

    prompt: str
    model: str | None = None
    size: str | None = Field(None, description="'WIDTHxHEIGHT', or 'auto'")
    response_format: str | None = Field("b64_json", description="only 'b64_json'")
    output_format: Literal["png", "jpeg", "webp"] | None = Field(None, description="default 'png'")
    output_compression: int | None = Field(None, ge=0, le=100, description="jpeg/webp quality, 0-100")
    stream: bool | None = None  # only false: images come back whole
    background: str | None = None  # only "auto" / "opaque": no transparent output
    # Sent by some OpenAI clients; accepted and ignored.
    user: str | None = None
    quality: str | None = None
    style: str | None = None
    moderation: str | None = None
    safety_identifier: str | None = None

    @field_validator("*", mode="before")
    @classmethod
    def _booleans_are_not_numbers(cls, value: Any, info: Any) -> Any:
        if isinstance(value, bool) and info.field_name in _NUMERIC_FIELDS:
            raise ValueError(f"expected a number, got {str(value).lower()}")
        return value


def _with_sampling_fields(name: str, base: type[BaseModel], video: bool) -> type[BaseModel]:
    """`base` plus the declared request fields (request_fields.py); width and height travel in `size`."""
    fields = {
        f.name: (f.type | None, Field(None, description=f.help))
        for f in SAMPLING_FIELDS
        if not f.in_size and (video or not f.video_only)
    }
    return create_model(name, __base__=base, **fields)


_SamplingFields = _with_sampling_fields("_SamplingFields", _ImageRequestBase, video=False)


class ImageGenerationRequest(_SamplingFields):
    """POST /v1/images/generations (JSON)."""


class ImageEditRequest(_SamplingFields):
    """The text fields of POST /v1/images/edits (multipart); the images arrive as file parts."""


class ImageData(BaseModel):
    b64_json: str
    revised_prompt: str | None = None


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
    task: str | None = None  # "generate" or "edit", once the model folder is resolved
    ready: bool
    parallel_config: dict[str, Any]  # the effective one: deploy YAML with the flags applied
    default_sampling_params: dict[str, Any]
    limits: dict[str, int]


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
