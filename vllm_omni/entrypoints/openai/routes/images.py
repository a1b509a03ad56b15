"""POST /v1/images/generations (JSON) and /v1/images/edits (multipart): HTTP <-> scheduler jobs.

A request becomes `GenerationParams` (the deploy's defaults filled in, `size` split into width
and height), is submitted to the scheduler (app.state.scheduler), and the answer waits for the
job while watching the connection: a client that goes away has its job cancelled (dropped from
the queue, or stopped at its next denoising step). Bodies are read by routes/bodies.py (a deadline,
a limit per field). An edit's upload is read only once the queue has a place for it (held while
it is read and checked), and is passed on as compressed bytes.
"""

from __future__ import annotations

import asyncio
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from vllm_omni.diffusion.data import GenerationParams, RequestError
from vllm_omni.diffusion.request_fields import SAMPLING_FIELDS
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
    body_spec,
    field_param,
    media_type,
    parse_fields,
    read_form,
    read_json_object,
)
from vllm_omni.entrypoints.openai.routes.models import check_model
from vllm_omni.entrypoints.openai.scheduler import InternalError, Job, QueueFull, Scheduler, Unavailable

router = APIRouter()

IMAGE = "image"  # also image[], image[0], image[1], ...: the openai client's list forms
# The body is read by routes/bodies.py (a deadline, per-field limits); the schema is still documented.
_GENERATION_BODY = {
    "requestBody": {
        "required": True,
        "content": {"application/json": {"schema": ImageGenerationRequest.model_json_schema()}},
    }
}


@router.post("/v1/images/generations", response_model=ImageResponse, openapi_extra=_GENERATION_BODY)
async def generations(http: Request) -> JSONResponse:
    body = parse_fields(ImageGenerationRequest, await read_json_object(http, body_spec(http)))
    params = _params(http, body, None)
    return await _answer(http, body, await _submit(http, body, params, place_held=False))


@router.post("/v1/images/edits", response_model=ImageResponse)
async def edits(http: Request) -> JSONResponse:
    scheduler: Scheduler = http.app.state.scheduler
    try:
        # A loading server, or a full queue, says so before a large upload is read; the place
        # held meanwhile bounds the uploads in flight by the queue's length.
        place = scheduler.hold_place()
    except (Unavailable, QueueFull) as exc:
        raise scheduler_error(exc) from None
    with place:
        body, images = await _read_edit_form(http)
        params = _params(http, body, images if len(images) > 1 else images[0])
        job = await _submit(http, body, params, place_held=True)
    return await _answer(http, body, job)


def _params(
    http: Request, body: ImageGenerationRequest | ImageEditRequest, images: bytes | list[bytes] | None
) -> GenerationParams:
    settings = http.app.state.settings
    check_model(http, body.model, "image")
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
    auto = body.size is not None and body.size.strip().lower() == "auto"
    width = height = None
    if body.size is not None and not auto:
        try:
            width, height = parse_size(body.size, settings.engine.limits.max_image_size)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="size") from None
    given = {f.name: getattr(body, f.name) for f in SAMPLING_FIELDS if not f.in_size and not f.video_only}
    values = apply_sampling_defaults(dict(given, height=height, width=width), settings.engine.default_sampling_params)
    if auto:
        values["height"] = values["width"] = None  # an explicit "auto" beats the deploy's default size
    return GenerationParams(prompt=body.prompt, image=images, **values)


async def _submit(
    http: Request, body: ImageGenerationRequest | ImageEditRequest, params: GenerationParams, place_held: bool
) -> Job:
    try:
        return await http.app.state.scheduler.submit(params, id_prefix="img", place_held=place_held)
    except RequestError as exc:
        raise request_error(exc, body.size) from None
    except (Unavailable, QueueFull, InternalError) as exc:
        raise scheduler_error(exc) from None


async def _answer(http: Request, body: ImageGenerationRequest | ImageEditRequest, job: Job) -> JSONResponse:
    """Wait for the job (cancelling it if the client leaves) and answer with its images or its error."""
    scheduler: Scheduler = http.app.state.scheduler
    try:
        await _wait_watching_client(http, scheduler, job)
    finally:
        scheduler.forget(job.id)  # the answer carries the images; nobody polls an image job
    if job.status != "completed":
        raise job_error(job.error, body.size)
    output = job.result
    fmt = body.output_format or "png"
    encoded = await asyncio.to_thread(encode_images_b64, output.images, fmt, body.output_compression)
    response = ImageResponse(
        created=int(time.time()),
        data=[ImageData(b64_json=b64) for b64 in encoded],
        output_format=fmt,
        size=f"{output.width}x{output.height}",
        width=output.width,
        height=output.height,
        seed=output.seed,
        id=job.id,
        timings_ms={k: round(v, 2) for k, v in output.timings_ms.items()},
    )
    return JSONResponse(response.model_dump(), headers={"X-Request-Id": job.id})


async def _wait_watching_client(http: Request, scheduler: Scheduler, job: Job) -> None:
    """Until the job ends; a client that disconnects first has it cancelled (and it still ends)."""
    finished = asyncio.create_task(job.wait())
    gone = asyncio.create_task(_disconnected(http))
    try:
        await asyncio.wait({finished, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not finished.done():
            scheduler.cancel(job.id, "client disconnected")
            await finished
    finally:
        gone.cancel()
        finished.cancel()


async def _disconnected(http: Request) -> None:
    """Returns when the client closes the connection (the body is read: the next message says so)."""
    while (await http.receive())["type"] != "http.disconnect":
        pass


async def _read_edit_form(http: Request) -> tuple[ImageEditRequest, list[bytes]]:
    # A form without files arrives url-encoded; it is answered "image is required" below.
    if media_type(http) not in FORM_TYPES:
        raise ApiError(400, "the edits endpoint takes multipart/form-data (image files and form fields)", param=IMAGE)
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
