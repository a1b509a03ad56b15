"""The videos API, as the `openai` client's `client.videos` calls it: HTTP <-> scheduler jobs and stored videos.

- POST /v1/videos (multipart form, as the client sends it, or JSON): checks the request and
  queues it on the scheduler (the same queue as images), answers the job at once.
- GET /v1/videos/{id}: the job: queued -> in_progress (progress from the denoising steps) ->
  completed or failed (error {code, message, param}).
- GET /v1/videos/{id}/content: the MP4 (H.264).
- GET /v1/videos: OpenAI's cursor page, newest first by default (`after`, `limit`, `order`).
- DELETE /v1/videos/{id}: cancels a queued or running job, or deletes a finished one and its file
  (also one whose MP4 is being written: the file is discarded once written).
- POST /v1/videos/sync: the same body, read and checked by the same code (`_checked_request`), queued
  the same way; it answers with the MP4's bytes once the job is done (upstream vLLM-Omni's route, for
  clients that do not poll). The job is the connection's: a client that leaves has it cancelled, and
  nothing is stored (no record, no file: GET /v1/videos does not list it).

Jobs of POST /v1/videos live on without any connection; their records and files are the store's
(video_store.py, at app.state.videos). The length is `seconds` (a string, as the client sends
it) times `fps`, rounded to the model's frame rule, unless `num_frames` is given.
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from vllm_omni.diffusion.engine.job import Job, one_line
from vllm_omni.diffusion.engine.lifecycle import Unavailable
from vllm_omni.diffusion.engine.preprocess import check_int
from vllm_omni.diffusion.engine.queue_admission import InternalError, QueueFull
from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS
from vllm_omni.diffusion.engine.scheduler import Scheduler
from vllm_omni.diffusion.request import GenerationParams, RequestError
from vllm_omni.entrypoints.deploy_config import apply_sampling_defaults
from vllm_omni.entrypoints.openai import media
from vllm_omni.entrypoints.openai.errors import ApiError, job_error, request_error, scheduler_error
from vllm_omni.entrypoints.openai.protocol import (
    Video,
    VideoCreateRequest,
    VideoDeleted,
    VideoError,
    VideoList,
    parse_size,
)
from vllm_omni.entrypoints.openai.routes.bodies import (
    FORM_TYPES,
    BodySpec,
    FilePart,
    body_media_type,
    body_spec,
    decode_data_url,
    is_json,
    parse_fields,
    read_form,
    read_json_object,
    unread,
)
from vllm_omni.entrypoints.openai.routes.connection import wait_watching_client
from vllm_omni.entrypoints.openai.routes.models import adapter_error, check_model
from vllm_omni.entrypoints.openai.video_store import VideoRecord, VideoStore
from vllm_omni.logger import init_logger

logger = init_logger(__name__)
router = APIRouter()

DEFAULT_SECONDS = 4.0  # OpenAI's default length, when neither the request nor the deploy gives one
REFERENCE = "input_reference"
LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX = 20, 100
CHUNK_BYTES = 1024 * 1024
CLIENT_SECONDS = ("4", "8", "12")  # the lengths the openai client's type allows (openai.types.VideoSeconds)


@router.post("/v1/videos", response_model=Video)
async def create(http: Request) -> JSONResponse:
    body, params, seconds = await _checked_request(http)
    job = await _submit(http, body, params, seconds)
    settings = http.app.state.settings
    request = job.request
    record = _store(http).add(
        job,
        model=body.model or settings.served_model_name or settings.engine.model,
        prompt=body.prompt,
        # As asked; or, where num_frames decided it, the length of the checked (rounded) frame count.
        seconds=_format_seconds(seconds if seconds is not None else request.num_frames / request.fps),
        size=f"{request.width}x{request.height}" if request.width and request.height else "auto",
        fps=request.fps,
    )
    return JSONResponse(_view(record).model_dump(), headers={"X-Request-Id": record.id})


@router.post(
    "/v1/videos/sync",
    response_class=Response,
    responses={
        200: {"content": {"video/mp4": {}}, "description": "the MP4 (H.264; AAC sound where the model makes some)"}
    },
)
async def create_sync(http: Request) -> Response:
    """The body of POST /v1/videos, answered with the MP4 once the job is done: the same checks, queue and errors
    (a job that fails is answered as the image routes answer theirs: 400 naming the field, 507 out of memory, 500);
    a client that disconnects has its job cancelled. Nothing is stored."""
    body, params, seconds = await _checked_request(http)
    job = await _submit(http, body, params, seconds)
    scheduler: Scheduler = http.app.state.scheduler
    try:
        await wait_watching_client(http, scheduler, job)
    finally:
        scheduler.forget(job.id)  # the answer carries the video; nobody polls a sync job
    if job.status != "completed":
        error = job.error
        if error.code == "invalid_request":  # found in the workers (data that does not decode)
            raise _request_error(RequestError(error.message, error.param), body.size, seconds)
        raise job_error(error)
    output, job.result = job.result, None
    try:
        data = await asyncio.to_thread(media.encode_video_output, output)  # with its sound, where it has some
    except Exception as exc:  # noqa: BLE001 - this request fails, the server goes on
        logger.error("Video %s: could not encode the MP4: %s", job.id, exc, exc_info=exc)
        raise ApiError(500, f"encoding the MP4 failed: {one_line(exc)}") from None
    return Response(
        data,
        media_type="video/mp4",
        headers={
            "X-Request-Id": job.id,
            "Content-Disposition": f'inline; filename="{job.id}.mp4"',
            # What the job object of POST /v1/videos reports, for reproducing it.
            "X-Seed": str(output.seed),
            "X-Size": f"{output.width}x{output.height}",
            "X-Num-Frames": str(output.num_frames),
            "X-Fps": str(output.fps),
        },
    )


@router.get("/v1/videos", response_model=VideoList)
async def list_videos(http: Request) -> VideoList:
    query = http.query_params
    limit = _query_int(query.get("limit"), "limit", LIST_LIMIT_DEFAULT, LIST_LIMIT_MAX)
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise ApiError(400, f"order must be 'asc' or 'desc', got {order!r}", param="order")
    records = _store(http).newest_first()
    if order == "asc":
        records.reverse()
    after = query.get("after")
    if after is not None:
        position = next((i for i, r in enumerate(records) if r.id == after), None)
        if position is None:
            raise ApiError(400, f"after: no video {after!r} (deleted or expired?)", param="after")
        records = records[position + 1 :]
    page = records[:limit]
    return VideoList(
        data=[_view(r) for r in page],
        first_id=page[0].id if page else None,
        last_id=page[-1].id if page else None,
        has_more=len(records) > limit,
    )


@router.get("/v1/videos/{video_id}", response_model=Video)
async def retrieve(video_id: str, http: Request) -> Video:
    return _view(_record(http, video_id))


@router.get("/v1/videos/{video_id}/content")
async def content(video_id: str, http: Request) -> StreamingResponse:
    record = _record(http, video_id)
    variant = http.query_params.get("variant", "video")
    if variant != "video":
        raise ApiError(400, f"variant {variant!r} is not available: only 'video' (the MP4)", param="variant")
    status, _ = record.state()
    if status != "completed":
        why = f"it failed: {record.error.message}" if status == "failed" else f"it is {status}"
        raise ApiError(409, f"video {video_id!r} has no content: {why}", code="video_not_ready")
    try:
        # Opened now: a delete or an eviction while it streams unlinks the name, not the open file.
        file = open(_store(http).video_path(record), "rb")  # noqa: SIM115 - closed by the stream below
    except FileNotFoundError:
        raise _not_found(video_id) from None

    async def chunks():
        try:
            while data := await asyncio.to_thread(file.read, CHUNK_BYTES):
                yield data
        finally:
            file.close()

    return StreamingResponse(
        chunks(),
        media_type="video/mp4",
        headers={
            "Content-Length": str(record.file_bytes),
            "Content-Disposition": f'inline; filename="{record.id}.mp4"',
        },
    )


@router.delete("/v1/videos/{video_id}", response_model=VideoDeleted)
async def delete(video_id: str, http: Request) -> VideoDeleted:
    deleted = _store(http).delete(video_id)
    if deleted is None:
        raise _not_found(video_id)
    return VideoDeleted(id=video_id, deleted=deleted)


# ---- helpers ------------------------------------------------------------------------------------


def _store(http: Request) -> VideoStore:
    return http.app.state.videos


def _not_found(video_id: str) -> ApiError:
    return ApiError(404, f"no video {video_id!r} (deleted, expired, or never made)", param="video_id", code="not_found")


def _record(http: Request, video_id: str) -> VideoRecord:
    record = _store(http).get(video_id)
    if record is None:
        raise _not_found(video_id)
    return record


def _view(record: VideoRecord) -> Video:
    status, progress = record.state()
    error = None
    if status == "failed" and record.error is not None:
        error = VideoError(code=record.error.code, message=record.error.message, param=_http_param(record.error.param))
    return Video(
        id=record.id,
        status=status,
        progress=progress,
        created_at=int(record.created_at),
        completed_at=int(record.completed_at) if status in ("completed", "failed") and record.completed_at else None,
        expires_at=int(record.expires_at) if record.expires_at else None,
        model=record.model,
        prompt=record.prompt,
        seconds=record.seconds,
        size=record.size,
        error=error,
        seed=record.seed,
        num_frames=record.num_frames,
        fps=record.fps,
        width=record.width,
        height=record.height,
        timings_ms=record.timings_ms,
        step_cache=record.step_cache,
    )


def _http_param(param: str | None) -> str | None:
    """The engine's field names as this API spells them."""
    if param in ("height", "width"):
        return "size"
    return REFERENCE if param == "image" else param


def _request_error(exc: RequestError, size: str | None, seconds: float | None) -> ApiError:
    if exc.param == "num_frames" and seconds is not None:  # the frame count came from `seconds`
        return ApiError(400, str(exc), param="seconds")
    if exc.param == "image":
        message = str(exc)
        message = REFERENCE + message[len("image") :] if message.startswith("image") else message
        return ApiError(400, message, param=REFERENCE)
    return request_error(exc, size)


def _query_int(text: str | None, name: str, default: int, most: int) -> int:
    if text is None:
        return default
    try:
        return check_int(name, text, 1, most)
    except RequestError as exc:
        raise ApiError(400, str(exc), param=name) from None


def _format_seconds(seconds: float) -> str:
    return f"{round(seconds, 2):g}"


def _parse_seconds(value: str | float) -> float:
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        seconds = math.nan
    if not math.isfinite(seconds) or seconds <= 0:
        raise ApiError(400, f"seconds must be a positive number, like '4', got {value!r}", param="seconds")
    return seconds


def _frames_for(seconds: float, fps: int, multiple: int, max_frames: int) -> int:
    """seconds * fps rounded to the nearest k * multiple + 1 frames (within max_frames); a 400 naming seconds.

    Beyond max_frames the request is refused, not shortened or slowed down: the limit is the
    operator's (memory; the 480p checkpoints are made for 121 frames), and a shorter clip or
    another fps than asked would be another video. The 400 says which lengths fit instead.
    """
    exact = seconds * fps
    if exact > max_frames:
        asked = _format_seconds(seconds)
        fitting = [s for s in CLIENT_SECONDS if float(s) * fps <= max_frames]
        if fitting:
            lengths = f"seconds {' or '.join(repr(s) for s in fitting)} fit{'s' if len(fitting) == 1 else ''}"
        else:
            lengths = f"none of the openai client's lengths ({', '.join(CLIENT_SECONDS)}) fit"
        top_fps = math.floor(max_frames / seconds)  # the highest fps at which the asked length fits
        other_fps = f"{asked} s fits at fps={top_fps} or lower" if top_fps >= 1 else f"no fps makes {asked} s fit"
        raise ApiError(
            400,
            f"seconds={asked} at fps={fps} is {exact:g} frames, over the server's limit of {max_frames} frames "
            f"(at most {_format_seconds(max_frames / fps)} s at fps={fps}): {lengths} at fps={fps}; {other_fps}",
            param="seconds",
        )
    k = max(0, round((exact - 1) / multiple))
    return min(k, (max_frames - 1) // multiple) * multiple + 1


async def _checked_request(http: Request) -> tuple[VideoCreateRequest, GenerationParams, float | None]:
    """The create routes' body (form or JSON), read and checked: the body, its GenerationParams and its length in
    seconds where that decided the frame count (`_params`). A 4xx naming the field otherwise."""
    # The body is read first (a loading server or a full queue is answered before it is): the
    # request takes a queue place in `submit`, so a silent upload holds none.
    fields, reference = await _read_create_body(http)
    body = parse_fields(VideoCreateRequest, fields)
    lora = check_model(http, body.model, "video", body.lora)
    params, seconds = _params(http, body, reference, lora)
    return body, params, seconds


async def _submit(http: Request, body: VideoCreateRequest, params: GenerationParams, seconds: float | None) -> Job:
    """The queued job; the engine's checks failing name the field as the body does, the scheduler's refusals are
    their answers (503, 429)."""
    try:
        return await http.app.state.scheduler.submit(params, id_prefix="video")
    except RequestError as exc:
        raise _request_error(adapter_error(exc, params), body.size, seconds) from None
    except (Unavailable, QueueFull, InternalError) as exc:
        raise scheduler_error(exc) from None


def _params(
    http: Request, body: VideoCreateRequest, reference: bytes | None, lora: str | dict | None
) -> tuple[GenerationParams, float | None]:
    """The request's GenerationParams (the deploy's defaults filled in; `lora` as `check_model` read it), and its
    length in seconds where that decided the frame count (None: num_frames did)."""
    settings = http.app.state.settings
    limits = settings.engine.limits
    spec = http.app.state.scheduler.engine.spec
    # One deploy file serves text- and image-to-video: defaults for fields a pipeline does not
    # take (the size, for image-to-video) are left out rather than refused on every request.
    defaults = {k: v for k, v in settings.default_sampling_params.items() if spec.takes(k)}
    width = height = None
    if body.size is not None:
        if not spec.takes("width"):
            raise ApiError(
                400,
                f"size is not accepted by {spec.diffusers_class}: the video takes the aspect ratio of the "
                f"{REFERENCE} image",
                param="size",
            )
        try:
            width, height = parse_size(body.size, limits.max_image_size)
        except ValueError as exc:
            raise ApiError(400, str(exc), param="size") from None
    try:
        fps = body.fps if body.fps is not None else defaults.get("fps", spec.default_fps)
        fps = check_int("fps", fps, 1, limits.max_fps)
    except RequestError as exc:
        raise ApiError(400, str(exc), param="fps") from None
    seconds = None if body.seconds is None else _parse_seconds(body.seconds)  # checked even when num_frames wins
    if body.num_frames is not None:
        num_frames, seconds = body.num_frames, None
    elif seconds is not None:
        num_frames = _frames_for(seconds, fps, spec.frame_multiple, limits.max_frames)
    elif "num_frames" in defaults:
        num_frames = defaults["num_frames"]
    else:
        seconds = DEFAULT_SECONDS
        num_frames = _frames_for(seconds, fps, spec.frame_multiple, limits.max_frames)
    given: dict[str, Any] = {f.name: getattr(body, f.name, None) for f in SAMPLING_FIELDS if not f.in_size}
    given.pop("n")
    given.update(height=height, width=width, num_frames=num_frames, fps=fps, lora=lora)
    values = apply_sampling_defaults(given, defaults)
    params = GenerationParams(prompt=body.prompt, image=reference, output_type="uint8", **values)
    return params, seconds


async def _read_create_body(http: Request) -> tuple[dict[str, Any], bytes | None]:
    """The request's fields (text) and the reference image's bytes, from a multipart form or JSON."""
    spec = body_spec(http, REFERENCE, max_files=1, data_urls=True)
    kind = body_media_type(http, "multipart/form-data (as the openai client sends it) or application/json")
    if is_json(kind):
        fields = await read_json_object(http, spec)
        reference = fields.pop(REFERENCE, None)
        if reference is None:
            return fields, None
        if isinstance(reference, dict):
            return fields, _reference_from_object(reference, spec)
        raise ApiError(
            400,
            f"{REFERENCE} must be an object {{'image_url': 'data:image/png;base64,...'}} in JSON (or a file "
            "part of a multipart form)",
            param=REFERENCE,
        )
    if kind not in FORM_TYPES:
        raise unread(
            ApiError(400, f"POST {http.url.path} takes multipart/form-data (as the openai client sends it) or JSON")
        )
    fields: dict[str, Any] = {}
    reference_fields: dict[str, str] = {}
    reference: bytes | None = None
    for key, value in await read_form(http, spec):  # at most one file: the reader refuses a second
        if key == REFERENCE and isinstance(value, FilePart):
            reference = value.data
        elif key.startswith(f"{REFERENCE}[") and key.endswith("]") and not isinstance(value, FilePart):
            reference_fields[key[len(REFERENCE) + 1 : -1]] = value  # the client's spelling of an object
        elif isinstance(value, FilePart):
            raise ApiError(400, f"unexpected file field {key!r}; send the image as {REFERENCE!r}", param=key)
        elif key in fields:
            raise ApiError(400, f"{key} is given more than once", param=key)
        else:
            fields[key] = value
    if reference_fields:
        if reference is not None:
            raise ApiError(400, f"{REFERENCE} is given twice (a file and an object)", param=REFERENCE)
        reference = _reference_from_object(reference_fields, spec)
    return fields, reference


def _reference_from_object(reference: dict[str, Any], spec: BodySpec) -> bytes:
    """{'image_url': a base64 data URL} -> the image's bytes. The server fetches nothing and has no files API."""
    unknown = set(reference) - {"image_url", "file_id"}
    if unknown or "file_id" in reference:
        key = "file_id" if "file_id" in reference else sorted(unknown)[0]
        raise ApiError(
            400,
            f"{REFERENCE}.{key} is not supported: upload the image as a file part, or give image_url as a data URL",
            param=REFERENCE,
        )
    # Named as the field, not `.image_url`: a data URL over the limit gets the same 400 as a file part.
    return decode_data_url(reference.get("image_url"), spec, REFERENCE)
