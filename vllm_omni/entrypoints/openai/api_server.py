"""The OpenAI-style image server over one DiffusionEngine: FastAPI app factory and uvicorn runner.

`vllm-omni serve` (cli/serve.py) calls `run_server(settings)`. Uvicorn listens first and the
engine loads in the background, so /health answers 503 until every worker has loaded (it
doubles as readiness). Requests are validated up front (the engine's own `preprocess`), then
wait in one FIFO queue; a single consumer runs them one at a time (`DiffusionEngine.step`
blocks, so it runs in a thread of its own). A client that disconnects is dropped from the queue
or has its request cancelled at the next denoising step. A watchdog respawns dead workers
while idle and ends the server (exit code 1) when they cannot be brought back. SIGTERM
cancels what is running, closes the workers and exits 0. Never imports vllm.
"""

from __future__ import annotations

import asyncio
import base64
import io
import secrets
import signal
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.datastructures import UploadFile

from vllm_omni.diffusion.data import DiffusionRequest, GenerationParams, RequestCancelled, RequestFailed
from vllm_omni.diffusion.request_fields import SAMPLING_FIELDS
from vllm_omni.entrypoints.deploy_config import EngineSettings, apply_sampling_defaults
from vllm_omni.entrypoints.openai.protocol import (
    ErrorInfo,
    ErrorResponse,
    ImageData,
    ImageEditRequest,
    ImageGenerationRequest,
    ImageResponse,
    ModelCard,
    ModelList,
    parse_size,
)
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

DISCONNECT_POLL_S = 0.25  # how often a waiting request checks whether its client is still there
CLIENT_CLOSED = 499  # nginx's "client closed request"; nobody reads it, but the access log does
EDIT_IMAGE_KEYS = ("image", "image[]")  # plus image[0], image[1], ...: the openai client's list forms


@dataclass
class ServerSettings:
    engine: EngineSettings
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None  # default: engine.model
    api_key: str | None = None
    watchdog_interval_s: float = 2.0
    graceful_shutdown_s: float = 30.0


class ApiError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def response(self) -> JSONResponse:
        kind = {
            400: "invalid_request_error",
            401: "authentication_error",
            404: "not_found_error",
            413: "invalid_request_error",
            429: "rate_limit_error",
            503: "service_unavailable",
        }.get(self.status, "server_error")
        body = ErrorResponse(error=ErrorInfo(message=self.message, type=kind, param=self.param, code=self.code))
        return JSONResponse(body.model_dump(), status_code=self.status)


class _ClientGone(Exception):
    pass


class _ShuttingDown(Exception):
    pass


@dataclass
class _Job:
    request_id: str
    request: DiffusionRequest  # validated by engine.preprocess
    future: asyncio.Future
    queued_at: float = field(default_factory=time.perf_counter)
    started_at: float | None = None
    cancelled: bool = False  # the client left: skip it if it has not started


def _param_of(message: str) -> str | None:
    """The field a validation message starts with ("num_inference_steps must be ..." -> that name)."""
    head = message.split(" ", 1)[0].rstrip(":,")
    head = head.split("[", 1)[0]  # image[1] -> image
    known = set(ImageGenerationRequest.model_fields) | {"image", "height", "width"}
    return head if head in known else None


class ImageServer:
    """The engine, its request queue, its watchdog; the FastAPI routes call into it."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        self.limits = settings.engine.limits
        self.model_names = {settings.served_model_name or settings.engine.model, settings.engine.model}
        self.created = int(time.time())
        self.engine: Any = None  # DiffusionEngine once constructed (its workers may still be loading)
        self.load_error: str | None = None
        self.exit_code = 0
        self.request_exit: Callable[[], None] = lambda: None  # set by run_server: stops uvicorn
        self._engine_lock = threading.Lock()  # engine creation vs. shutdown
        self._step_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-step")
        self._waiting: deque[_Job] = deque()
        self._wakeup: asyncio.Event | None = None
        self._running: _Job | None = None
        self._tasks: list[asyncio.Task] = []
        self._shutting_down = False
        self._loaded = False  # the first load finished; later respawns do not reset it
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._wakeup = asyncio.Event()
        self._tasks = [
            asyncio.create_task(self._load_engine(), name="load-engine"),
            asyncio.create_task(self._consume(), name="consume-queue"),
            asyncio.create_task(self._watchdog(), name="watchdog"),
        ]

    async def _load_engine(self) -> None:
        started = time.perf_counter()
        try:
            await asyncio.to_thread(self._create_engine_and_wait)
        except Exception as exc:  # noqa: BLE001 - any failure to load ends the server
            if self._shutting_down:
                return
            self.load_error = f"{type(exc).__name__}: {exc}"
            logger.error("Could not start the engine for %s: %s", self.settings.engine.model, self.load_error)
            self._fail(1)
            return
        if self.engine is not None and not self._shutting_down:
            self._loaded = True
            logger.info("Engine ready in %.1f s: serving %s", time.perf_counter() - started, self._names())

    def _create_engine_and_wait(self) -> None:
        from vllm_omni.diffusion.engine import DiffusionEngine

        self.settings.engine.apply_devices()
        engine = DiffusionEngine(self.settings.engine.engine_config(), self.limits)
        with self._engine_lock:
            if self._shutting_down:
                engine.close()
                return
            self.engine = engine
        engine.wait_until_ready()

    async def _watchdog(self) -> None:
        while True:
            await asyncio.sleep(self.settings.watchdog_interval_s)
            engine = self.engine
            if engine is None or self._shutting_down:
                continue
            try:
                await asyncio.to_thread(engine.executor.check_workers)
            except Exception as exc:  # noqa: BLE001 - a failed respawn sets executor.failed, handled below
                logger.error("Respawning the workers failed: %s", exc)
            if engine.executor.failed and not self._shutting_down:
                logger.error("The workers cannot be brought back (%s); shutting down", engine.executor.failed)
                self._fail(1)
                return

    def _fail(self, code: int) -> None:
        self.exit_code = code
        self.request_exit()

    def signal_shutdown(self) -> None:
        """Called from a signal handler: schedule `begin_shutdown` on the event loop."""
        if self._loop is not None and not self._loop.is_closed():
            self._loop.call_soon_threadsafe(self.begin_shutdown)

    def begin_shutdown(self) -> None:
        """First reaction to SIGTERM/SIGINT: refuse new work, drop the queue, cancel the running request."""
        if self._shutting_down:
            return
        self._shutting_down = True
        logger.info("Shutting down: cancelling the running request and %d queued one(s)", len(self._waiting))
        while self._waiting:
            job = self._waiting.popleft()
            if not job.future.done():
                job.future.set_exception(_ShuttingDown())
        if self.engine is not None:
            self.engine.executor.begin_shutdown()  # a request that hangs now fails without a restart
        if self._running is not None and self.engine is not None:
            self._running.cancelled = True
            self.engine.cancel(self._running.request_id)

    async def stop(self) -> None:
        """Lifespan end: after uvicorn stopped taking requests. Closes the workers."""
        self.begin_shutdown()
        deadline = time.monotonic() + self.settings.graceful_shutdown_s
        while self._running is not None and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # the cancelled request stops at its next denoising step
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        with self._engine_lock:
            engine = self.engine
        if engine is not None:
            await asyncio.to_thread(engine.close)
            logger.info("Workers shut down")
        self._step_thread.shutdown(wait=False, cancel_futures=True)

    # ---- state --------------------------------------------------------------------------------

    def _names(self) -> str:
        return ", ".join(sorted(self.model_names))

    def health(self) -> tuple[int, dict[str, Any]]:
        """(status code, body) for GET /health: 200 only while every worker is up."""
        engine = self.engine
        if self._shutting_down:
            return 503, {"status": "shutting_down"}
        if self.load_error:
            return 503, {"status": "failed", "detail": self.load_error}
        if engine is None:
            return 503, {"status": "loading"}
        status = engine.executor.status()  # loading, ok, restarting (and why), unhealthy, failed
        return (200 if status.ok else 503), status.to_dict()

    def model_card(self) -> ModelCard:
        engine = self.engine
        settings = self.settings.engine
        return ModelCard(
            id=self.settings.served_model_name or settings.model,
            created=self.created,
            root=settings.model,
            task=engine.spec.task if engine is not None else None,
            ready=engine is not None and engine.is_ready,
            parallel_config=settings.parallel_config.to_dict(),
            default_sampling_params=settings.default_sampling_params,
            limits=asdict(self.limits),
        )

    def _ready_engine(self) -> Any:
        if self._shutting_down:
            raise ApiError(503, "the server is shutting down")
        engine = self.engine
        if engine is not None and engine.executor.failed:
            raise ApiError(503, f"the workers are down: {engine.executor.failed}")
        if engine is None or not self._loaded:
            raise ApiError(503, "the model is still loading; poll GET /health until it answers 200")
        # While a dead worker's group is respawned, requests still queue: the engine waits for it.
        return engine

    # ---- requests -----------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model and model not in self.model_names:
            raise ApiError(
                400,
                f"model {model!r} is not served here; this server serves {self._names()}",
                param="model",
                code="model_not_found",
            )

    async def run(self, http: Request, body: ImageGenerationRequest | ImageEditRequest, images: Any) -> JSONResponse:
        """Validate, queue, wait (watching the client), answer. Shared by generations and edits."""
        self.check_model(body.model)
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
        engine = self._ready_engine()
        width = height = None
        if body.size is not None and body.size.strip().lower() != "auto":
            try:
                width, height = parse_size(body.size, self.limits.max_image_size)
            except ValueError as exc:
                raise ApiError(400, str(exc), param="size") from None
        given = {f.name: getattr(body, f.name) for f in SAMPLING_FIELDS if not f.in_size and not f.video_only}
        values = apply_sampling_defaults(
            dict(given, height=height, width=width), self.settings.engine.default_sampling_params
        )
        if body.size is not None and body.size.strip().lower() == "auto":
            values["height"] = values["width"] = None  # an explicit "auto" beats the deploy's default size
        request_id = f"img-{uuid.uuid4().hex[:16]}"
        params = GenerationParams(prompt=body.prompt, image=images, request_id=request_id, **values)

        # The engine's own checks, before queueing: bad input is answered at once, not after a wait.
        try:
            checked = await asyncio.to_thread(engine.preprocess, params)
        except ValueError as exc:
            message = str(exc)
            param = _param_of(message)
            if param in ("height", "width") and body.size is not None:
                message, param = f"size {body.size!r}: {message}", "size"
            raise ApiError(400, message, param=param) from None
        except Exception as exc:
            logger.exception("Request %s: validation failed unexpectedly", request_id)
            raise ApiError(500, f"could not validate the request: {type(exc).__name__}: {exc}") from None
        # The engine runs exactly what was checked: the drawn seed, the rounded size, the decoded images.
        job = self._enqueue(checked)
        size = f"{checked.width}x{checked.height}" if checked.width else "auto"
        logger.info(
            "Request %s queued: size=%s, steps=%d, seed=%d, n=%d (position %d)",
            request_id,
            size,
            checked.num_inference_steps,
            checked.seed,
            checked.num_images,
            len(self._waiting),
        )
        try:
            output = await self._wait(http, job, engine)
        except _ClientGone:
            return JSONResponse({"error": {"message": "client disconnected"}}, status_code=CLIENT_CLOSED)
        except _ShuttingDown:
            raise ApiError(503, "the server is shutting down; the request was not run") from None
        except RequestCancelled as exc:
            logger.info("Request %s cancelled: %s", request_id, exc)
            if self._shutting_down:
                raise ApiError(503, "the server is shutting down; the request was cancelled") from None
            return JSONResponse({"error": {"message": "cancelled"}}, status_code=CLIENT_CLOSED)
        except ValueError as exc:
            raise ApiError(400, str(exc), param=_param_of(str(exc))) from None
        except RequestFailed as exc:
            logger.error("Request %s failed: %s", request_id, exc)
            raise ApiError(500, f"generation failed: {exc}") from None
        except Exception as exc:
            logger.exception("Request %s failed", request_id)
            raise ApiError(500, f"generation failed: {type(exc).__name__}: {exc}") from None

        fmt = body.output_format or "png"
        encoded = await asyncio.to_thread(_encode_b64, output.images, fmt, body.output_compression)
        done = time.perf_counter()
        logger.info(
            "Request %s done: size=%dx%d, steps=%d, seed=%d, n=%d, %.2f s (%.2f s queued)",
            request_id,
            output.width,
            output.height,
            checked.num_inference_steps,
            output.seed,
            len(encoded),
            done - job.queued_at,
            (job.started_at or done) - job.queued_at,
        )
        response = ImageResponse(
            created=int(time.time()),
            data=[ImageData(b64_json=b64) for b64 in encoded],
            output_format=fmt,
            size=f"{output.width}x{output.height}",
            width=output.width,
            height=output.height,
            seed=output.seed,
            id=request_id,
            timings_ms={k: round(v, 2) for k, v in output.timings_ms.items()},
        )
        return JSONResponse(response.model_dump(), headers={"X-Request-Id": request_id})

    def _enqueue(self, request: DiffusionRequest) -> _Job:
        if len(self._waiting) >= self.limits.max_queue:
            raise ApiError(
                429,
                f"the queue is full ({self.limits.max_queue} request(s) waiting behind the running one); retry later",
                code="queue_full",
            )
        job = _Job(request.request_id, request, asyncio.get_running_loop().create_future())
        self._waiting.append(job)
        self._wakeup.set()
        return job

    async def _wait(self, http: Request, job: _Job, engine: Any) -> Any:
        """The job's result; cancels it when the client goes away or the server shuts down."""
        cancelled = False
        while True:
            done, _ = await asyncio.wait({job.future}, timeout=DISCONNECT_POLL_S)
            if done:
                return job.future.result()
            if cancelled:
                continue
            gone = await http.is_disconnected()
            if not gone and not self._shutting_down:
                continue
            job.cancelled = True  # not started yet: the consumer skips it
            if job in self._waiting:
                self._waiting.remove(job)
                logger.info("Request %s dropped from the queue: client disconnected", job.request_id)
                raise _ClientGone()
            reason = "client disconnected" if gone else "shutting down"
            logger.info("Request %s: %s, cancelling at the next step", job.request_id, reason)
            engine.cancel(job.request_id)
            cancelled = True

    async def _consume(self) -> None:
        """The single consumer: FIFO, one request at a time."""
        loop = asyncio.get_running_loop()
        while True:
            while not self._waiting:
                self._wakeup.clear()
                await self._wakeup.wait()
            job = self._waiting.popleft()
            if job.future.done():
                continue
            self._running = job
            job.started_at = time.perf_counter()
            logger.info("Request %s running (%.2f s in the queue)", job.request_id, job.started_at - job.queued_at)
            try:
                output = await loop.run_in_executor(self._step_thread, self._step, job)
            except BaseException as exc:  # noqa: BLE001 - handed to the waiting request
                if isinstance(exc, asyncio.CancelledError):
                    raise
                if not job.future.done():
                    job.future.set_exception(exc)
            else:
                if not job.future.done():
                    job.future.set_result(output)
            finally:
                self._running = None

    def _step(self, job: _Job) -> Any:
        if job.cancelled:
            raise RequestCancelled(f"request {job.request_id} cancelled before it started")
        return self.engine.step(job.request)


def _encode_b64(images: list[Any], fmt: str, compression: int | None) -> list[str]:
    options = {} if fmt == "png" or compression is None else {"quality": compression}
    encoded = []
    for image in images:
        buffer = io.BytesIO()
        image.save(buffer, format=fmt.upper(), **options)
        encoded.append(base64.b64encode(buffer.getvalue()).decode("ascii"))
    return encoded


# ---- HTTP ---------------------------------------------------------------------------------------


class BearerAuth:
    """ASGI middleware: /v1/* needs `Authorization: Bearer <api key>`; /health stays open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                error = ApiError(401, "missing or wrong API key: send 'Authorization: Bearer <key>'")
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


async def _read_edit_form(http: Request, server: ImageServer) -> tuple[ImageEditRequest, list[bytes]]:
    limits = server.limits
    content_type = http.headers.get("content-type", "")
    # A form without files arrives url-encoded; it is answered "image is required" below.
    if not content_type.startswith(("multipart/form-data", "application/x-www-form-urlencoded")):
        raise ApiError(400, "the edits endpoint takes multipart/form-data (image files and form fields)", param="image")
    length = http.headers.get("content-length")
    body_cap = limits.max_input_images * limits.max_upload_bytes + 1024 * 1024
    if length is not None and length.isdigit() and int(length) > body_cap:
        raise ApiError(413, f"request body is {length} bytes; at most {body_cap} accepted", param="image")
    received = 0

    async def receive_within_cap() -> dict:
        # Content-Length can be absent (chunked uploads): count what actually arrives.
        nonlocal received
        message = await http.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > body_cap:
                raise ApiError(413, f"request body exceeds {body_cap} bytes", param="image")
        return message

    try:
        form = await Request(http.scope, receive_within_cap).form(max_files=limits.max_input_images + 1, max_fields=64)
    except ApiError:
        raise
    except Exception as exc:  # noqa: BLE001 - starlette raises HTTPException / MultiPartException variants
        detail = getattr(exc, "detail", None) or getattr(exc, "message", None) or str(exc)
        raise ApiError(400, f"cannot parse the multipart body: {detail}") from None
    images: list[bytes] = []
    fields: dict[str, str] = {}
    try:
        for key, value in form.multi_items():
            if key in EDIT_IMAGE_KEYS or (key.startswith("image[") and key.endswith("]")):
                if not isinstance(value, UploadFile):
                    raise ApiError(400, f"{key} must be an uploaded file, not a text field", param="image")
                data = await value.read(limits.max_upload_bytes + 1)
                if len(data) > limits.max_upload_bytes:
                    raise ApiError(
                        400,
                        f"image {value.filename or ''!s} is larger than the upload limit of "
                        f"{limits.max_upload_bytes} bytes",
                        param="image",
                    )
                images.append(data)
            elif key == "mask":
                raise ApiError(400, "mask is not supported: these models edit the whole image", param="mask")
            elif isinstance(value, UploadFile):
                raise ApiError(400, f"unexpected file field {key!r}; send images as 'image' or 'image[]'", param=key)
            elif key in fields:
                raise ApiError(400, f"{key} is given more than once", param=key)
            else:
                fields[key] = value
    finally:
        await form.close()
    try:
        body = ImageEditRequest.model_validate(fields)
    except ValidationError as exc:
        raise _validation_error(exc.errors()) from None
    if not images:
        raise ApiError(400, "image is required: upload one or more files as 'image' (or 'image[]')", param="image")
    return body, images


def _validation_error(errors: list[dict]) -> ApiError:
    """pydantic errors -> one 400 naming the first bad field."""
    first = errors[0]
    if first.get("type") == "json_invalid":
        return ApiError(
            400, f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}".rstrip(": ")
        )
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    name = ".".join(loc) or "body"
    if name == "body":
        return ApiError(
            400, "the request body must be a JSON object of request fields (Content-Type: application/json)"
        )
    if first.get("type") == "extra_forbidden":
        return ApiError(400, f"unknown field {name!r}", param=name)
    if first.get("type") == "missing":
        return ApiError(400, f"{name} is required", param=name)
    return ApiError(400, f"{name}: {first.get('msg', 'invalid value')}", param=name)


def build_app(settings: ServerSettings) -> tuple[FastAPI, ImageServer]:
    """The FastAPI app and the ImageServer behind it (the engine starts with the app's lifespan)."""
    server = ImageServer(settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await server.start()
        try:
            yield
        finally:
            await server.stop()

    app = FastAPI(title="vllm_omni", summary="OpenAI-style image API for diffusion transformers", lifespan=lifespan)
    app.state.server = server
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(list(exc.errors())).response()

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = server.health()
        return JSONResponse(body, status_code=status)

    @app.get("/v1/models", response_model=ModelList)
    async def models() -> ModelList:
        return ModelList(data=[server.model_card()])

    @app.post("/v1/images/generations", response_model=ImageResponse)
    async def generations(body: ImageGenerationRequest, request: Request) -> JSONResponse:
        return await server.run(request, body, None)

    @app.post("/v1/images/edits", response_model=ImageResponse)
    async def edits(request: Request) -> JSONResponse:
        server._ready_engine()  # a loading server says so before reading a large upload
        body, images = await _read_edit_form(request, server)
        return await server.run(request, body, images if len(images) > 1 else images[0])

    return app, server


class _Server(uvicorn.Server):
    """uvicorn.Server that tells the ImageServer at the first signal, before connections drain."""

    def __init__(self, config: uvicorn.Config, image_server: ImageServer) -> None:
        super().__init__(config)
        self.image_server = image_server

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.image_server.signal_shutdown()
        super().handle_exit(sig, frame)


def run_server(settings: ServerSettings) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or until the workers are lost for good (1)."""
    app, server = build_app(settings)
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        log_level="info",
    )
    uvicorn_server = _Server(config, server)
    server.request_exit = lambda: setattr(uvicorn_server, "should_exit", True)

    # uvicorn re-raises the signal it caught once it has shut down; this handler receives it (and
    # any signal that arrives before uvicorn installs its own), so the process exits 0, not -15.
    def on_signal(sig: int, frame: Any) -> None:
        uvicorn_server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # Bind before anything starts: a busy port fails here, not after the workers began loading.
    sock = config.bind_socket()
    logger.info(
        "Serving %s on http://%s:%d (parallel config %s%s)",
        settings.served_model_name or settings.engine.model,
        settings.host,
        settings.port,
        settings.engine.parallel_config.to_dict(),
        f", deploy config {settings.engine.deploy_config}" if settings.engine.deploy_config else "",
    )
    uvicorn_server.run(sockets=[sock])
    return server.exit_code
