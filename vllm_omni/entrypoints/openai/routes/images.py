"""POST /v1/images/generations (JSON) and /v1/images/edits (multipart): HTTP <-> scheduler jobs.

Also the submit/answer path every image route takes (routes/chat.py too): `image_params` makes a
request's `GenerationParams` (the deploy's defaults filled in, `size` split into width and height),
`submit_image_job` queues it on the scheduler (app.state.scheduler), and `finish_image_job` waits
for the job while watching the connection (routes/connection.py): a client that goes away has its job cancelled
(dropped from the queue, or stopped at its next denoising step). Bodies are read by routes/bodies.py (a
deadline, a limit per field; a full queue answered before the body is read). A request takes its
queue place once its body has arrived, in `submit`; images are passed on as compressed bytes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.diffusion.engine.job import Job
from vllm_omni.diffusion.engine.lifecycle import Unavailable
from vllm_omni.diffusion.engine.queue_admission import InternalError, QueueFull
from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS
from vllm_omni.diffusion.engine.scheduler import Scheduler
from vllm_omni.diffusion.request import DiffusionOutput, GenerationParams, RequestError
from vllm_omni.entrypoints.deploy_config import apply_sampling_defaults
from vllm_omni.entrypoints.openai.errors import ApiError, job_error, request_error, scheduler_error
from vllm_omni.entrypoints.openai.media import encode_images_b64
from vllm_omni.entrypoints.openai.protocol import (
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageResponse,
    parse_size,
)
from vllm_omni.entrypoints.openai.routes.bodies import (
    FORM_TYPES,
    FilePart,
    body_media_type,
    body_spec,
    field_param,
    parse_fields,
    read_form,
    read_json_object,
    unread,
)
from vllm_omni.entrypoints.openai.routes.connection import wait_watching_client
from vllm_omni.entrypoints.openai.routes.models import adapter_error, check_model

router = APIRouter()

IMAGE = "image"  # also image[], image[0], image[1], ...: the openai client's list forms
# The body is read by routes/bodies.py (a deadline, per-field limits); the schema is still documented.
_GENERATION_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ImageGenerationRequest.model_json_schema()}},
    }
}

BadInput = Callable[[RequestError], ApiError]  # the engine's verdict on a request, named as the route's body names it


@router.post("/v1/images/generations", response_model=ImageResponse, openapi_extra=_GENERATION_BODY)
async def generations(http: Request) -> JSONResponse:
    body = parse_fields(ImageGenerationRequest, await read_json_object(http, body_spec(http)))
    _check_image_api_options(body)
    params = image_params(http, body, body.prompt, None)
    return await _answer(http, body, await submit_image_job(http, params, _bad_input(body)))


@router.post("/v1/images/edits", response_model=ImageResponse)
async def edits(http: Request) -> JSONResponse:
    body, images = await _read_edit_form(http)
    _check_image_api_options(body)
    params = image_params(http, body, body.prompt, images)
    return await _answer(http, body, await submit_image_job(http, params, _bad_input(body)))


def _check_image_api_options(body: ImageGenerationRequest | ImageEditRequest) -> None:
    if body.response_format not in (None, "b64_json"):
        raise ApiError(
            400,
            f"response_format {body.response_format!r} is not supported: this server returns images "
            "inline; use response_format=b64_json",
            param="response_format",
        )
    if body.stream:
        raise ApiError(400, "stream=true is not supported: images come back whole", param="stream")
    if body.background == "transparent":
        raise ApiError(400, "background 'transparent' is not supported: outputs are opaque", param="background")


def _bad_input(body: ImageGenerationRequest | ImageEditRequest) -> BadInput:
    return lambda exc: request_error(exc, body.size)


async def _answer(http: Request, body: ImageGenerationRequest | ImageEditRequest, job: Job) -> JSONResponse:
    fmt = body.output_format or "png"
    output, encoded = await finish_image_job(http, job, _bad_input(body), fmt, body.output_compression)
    response = ImageResponse(
        created=int(time.time()),
        data=[ImageData(b64_json=b64, seed=seed) for b64, seed in zip(encoded, output.seeds, strict=True)],
        output_format=fmt,
        id=job.id,
        **result_fields(output),
    )
    return JSONResponse(response.model_dump(), headers={"X-Request-Id": job.id})


# ---- shared by every image route ----------------------------------------------------------------


def image_params(http: Request, body: Any, prompt: str, images: list[bytes] | None) -> GenerationParams:
    """The request's GenerationParams: the declared sampling fields `body` has (width and height in its `size`,
    or apart where the body declares them: chat; the adapter in `lora` or named by `model`), the deploy's defaults
    filled in; a 400 naming `model`, `lora` or `size`."""
    settings = http.app.state.settings
    lora = check_model(http, body.model, "image", body.lora)
    given = {f.name: getattr(body, f.name, None) for f in SAMPLING_FIELDS if not f.video_only}
    given["lora"] = lora
    size = body.size
    auto = size is not None and size.strip().lower() == "auto"
    if size is not None:
        if given["width"] is not None or given["height"] is not None:
            raise ApiError(400, "give size ('WIDTHxHEIGHT') or width and height, not both", param="size")
        if not auto:
            try:
                given["width"], given["height"] = parse_size(size, settings.engine.limits.max_image_size)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="size") from None
    values = apply_sampling_defaults(given, settings.default_sampling_params)
    if auto:
        values["height"] = values["width"] = None  # an explicit "auto" beats the deploy's default size
    image = images if images and len(images) > 1 else images[0] if images else None
    return GenerationParams(prompt=prompt, image=image, **values)


async def submit_image_job(http: Request, params: GenerationParams, bad_input: BadInput) -> Job:
    """The queued job (its queue place taken now, its body read); the engine's checks failing are `bad_input`, the
    scheduler's refusals their answers."""
    try:
        return await http.app.state.scheduler.submit(params, id_prefix="img")
    except RequestError as exc:
        raise bad_input(adapter_error(exc, params)) from None
    except (Unavailable, QueueFull, InternalError) as exc:
        raise scheduler_error(exc) from None


async def finish_image_job(
    http: Request, job: Job, bad_input: BadInput, fmt: str, quality: int | None
) -> tuple[DiffusionOutput, list[str]]:
    """Wait for the job (cancelling it if the client leaves): its output and its images encoded as base64 `fmt`,
    or its error raised as the answer."""
    scheduler: Scheduler = http.app.state.scheduler
    try:
        await wait_watching_client(http, scheduler, job)
    finally:
        scheduler.forget(job.id)  # the answer carries the images; nobody polls an image job
    if job.status != "completed":
        error = job.error
        if error.code == "invalid_request":  # found in the workers (data that does not decode)
            raise bad_input(RequestError(error.message, error.param))
        raise job_error(error)
    output = job.result
    return output, await asyncio.to_thread(encode_images_b64, output.images, fmt, quality)


def result_fields(output: DiffusionOutput) -> dict[str, Any]:
    """What every image answer adds to OpenAI's schema: the real size, the seed used, the engine's timings."""
    return {
        "size": f"{output.width}x{output.height}",
        "width": output.width,
        "height": output.height,
        "seed": output.seed,
        "timings_ms": {k: round(v, 2) for k, v in output.timings_ms.items()},
        "step_cache": output.step_cache,
    }


async def _read_edit_form(http: Request) -> tuple[ImageEditRequest, list[bytes]]:
    # A form without files arrives url-encoded; it is answered "image is required" below.
    if body_media_type(http, "multipart/form-data") not in FORM_TYPES:
        raise unread(
            ApiError(400, "the edits endpoint takes multipart/form-data (image files and form fields)", param=IMAGE)
        )
    spec = body_spec(http, IMAGE, max_files=http.app.state.settings.engine.limits.max_input_images)
    images: list[bytes] = []
    fields: dict[str, str] = {}
    for key, value in await read_form(http, spec):
        if field_param(key) == IMAGE:
            if not isinstance(value, FilePart):
                raise ApiError(400, f"{key} must be an uploaded file, not a text field", param=IMAGE)
            images.append(value.data)
        elif key == "mask":
            raise ApiError(400, "mask is not supported: these models edit the whole image", param="mask")
        elif isinstance(value, FilePart):
            raise ApiError(400, f"unexpected file field {key!r}; send images as 'image' or 'image[]'", param=key)
        elif key in fields:
            raise ApiError(400, f"{key} is given more than once", param=key)
        else:
            fields[key] = value
    body = parse_fields(ImageEditRequest, fields)
    if not images:
        raise ApiError(400, "image is required: upload one or more files as 'image' (or 'image[]')", param="image")
    return body, images
