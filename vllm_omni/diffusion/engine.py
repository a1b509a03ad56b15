"""DiffusionEngine: validate a request, run it on the workers, hand back images.

`step()` = preprocess (validation, size rounding, seed, image decoding) -> add_req_and_wait
(the executor runs it on every rank) -> postprocess (PIL or arrays), and logs the breakdown
users grep for. Used by the offline `Omni` class and by the HTTP server.
"""

from __future__ import annotations

import io
import itertools
import math
import secrets
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np

from vllm_omni.diffusion.attention.backends import check_attention_backend
from vllm_omni.diffusion.data import (
    DiffusionOutput,
    DiffusionRequest,
    EngineLimits,
    GenerationParams,
    OmniDiffusionConfig,
    RequestCancelled,
)
from vllm_omni.diffusion.executor import MultiprocExecutor
from vllm_omni.diffusion.loader import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.request_fields import SAMPLING_FIELDS
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

MAX_SEED = 2**63 - 1


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


def _check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        try:
            if isinstance(value, bool) or float(value) != int(value):
                raise ValueError
            value = int(value)
        except (TypeError, ValueError):
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    if not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    return value


def _check_float(name: str, value: Any, low: float, high: float) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(value) or not low <= value <= high:
        raise ValueError(f"{name} must be between {low} and {high}, got {value}")
    return value


def decode_image(source: Any, limits: EngineLimits, name: str = "image") -> Any:
    """A PIL RGB image from a PIL image, a path or bytes; refuses unreadable or oversized input."""
    from PIL import Image, UnidentifiedImageError

    if isinstance(source, Image.Image):
        image = source
    else:
        if isinstance(source, (str, Path)):
            try:
                source = Path(source).read_bytes()
            except OSError as exc:
                raise ValueError(f"{name}: cannot read {source}: {exc.strerror}") from None
        if not isinstance(source, (bytes, bytearray)):
            raise ValueError(f"{name} must be a PIL image, a file path or image bytes, got {type(source).__name__}")
        if len(source) > limits.max_upload_bytes:
            raise ValueError(f"{name} is {len(source)} bytes; the limit is {limits.max_upload_bytes}")
        try:
            image = Image.open(io.BytesIO(source))
        except Image.DecompressionBombError:
            raise ValueError(f"{name} has too many pixels; the limit is {limits.max_input_pixels}") from None
        except (UnidentifiedImageError, OSError) as exc:
            raise ValueError(f"{name} is not a readable image: {exc}") from None
    width, height = image.size
    if width * height > limits.max_input_pixels:
        raise ValueError(
            f"{name} is {width}x{height} = {width * height} pixels; the limit is {limits.max_input_pixels}"
        )
    try:
        return image.convert("RGB")  # decodes now: truncated files fail here, not in a worker
    except (OSError, ValueError) as exc:
        raise ValueError(f"{name} is not a readable image: {exc}") from None


class DiffusionEngine:
    def __init__(self, config: OmniDiffusionConfig, limits: EngineLimits | None = None) -> None:
        parallel = config.parallel_config
        if parallel.ring_degree > 1:
            raise ValueError("ring_degree > 1 is not supported yet (Ring attention is not built); use ulysses_degree")
        check_attention_backend(config.attention_backend, parallel.mask_sp_padding)
        self.limits = limits or EngineLimits()
        self.model_path = resolve_model_path(config.model)
        self.spec = read_pipeline_spec(self.model_path)
        if parallel.cfg_parallel_size > 1 and not self.spec.cfg_parallel:
            raise ValueError(
                f"cfg_parallel_size={parallel.cfg_parallel_size}: {self.spec.diffusers_class} runs no classifier-free "
                "guidance branches to split (one forward per step); use cfg_parallel_size=1"
            )
        gpus = _cuda_device_count()
        if config.device is None:
            config.device = "cuda" if gpus >= parallel.world_size else "cpu"
        elif config.device == "cuda" and gpus < parallel.world_size:
            raise ValueError(f"device='cuda' needs {parallel.world_size} GPU(s) for this parallel config, found {gpus}")
        if config.dtype is None:
            config.dtype = "bfloat16" if config.device == "cuda" else "float32"
        self.config = config
        self._ids = itertools.count(1)
        self._id_lock = threading.Lock()
        self._cancel_tokens: dict[str, int] = {}  # running request id -> the executor's cancel token
        self._cancelled_early: dict[str, None] = {}  # ids cancelled before they ran (insertion-ordered)
        logger.info(
            "Starting %d worker(s) for %s (%s) on %s, %s, ulysses_degree=%d, cfg_parallel_size=%d, padding=%s",
            parallel.world_size,
            config.model,
            self.spec.diffusers_class,
            config.device,
            config.dtype,
            parallel.ulysses_degree,
            parallel.cfg_parallel_size,
            parallel.padding_mode,
        )
        self.executor = MultiprocExecutor(config, str(self.model_path))

    # ---- lifecycle --------------------------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        self.executor.wait_until_ready(timeout)

    @property
    def is_ready(self) -> bool:
        return self.executor.is_ready

    def is_healthy(self) -> bool:
        return self.executor.is_healthy()

    def close(self) -> None:
        self.executor.shutdown()

    # ---- requests ---------------------------------------------------------------------------

    def new_request_id(self) -> str:
        return f"req-{uuid.uuid4().hex[:12]}"

    def cancel(self, request_id: str) -> None:
        """Stop `request_id` at its next denoising step; a request not started yet will not start."""
        with self._id_lock:
            token = self._cancel_tokens.get(request_id)
            if token is None:
                self._cancelled_early[request_id] = None  # step() checks this when it registers the id
                while len(self._cancelled_early) > 1024:
                    self._cancelled_early.pop(next(iter(self._cancelled_early)))
                return
        logger.info("Cancelling request %s", request_id)
        self.executor.cancel(token)

    def preprocess(self, params: GenerationParams) -> DiffusionRequest:
        """Validate user input into a request; every problem is a ValueError naming the field."""
        start = time.perf_counter()
        limits, spec = self.limits, self.spec
        if not isinstance(params.prompt, str) or not params.prompt.strip():
            raise ValueError("prompt must be a non-empty string")
        if params.output_type not in ("pil", "np", "uint8"):
            raise ValueError(f"output_type must be 'pil', 'np' or 'uint8', got {params.output_type!r}")
        for f in SAMPLING_FIELDS:
            if getattr(params, f.name) is not None and not spec.takes(f.name):
                raise ValueError(f"{f.name} is not accepted by {spec.diffusers_class}")
        if params.negative_prompt is not None and not isinstance(params.negative_prompt, str):
            raise ValueError("negative_prompt must be a string")
        height, width = (self._check_size(n, v) for n, v in (("height", params.height), ("width", params.width)))
        if not spec.input_image_required and (height is None) != (width is None):
            raise ValueError("give both height and width, or neither")
        steps = params.num_inference_steps if params.num_inference_steps is not None else spec.default_steps
        steps = _check_int("num_inference_steps", steps, spec.min_steps, limits.max_steps)
        n = _check_int("n", 1 if params.n is None else params.n, 1, limits.max_n)
        guidance = (
            None if params.guidance_scale is None else _check_float("guidance_scale", params.guidance_scale, 0, 100)
        )
        true_cfg = None
        if spec.takes("true_cfg_scale"):
            # True CFG needs a negative prompt; without one the default is plain sampling, not a warning.
            true_cfg = params.true_cfg_scale
            if true_cfg is None:
                true_cfg = spec.default_true_cfg_scale if params.negative_prompt is not None else 1.0
            true_cfg = _check_float("true_cfg_scale", true_cfg, 0, 100)
        num_frames = fps = None
        if spec.modality == "video":
            num_frames = self._check_frames(params.num_frames)
            fps = _check_int("fps", spec.default_fps if params.fps is None else params.fps, 1, limits.max_fps)
        seed = params.seed
        if seed is None:
            seed = secrets.randbelow(2**31)
            logger.info("No seed given: drew seed %d", seed)
        seed = _check_int("seed", seed, 0, MAX_SEED)

        images = None
        sources = params.image if isinstance(params.image, (list, tuple)) else [params.image]
        sources = [s for s in sources if s is not None]
        if spec.max_input_images == 0 and sources:
            raise ValueError(f"image is not accepted by {spec.diffusers_class} (it takes no input image)")
        if spec.input_image_required and not sources:
            raise ValueError(f"image is required by {spec.diffusers_class}")
        if sources:
            most = min(spec.max_input_images, limits.max_input_images)
            if len(sources) > most:
                raise ValueError(f"image: at most {most} image(s) for this model, got {len(sources)}")
            images = [
                decode_image(s, limits, f"image[{i}]" if len(sources) > 1 else "image") for i, s in enumerate(sources)
            ]

        with self._id_lock:
            token = next(self._ids)
        request_id = params.request_id or self.new_request_id()
        request = DiffusionRequest(
            request_id=request_id,
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            images=images,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance,
            true_cfg_scale=true_cfg,
            num_images=n,
            seed=seed,
            num_frames=num_frames,
            fps=fps,
            cancel_token=token,
            output_type=params.output_type,
        )
        request.preprocess_ms = (time.perf_counter() - start) * 1e3
        return request

    def _check_size(self, name: str, value: Any) -> int | None:
        if value is None:
            return None
        value = _check_int(name, value, 1, self.limits.max_image_size)
        multiple = self.spec.size_multiple
        if value < multiple:
            raise ValueError(f"{name} must be at least {multiple}, got {value}")
        if value % multiple:
            rounded = value // multiple * multiple
            logger.warning("%s=%d is not a multiple of %d: rounded down to %d", name, value, multiple, rounded)
            value = rounded
        return value

    def _check_frames(self, value: Any) -> int | None:
        """None (the pipeline's default) or a frame count the VAE can encode: k * frame_multiple + 1."""
        if value is None:
            return None
        value = _check_int("num_frames", value, 1, self.limits.max_frames)
        multiple = self.spec.frame_multiple
        if (value - 1) % multiple:
            rounded = (value - 1) // multiple * multiple + 1
            logger.warning("num_frames=%d is not k*%d+1: rounded down to %d", value, multiple, rounded)
            value = rounded
        return value

    def step(self, params: GenerationParams | DiffusionRequest) -> DiffusionOutput:
        """Run one request end to end and log the time of each phase.

        A `DiffusionRequest` from `preprocess` (the server validates before queueing) is run as is.
        """
        request = params if isinstance(params, DiffusionRequest) else self.preprocess(params)
        preprocessed = time.perf_counter()
        with self._id_lock:
            if self._cancelled_early.pop(request.request_id, False) is None:
                raise RequestCancelled(f"request {request.request_id} cancelled before it started")
            self._cancel_tokens[request.request_id] = request.cancel_token
        try:
            images = self.executor.execute(request)
        finally:
            self._cancel_tokens.pop(request.request_id, None)
        waited = time.perf_counter()
        output = self.postprocess(request, images, request.output_type)
        done = time.perf_counter()
        timings = {
            "preprocess": request.preprocess_ms,
            "add_req_and_wait": (waited - preprocessed) * 1e3,
            "postprocess": (done - waited) * 1e3,
            "total": request.preprocess_ms + (done - preprocessed) * 1e3,
        }
        logger.info(
            "DiffusionEngine.step breakdown: preprocess=%.2f ms, add_req_and_wait=%.2f ms, "
            "postprocess=%.2f ms, total=%.2f ms",
            *timings.values(),
        )
        output.timings_ms = timings
        return output

    def postprocess(self, request: DiffusionRequest, frames: np.ndarray, output_type: str) -> DiffusionOutput:
        """The workers' array (uint8, or float32 for "np"; [n, H, W, 3], video [n, F, H, W, 3]) -> output."""
        height, width = int(frames.shape[-3]), int(frames.shape[-2])
        video = self.spec.modality == "video"
        if output_type == "pil":
            from PIL import Image

            if video:
                out = [[Image.fromarray(frame) for frame in clip] for clip in frames]
            else:
                out = [Image.fromarray(image) for image in frames]
        else:
            out = list(frames)
        return DiffusionOutput(
            request.request_id,
            out,
            request.seed,
            height,
            width,
            num_frames=int(frames.shape[1]) if video else None,
            fps=request.fps if video else None,
        )
