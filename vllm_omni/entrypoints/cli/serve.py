"""`vllm-omni serve MODEL [flags]` (and `vllm serve MODEL --omni [flags]`): the flags and the command.

`add_engine_args` defines the flags shared with `vllm-omni generate`: one per `EngineArgs` option
(diffusion/engine/args.py) and the deploy YAML; `engine_args_from_cli` lays the flags the user
actually gave over the YAML's options (every such flag defaults to None). cli/main.py builds the
parser from here; this module stays free of torch and FastAPI so `--help` is fast.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

from vllm_omni.diffusion.engine.args import EngineArgs, positive_int, positive_seconds
from vllm_omni.entrypoints.openai.body_limits import BodyLimits
from vllm_omni.entrypoints.openai.video_store import VideoStorageSettings

if TYPE_CHECKING:
    from vllm_omni.entrypoints.deploy_config import DeployConfig

DEFAULT_BODY_LIMITS = BodyLimits()
DEFAULT_VIDEO_STORAGE = VideoStorageSettings()


def add_engine_args(parser: argparse.ArgumentParser, server: bool = True) -> None:
    """Flags that shape the engine; shared by `serve` and `plan`, and by `generate` (`server=False`: without the
    options only a server uses)."""
    from vllm_omni.entrypoints.deploy_config import packaged_deploys

    EngineArgs.add_cli_args(parser, server)  # the model and one flag per engine option
    parser.add_argument(
        "--deploy-config",
        metavar="PATH",
        default=None,
        help="deploy YAML (stages[0]: devices, parallel_config, default_sampling_params), or the name of a "
        f"packaged one ({', '.join(packaged_deploys())}); flags given on the command line override it",
    )
    parser.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=positive_int,
        default=1,
        metavar="N",
        help="vLLM's flag, accepted as 1 only: a diffusion transformer here is split with --ulysses-degree "
        "(and --cfg-parallel-size), not by tensor parallelism",
    )


def engine_args_from_cli(args: argparse.Namespace) -> tuple[EngineArgs, DeployConfig | None]:
    """The deploy YAML's options with the flags the user gave laid over them (checked), and the deploy."""
    from vllm_omni.entrypoints.deploy_config import load_deploy_config

    if args.tensor_parallel_size > 1:
        raise ValueError(
            f"--tensor-parallel-size {args.tensor_parallel_size}: tensor parallelism is not built here; split each "
            f"request with --ulysses-degree {args.tensor_parallel_size} (sequence parallel) and, for CFG models, "
            "--cfg-parallel-size 2"
        )
    deploy = load_deploy_config(args.deploy_config) if args.deploy_config else None
    engine = EngineArgs.from_layers(args.model, deploy.options if deploy else {}, EngineArgs.cli_values(args))
    priority = deploy.default_sampling_params.get("priority", 0) if deploy else 0
    if priority != 0 and engine.scheduling_policy != "priority":
        # Every request would carry it and be refused (a 400 naming priority): the start is refused instead.
        raise ValueError(
            f"{args.deploy_config}: default_sampling_params.priority {priority!r} needs --scheduling-policy priority "
            f"(this server would schedule {engine.scheduling_policy})"
        )
    return engine, deploy


def check_port(host: str, port: int) -> None:
    """Refuse (ValueError, one line) an address uvicorn could not bind, before anything starts or says Serving.
    The socket is bound as uvicorn binds it (its family, SO_REUSEADDR: a port whose old connections linger in
    TIME_WAIT is free, one a listener holds is not) and closed again."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except (OSError, OverflowError) as exc:  # OverflowError: a port outside 0-65535
            if getattr(exc, "errno", None) == errno.EADDRINUSE:
                raise ValueError(f"port {port} on {host} is in use: choose another with --port") from None
            # A name that does not resolve, an address not this machine's, a port below 1024 without root.
            reason = (getattr(exc, "strerror", None) or str(exc)).rstrip(".")
            raise ValueError(f"cannot listen on {host} port {port}: {reason}: check --host and --port") from None


def check_before_start(engine: EngineArgs) -> None:
    """What would refuse the engine, checked before anything starts or says Serving: the model found (a hub model
    downloaded here, with its progress bars), its pipeline served, the options it cannot take, a missing extra,
    a `--lora-modules` file that is no adapter. A ValueError (one line) says which; cli/main.py prints it with exit
    code 2. The engine checks all of it again. Imports torch only for the options that need a device (quantization,
    attention backend) and to build a tiny model or a tiny adapter."""
    from vllm_omni.diffusion.engine.adapters import check_lora_modules
    from vllm_omni.diffusion.model_source import (
        RAY_MISSING,
        check_pipeline_options,
        check_ulysses_degree,
        read_pipeline_spec,
        resolve_model_path,
    )

    config = engine.engine_config()
    parallel = config.parallel_config
    ray = parallel.distributed_executor_backend == "ray"
    if ray:  # first: before a download that would be of no use
        try:
            import ray as _  # noqa: F401
        except ImportError as exc:
            if exc.name is None or not exc.name.startswith("ray"):
                raise
            raise ValueError(RAY_MISSING) from exc
    # Also before the download; whether an adapter fits the model is the engine's check, once it is loaded.
    check_lora_modules(config.lora_modules or {})
    path = resolve_model_path(config.model, config.download_dir, config.revision)
    spec = read_pipeline_spec(path)
    check_ulysses_degree(path, parallel.ulysses_degree, parallel.ring_degree, spec.heads_over_sp_group)
    check_pipeline_options(spec, parallel.cfg_parallel_size, engine.cache)
    if ray:
        return  # the device is the cluster's: the engine picks it once it has joined
    if config.attention_backend is not None:
        from vllm_omni.diffusion.attention.backends import check_attention_backend

        try:
            check_attention_backend(config.attention_backend, parallel.mask_sp_padding)
        except ImportError as exc:  # a missing extra (cudnn_fp8's frontend)
            raise ValueError(str(exc)) from exc
    if config.quantization is not None:
        import torch

        from vllm_omni.diffusion.worker.quantization import check_quantization

        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        device = config.device or ("cuda" if gpus >= parallel.world_size else "cpu")
        dtype = config.dtype or ("bfloat16" if device == "cuda" else "float32")
        try:
            check_quantization(config.quantization, device, dtype)
        except ImportError as exc:  # torchao, the fp8 extra
            raise ValueError(str(exc)) from exc


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    srv = parser.add_argument_group("server")
    srv.add_argument("--host", default="0.0.0.0", help="address to listen on (default: 0.0.0.0)")
    srv.add_argument("--port", type=int, default=8000, metavar="PORT", help="port to listen on (default: 8000)")
    srv.add_argument(
        "--served-model-name",
        default=None,
        metavar="NAME",
        help="the model name clients send and /v1/models lists (default: MODEL as given); requests may name either",
    )
    srv.add_argument(
        "--api-key",
        default=None,
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' on /v1/* (default: env VLLM_API_KEY, else no auth); "
        "/health stays open",
    )
    srv.add_argument(
        "--root-path",
        default=None,
        metavar="PATH",
        help="the path prefix a proxy in front of the server strips (FastAPI's root_path; vLLM's flag)",
    )
    srv.add_argument("--ssl-keyfile", default=None, metavar="PATH", help="serve HTTPS with this private key")
    srv.add_argument("--ssl-certfile", default=None, metavar="PATH", help="serve HTTPS with this certificate")
    srv.add_argument(
        "--uvicorn-log-level",
        default="info",
        choices=("critical", "error", "warning", "info", "debug", "trace"),
        help="uvicorn's log level: its start and access lines (default: info)",
    )
    srv.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="do not log the server's lines for each request (queued, running, done); the engine's step "
        "breakdown and warnings are still logged",
    )
    srv.add_argument(
        "--allowed-origins",
        nargs="+",
        type=_json_list,
        default=None,
        metavar="ORIGIN",
        help="answer cross-origin (CORS) requests from these origins, '*' for any; a list or one JSON list "
        "(vLLM's flag; default: no CORS headers)",
    )
    srv.add_argument(
        "--allowed-methods",
        nargs="+",
        type=_json_list,
        default=None,
        metavar="METHOD",
        help="with --allowed-origins: the methods allowed (default: *)",
    )
    srv.add_argument(
        "--allowed-headers",
        nargs="+",
        type=_json_list,
        default=None,
        metavar="HEADER",
        help="with --allowed-origins: the request headers allowed (default: *)",
    )
    srv.add_argument(
        "--allow-credentials",
        action="store_true",
        help="with --allowed-origins: allow cookies and Authorization on cross-origin requests",
    )
    srv.add_argument(
        "--body-read-timeout",
        type=positive_seconds,
        default=DEFAULT_BODY_LIMITS.read_timeout_s,
        metavar="SECONDS",
        help="a request's whole body (JSON, or a form with its uploads) must arrive within this, or the request "
        f"gets 408 (default: {DEFAULT_BODY_LIMITS.read_timeout_s:g})",
    )
    srv.add_argument(
        "--max-body-reads",
        type=positive_int,
        default=DEFAULT_BODY_LIMITS.max_reads,
        metavar="N",
        help="request bodies read at once (a body is read before its request takes a queue place); more get 429. "
        f"Bounds the memory of uploads in flight (default: {DEFAULT_BODY_LIMITS.max_reads})",
    )

    vid = parser.add_argument_group("videos API storage (finished videos are MP4 files, kept until deleted or evicted)")
    vid.add_argument(
        "--video-dir",
        default=None,
        metavar="DIR",
        help="where finished videos and their job records are kept; with it, finished videos survive a restart "
        "(jobs a restart interrupted end failed) and one server at a time may use DIR (default: a temporary "
        "directory per server, removed when it stops)",
    )
    vid.add_argument(
        "--video-max-age",
        type=positive_int,
        default=DEFAULT_VIDEO_STORAGE.max_age_s,
        metavar="SECONDS",
        help=f"a finished video is deleted this long after it finished (default: {DEFAULT_VIDEO_STORAGE.max_age_s})",
    )
    vid.add_argument(
        "--video-max-bytes",
        type=positive_int,
        default=DEFAULT_VIDEO_STORAGE.max_bytes,
        metavar="N",
        help="the stored MP4s together; beyond it the oldest finished videos are deleted first "
        f"(default: {DEFAULT_VIDEO_STORAGE.max_bytes}, 10 GiB)",
    )
    vid.add_argument(
        "--video-max-videos",
        type=positive_int,
        default=DEFAULT_VIDEO_STORAGE.max_videos,
        metavar="N",
        help="finished videos kept (failed ones count too); beyond it the oldest are deleted first "
        f"(default: {DEFAULT_VIDEO_STORAGE.max_videos})",
    )


def _json_list(text: str) -> list[str]:
    """One item, or vLLM's spelling: a JSON list of them ('["https://a.example"]')."""
    if not text.startswith("["):
        return [text]
    try:
        items = json.loads(text)
    except ValueError:
        items = None
    if not isinstance(items, list) or not all(isinstance(item, str) for item in items):
        raise argparse.ArgumentTypeError(f"expected a value or a JSON list of strings, got {text!r}")
    return items


def _flat(values: list[list[str]] | None) -> list[str] | None:
    return None if values is None else [item for items in values for item in items]


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the HTTP server; returns the process exit code."""
    from vllm_omni.entrypoints.openai.api_server import CorsSettings, ServerSettings, run_server

    engine, deploy = engine_args_from_cli(args)
    if args.allowed_origins is None:
        given = [
            flag
            for flag, value in (
                ("--allowed-methods", args.allowed_methods),
                ("--allowed-headers", args.allowed_headers),
                ("--allow-credentials", args.allow_credentials),
            )
            if value
        ]
        if given:
            raise ValueError(f"{', '.join(given)} without --allowed-origins: give the origins CORS allows too")
    check_port(args.host, args.port)  # first: before a download, and before the workers load
    check_before_start(engine)
    settings = ServerSettings(
        engine=engine,
        deploy=deploy,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model,
        api_key=args.api_key if args.api_key is not None else os.environ.get("VLLM_API_KEY") or None,
        root_path=args.root_path or "",
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        uvicorn_log_level=args.uvicorn_log_level,
        log_requests=not args.disable_log_requests,
        cors=CorsSettings(
            allowed_origins=_flat(args.allowed_origins),
            allowed_methods=_flat(args.allowed_methods) or ["*"],
            allowed_headers=_flat(args.allowed_headers) or ["*"],
            allow_credentials=args.allow_credentials,
        ),
        bodies=BodyLimits(read_timeout_s=args.body_read_timeout, max_reads=args.max_body_reads),
        videos=VideoStorageSettings(
            directory=Path(args.video_dir) if args.video_dir else None,
            max_age_s=args.video_max_age,
            max_bytes=args.video_max_bytes,
            max_videos=args.video_max_videos,
        ),
    )
    return run_server(settings)
