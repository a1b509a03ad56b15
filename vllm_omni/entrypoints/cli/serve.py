"""`vllm-omni serve MODEL [flags]` (and `vllm serve MODEL --omni [flags]`): the flags and the command.

`add_engine_args` defines the flags shared with `vllm-omni generate` (parallelism, padding,
device, limits, deploy YAML); `engine_settings_from_args` merges them over the YAML, letting
only the flags the user actually gave override it (every such flag defaults to None). cli/main.py
builds the parser from here; this module stays free of torch and FastAPI so `--help` is fast.
"""

from __future__ import annotations

import argparse
import math
import os
from pathlib import Path
from typing import Any

from vllm_omni.diffusion.config import (
    CACHE_POLICIES,
    DTYPES,
    EXECUTOR_BACKENDS,
    QUANTIZATION_METHODS,
    BatchingConfig,
    EngineLimits,
    StepCacheConfig,
)
from vllm_omni.diffusion.models.registry import FAMILIES, TINY_MODELS
from vllm_omni.entrypoints.openai.body_limits import BodyLimits
from vllm_omni.entrypoints.openai.video_store import VideoStorageSettings

DEFAULT_LIMITS = EngineLimits()
DEFAULT_BATCHING = BatchingConfig()
DEFAULT_BODY_LIMITS = BodyLimits()
DEFAULT_VIDEO_STORAGE = VideoStorageSettings()

# Flag -> (EngineLimits field, help). Defaults come from EngineLimits, the one place they live.
LIMIT_FLAGS: dict[str, tuple[str, str]] = {
    "--max-image-size": ("max_image_size", "largest width or height of an output image, in pixels"),
    "--max-steps": ("max_steps", "largest num_inference_steps a request may ask for"),
    "--max-n": ("max_n", "most images (n) one request may ask for"),
    "--max-input-images": ("max_input_images", "most source images one edit request may upload"),
    "--max-upload-bytes": ("max_upload_bytes", "largest uploaded image file, in bytes"),
    "--max-input-pixels": (
        "max_input_pixels",
        "largest decoded source image, width*height (uploads claiming more are refused before decoding)",
    ),
    "--max-prompt-tokens": (
        "max_prompt_tokens",
        "longest prompt (and negative prompt), in the model's tokens; a pipeline that reads fewer refuses "
        "beyond its own limit",
    ),
    "--max-frames": ("max_frames", "most video frames one request may ask for"),
    "--max-fps": ("max_fps", "largest video fps a request may ask for"),
    "--max-tokens-per-step": (
        "max_tokens_per_step",
        "most image (video) tokens one denoising step may process: the output's latent patches x latent frames, "
        "plus reference images' tokens where the model adds them; bounds a step's time against --stall-timeout",
    ),
}


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive number of seconds, got {text}")
    return value


def non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}") from None
    if not math.isfinite(value) or value < 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text}")
    return value


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Flags that shape the engine; shared by `serve` and `generate`."""
    parser.add_argument(
        "model",
        help=f"model to serve: a tiny embedded model ({', '.join(TINY_MODELS)}), a local diffusers folder, "
        "or a hub id already in the Hugging Face cache",
    )
    parser.add_argument(
        "--deploy-config",
        metavar="PATH",
        default=None,
        help="deploy YAML (stages[0]: devices, parallel_config, default_sampling_params), or the name of a "
        "packaged one (qwen_image, qwen_image_edit); flags given on the command line override it",
    )

    par = parser.add_argument_group("parallelism (world size = cfg_parallel_size * ulysses_degree * ring_degree)")
    par.add_argument(
        "--ulysses-degree",
        type=positive_int,
        default=None,
        metavar="N",
        help="Ulysses sequence-parallel degree: GPUs (or CPU worker processes) that split each request; "
        "must divide the model's attention heads (default: 1)",
    )
    par.add_argument(
        "--ring-degree", type=positive_int, default=None, metavar="N", help="Ring attention degree (default: 1)"
    )
    par.add_argument(
        "--cfg-parallel-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="2 runs the positive and negative CFG branches on separate ranks (default: 1)",
    )
    par.add_argument(
        "--mask-sp-padding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="mask the SP padding tokens (exact, masked attention kernel) instead of trimming them "
        "(default: off; --no-mask-sp-padding overrides a deploy YAML that turns it on)",
    )
    par.add_argument(
        "--trim-sp-padding",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="with the mask off, slice the SP padding off after the all-to-all (exact, dense kernel); "
        "--no-trim-sp-padding leaves it in unmasked (dense, approximate, warns once) (default: on)",
    )
    par.add_argument(
        "--data-parallel-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="replicas: N groups of cfg_parallel_size x ulysses_degree ranks, each on its own GPUs, behind one "
        "queue; a request runs on an idle replica (default: 1)",
    )
    par.add_argument(
        "--vae-parallel",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="tile the VAE decode and split the tiles over every rank (equal to one rank's tiled decode); "
        "--no-vae-parallel decodes whole on every rank (default: on with several ranks at sizes where it pays)",
    )
    par.add_argument(
        "--distributed-executor-backend",
        choices=EXECUTOR_BACKENDS,
        default=None,
        help="who starts the ranks: mp, one process each on this machine; ray, one Ray actor each, across the "
        "machines of a Ray cluster (pip install 'vllm_omni[ray]'; docs/multinode.md) (default: mp)",
    )
    par.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDRESS",
        help="with --distributed-executor-backend ray: the cluster to join, 'auto' (the one `ray start` runs on "
        "this machine) or HEAD_IP:6379 (default: a private Ray instance on this machine; RAY_ADDRESS is not read)",
    )

    eng = parser.add_argument_group("engine")
    eng.add_argument(
        "--device",
        choices=("cuda", "cpu"),
        default=None,
        help="where the workers run (default: cuda when there are world-size GPUs, else cpu)",
    )
    eng.add_argument(
        "--dtype",
        default=None,
        help=f"weights and activations: {', '.join(DTYPES)} (default: bfloat16 on cuda, float32 on cpu)",
    )
    eng.add_argument(
        "--quantization",
        choices=QUANTIZATION_METHODS,
        default=None,
        help="fp8: the denoisers' large linear layers run FP8 matmuls (torchao float8 dynamic activation and "
        "weight, row-wise scales; CUDA GPUs of compute capability 8.9+, bfloat16; pip install 'vllm_omni[fp8]'); "
        "YAML stages[0].quantization (default: none)",
    )
    eng.add_argument(
        "--cache",
        choices=CACHE_POLICIES,
        default=None,
        help="step caching in the denoisers: first_block (diffusers' First-Block-Cache: a step whose first block "
        "changed little since the last computed step skips the other blocks; decided for the whole SP group); "
        "YAML stages[0].cache (default: none)",
    )
    eng.add_argument(
        "--cache-threshold",
        type=float,
        default=None,
        help=f"the step cache's threshold: higher skips more steps (default: {StepCacheConfig.threshold})",
    )
    eng.add_argument(
        "--attention-backend",
        default=None,
        help="attention kernel: sdpa (dense) or sdpa_masked (default: sdpa_masked when the padding is "
        "masked, else sdpa; env VLLM_OMNI_ATTENTION_BACKEND)",
    )

    eng.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="run one short request at the deploy's default size once the workers are up, before /health "
        "answers 200, so the first user request does not pay compilation and graph capture "
        "(default: on for CUDA, off for CPU and with --enforce-eager)",
    )
    eng.add_argument(
        "--enforce-eager",
        action="store_true",
        help="run the transformer eagerly: no CUDA graphs (CUDA only; CPU always runs eagerly)",
    )

    eng.add_argument(
        "--load-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="every worker must have loaded the model within this, or the start fails "
        "(default: env VLLM_OMNI_LOAD_TIMEOUT_S, else 600)",
    )
    eng.add_argument(
        "--stall-timeout",
        type=positive_seconds,
        default=None,
        metavar="SECONDS",
        help="a request in which no worker reports progress (a finished step) for this long fails and the "
        "workers restart (default: env VLLM_OMNI_STALL_TIMEOUT_S, else 300)",
    )

    lim = parser.add_argument_group("limits (requests beyond them are refused with 400 naming the field)")
    for flag, (name, text) in LIMIT_FLAGS.items():
        default = getattr(DEFAULT_LIMITS, name)
        if default is None:  # the model's own (models/registry.py)
            default = "the model's: " + ", ".join(f"{f.package} {getattr(f.specs[0], name)}" for f in FAMILIES)
        lim.add_argument(flag, type=positive_int, default=None, metavar="N", help=f"{text} (default: {default})")


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
        "--max-queue",
        type=positive_int,
        default=None,
        metavar="N",
        help=f"requests that may wait behind the running one; more get 429 (default: {DEFAULT_LIMITS.max_queue})",
    )
    srv.add_argument(
        "--max-batch-size",
        type=positive_int,
        default=None,
        metavar="N",
        help="request batching: up to N queued requests that can share a forward (same size, frames, steps and "
        "guidance; n=1, no source images) run as one pipeline call, each with its own seed (default: "
        f"{DEFAULT_BATCHING.max_batch_size}, off; YAML stages[0].batching)",
    )
    srv.add_argument(
        "--batch-wait-ms",
        type=non_negative_float,
        default=None,
        metavar="MS",
        help="how long a request that could be batched waits for company before it runs alone "
        f"(default: {DEFAULT_BATCHING.batch_wait_ms:g})",
    )
    srv.add_argument(
        "--body-read-timeout",
        type=positive_seconds,
        default=DEFAULT_BODY_LIMITS.read_timeout_s,
        metavar="SECONDS",
        help="a request's whole body (JSON, or a form with its uploads) must arrive within this, or the request "
        f"gets 408 and gives back its queue place (default: {DEFAULT_BODY_LIMITS.read_timeout_s:g})",
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


def engine_settings_from_args(args: argparse.Namespace) -> Any:
    """The deploy YAML with the flags the user gave laid over it (an `EngineSettings`)."""
    from vllm_omni.entrypoints.deploy_config import EngineSettings

    limit_overrides = {name: getattr(args, flag[2:].replace("-", "_")) for flag, (name, _) in LIMIT_FLAGS.items()}
    limit_overrides["max_queue"] = getattr(args, "max_queue", None)
    return EngineSettings.resolve(
        args.model,
        deploy_config=args.deploy_config,
        parallel_overrides={
            "ulysses_degree": args.ulysses_degree,
            "ring_degree": args.ring_degree,
            "cfg_parallel_size": args.cfg_parallel_size,
            "mask_sp_padding": args.mask_sp_padding,
            "trim_sp_padding": args.trim_sp_padding,
            "vae_parallel": args.vae_parallel,
            "data_parallel_size": args.data_parallel_size,
            "distributed_executor_backend": args.distributed_executor_backend,
        },
        device=args.device,
        dtype=args.dtype,
        attention_backend=args.attention_backend,
        enforce_eager=args.enforce_eager,
        quantization=args.quantization,
        cache_overrides={"policy": args.cache, "threshold": args.cache_threshold},
        ray_address=args.ray_address,
        limit_overrides=limit_overrides,
        batching_overrides={
            "max_batch_size": getattr(args, "max_batch_size", None),
            "batch_wait_ms": getattr(args, "batch_wait_ms", None),
        },
        warmup=args.warmup,
        load_timeout_s=args.load_timeout,
        stall_timeout_s=args.stall_timeout,
    )


def cmd_serve(args: argparse.Namespace) -> int:
    """Start the HTTP server; returns the process exit code."""
    from vllm_omni.entrypoints.openai.api_server import ServerSettings, run_server

    engine = engine_settings_from_args(args)
    settings = ServerSettings(
        engine=engine,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name or args.model,
        api_key=args.api_key if args.api_key is not None else os.environ.get("VLLM_API_KEY") or None,
        bodies=BodyLimits(read_timeout_s=args.body_read_timeout),
        videos=VideoStorageSettings(
            directory=Path(args.video_dir) if args.video_dir else None,
            max_age_s=args.video_max_age,
            max_bytes=args.video_max_bytes,
            max_videos=args.video_max_videos,
        ),
    )
    return run_server(settings)
