"""The OpenAI-style server: the FastAPI app (scheduler + routes + error shape + auth) and its uvicorn runner.

`vllm-omni serve` (cli/serve.py) calls `run_server(settings)`. The server has three parts:
the scheduler (diffusion/engine/scheduler.py: the engines, queue, jobs, cancellation, worker health; with
video_store.py keeping the videos API's records and files), the routes (routes/: images,
videos, models and health; /metrics in metrics.py), and the media encoders (media.py). This module wires them:
uvicorn listens first and the engine loads in the background, so /health answers 503 until
every worker has loaded (it doubles as readiness). When the workers are lost for
good, or the model cannot be loaded, the server ends with exit code 1. SIGTERM cancels what is
running, closes the workers and exits 0. Never imports vllm.
"""

from __future__ import annotations

import logging
import secrets
import signal
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.engine.replicas import engine_factory
from vllm_omni.diffusion.engine.scheduler import Scheduler
from vllm_omni.entrypoints.deploy_config import DeployConfig
from vllm_omni.entrypoints.openai import metrics
from vllm_omni.entrypoints.openai.body_limits import BodyLimits
from vllm_omni.entrypoints.openai.errors import ApiError, install_error_handlers
from vllm_omni.entrypoints.openai.metrics import CountHTTP, ServerMetrics
from vllm_omni.entrypoints.openai.routes import chat, images, models, videos
from vllm_omni.entrypoints.openai.routes.bodies import BodyReads
from vllm_omni.entrypoints.openai.video_store import VideoStorageSettings, VideoStore
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


@dataclass
class CorsSettings:
    """--allowed-origins and its companions (vLLM's flags); no origins: no CORS headers at all."""

    allowed_origins: list[str] | None = None
    allowed_methods: list[str] = field(default_factory=lambda: ["*"])
    allowed_headers: list[str] = field(default_factory=lambda: ["*"])
    allow_credentials: bool = False


@dataclass
class ServerSettings:
    engine: EngineArgs
    deploy: DeployConfig | None = None  # the deploy YAML: its GPUs and request defaults
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None  # default: engine.model
    api_key: str | None = None
    watchdog_interval_s: float = 2.0
    graceful_shutdown_s: float = 30.0
    videos: VideoStorageSettings = field(default_factory=VideoStorageSettings)
    bodies: BodyLimits = field(default_factory=BodyLimits)  # request bodies: deadline, text field size, reads at once
    cors: CorsSettings = field(default_factory=CorsSettings)
    root_path: str = ""  # the prefix a proxy strips (--root-path)
    ssl_keyfile: str | None = None
    ssl_certfile: str | None = None
    uvicorn_log_level: str = "info"
    log_requests: bool = True  # False: --disable-log-requests

    @property
    def default_sampling_params(self) -> dict[str, Any]:
        """The deploy's request defaults ({} without a deploy YAML)."""
        return self.deploy.default_sampling_params if self.deploy is not None else {}

    @property
    def model_names(self) -> set[str]:
        """Names a request may give as `model`: the served name and the model as given."""
        return {self.served_model_name or self.engine.model, self.engine.model}


class BearerAuth:
    """ASGI middleware: /v1/* and /metrics need `Authorization: Bearer <api key>` (scheme in any case);
    /health stays open."""

    def __init__(self, app: Any, api_key: str) -> None:
        self.app = app
        self.expected = api_key.encode()

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        path = scope.get("path", "")
        root = scope.get("root_path", "")
        if root and path.startswith(root):  # uvicorn's path includes --root-path; the routes' does not
            path = path[len(root) :]
        if scope["type"] == "http" and (path.startswith("/v1") or path == "/metrics"):
            given = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, key = given.strip().partition(b" ")
            # The scheme is case-insensitive (RFC 7235); the key is compared in constant time.
            if scheme.lower() != b"bearer" or not secrets.compare_digest(key.strip(), self.expected):
                error = ApiError(
                    401,
                    "missing or wrong API key: send 'Authorization: Bearer <key>'",
                    headers={"WWW-Authenticate": "Bearer"},
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(settings: ServerSettings) -> tuple[FastAPI, Scheduler]:
    """The FastAPI app and the scheduler behind it (the engine starts with the app's lifespan).

    Takes the video directory now (a ValueError when another server holds it), before anything starts.
    """

    def pin_devices() -> None:  # a deploy's `devices`, before each replica's engine starts
        if settings.deploy is not None:
            settings.deploy.apply_devices(settings.engine)

    scheduler = Scheduler(
        engine_factory(settings.engine.engine_config, settings.engine.limits, prepare=pin_devices),
        settings.engine.limits,
        watchdog_interval_s=settings.watchdog_interval_s,
        replicas=settings.engine.parallel_config.data_parallel_size,
        batching=settings.engine.batching,
        scheduling_policy=settings.engine.scheduling_policy,
        max_num_seqs=settings.engine.max_num_seqs,
    )
    server_metrics = ServerMetrics(scheduler, settings.served_model_name or settings.engine.model)
    scheduler.observer = server_metrics
    video_store = VideoStore(settings.videos, scheduler)
    video_store.open()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await scheduler.start()
        try:
            yield
        finally:
            await scheduler.stop(settings.graceful_shutdown_s)
            await video_store.close(settings.graceful_shutdown_s)  # after the jobs ended: their records are final

    app = FastAPI(
        title="vllm_omni", summary="OpenAI-style image and video API for diffusion transformers", lifespan=lifespan
    )
    app.state.settings = settings
    app.state.scheduler = scheduler
    app.state.videos = video_store
    app.state.created = int(time.time())
    app.state.metrics = server_metrics
    app.state.body_reads = body_reads = BodyReads(settings.bodies.max_reads)
    server_metrics.bodies_reading.set_function(lambda: body_reads.active)
    if settings.api_key:
        app.add_middleware(BearerAuth, api_key=settings.api_key)
    cors = settings.cors
    if cors.allowed_origins:  # outside the key's check: a browser's preflight carries no key
        app.add_middleware(
            CORSMiddleware,
            allow_origins=cors.allowed_origins,
            allow_methods=cors.allowed_methods,
            allow_headers=cors.allowed_headers,
            allow_credentials=cors.allow_credentials,
        )
    app.add_middleware(CountHTTP, metrics=server_metrics)  # outermost: refusals by the key are counted too
    install_error_handlers(app)
    app.include_router(models.router)
    app.include_router(metrics.router)
    app.include_router(images.router)
    app.include_router(chat.router)
    app.include_router(videos.router)
    return app, scheduler


class _NoRequestLines(logging.Filter):
    """--disable-log-requests: drops the scheduler's per-request lines ("Request %s queued", "running", "done")."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= logging.WARNING or not str(record.msg).startswith("Request %s")


class _Server(uvicorn.Server):
    """uvicorn.Server that tells the scheduler at the first signal, before connections drain."""

    def __init__(self, config: uvicorn.Config, scheduler: Scheduler) -> None:
        super().__init__(config)
        self.scheduler = scheduler

    def handle_exit(self, sig: int, frame: Any) -> None:
        self.scheduler.begin_shutdown_threadsafe()
        super().handle_exit(sig, frame)


def run_server(settings: ServerSettings) -> int:
    """Serve until SIGTERM/SIGINT (exit code 0) or until the workers are lost for good (1)."""
    app, scheduler = build_app(settings)
    if not settings.log_requests:
        logging.getLogger(Scheduler.__module__).addFilter(_NoRequestLines())
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        timeout_graceful_shutdown=settings.graceful_shutdown_s,
        log_level=settings.uvicorn_log_level,
        root_path=settings.root_path,
        ssl_keyfile=settings.ssl_keyfile,
        ssl_certfile=settings.ssl_certfile,
    )
    server = _Server(config, scheduler)
    exit_code = 0

    def on_fatal(reason: str) -> None:
        nonlocal exit_code
        exit_code = 1
        server.should_exit = True

    scheduler.on_fatal = on_fatal

    # uvicorn re-raises the signal it caught once it has shut down; this handler receives it (and
    # any signal that arrives before uvicorn installs its own), so the process exits 0, not -15.
    def on_signal(sig: int, frame: Any) -> None:
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    # Bind before anything starts: a busy port fails here, not after the workers began loading.
    sock = config.bind_socket()
    logger.info(
        "Serving %s on %s://%s:%d%s (parallel config %s%s)",
        settings.served_model_name or settings.engine.model,
        "https" if settings.ssl_certfile else "http",
        settings.host,
        settings.port,
        settings.root_path,
        settings.engine.parallel_config.to_dict(),
        f", deploy config {settings.deploy.path}" if settings.deploy is not None else "",
    )
    server.run(sockets=[sock])
    return exit_code
