"""DiffusionEngine: validate a request, run it on the workers, hand back images.

`step()` = preprocess (preprocess.py: validation, the sizes and seed the pipeline would pick,
prompt tokens, image headers) -> add_req_and_wait (the executor runs it on every rank) ->
postprocess (PIL or arrays), and logs the breakdown users grep for. Used by the offline `Omni`
class and by the HTTP server's scheduler, which reads the workers' state only through
`health_status()`, `restarts`, `check_workers()` and `begin_shutdown()`.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
import time
import uuid
from typing import Any, Literal

import numpy as np

from vllm_omni.diffusion.attention.backends import check_attention_backend
from vllm_omni.diffusion.config import EngineLimits, Envelope, OmniDiffusionConfig
from vllm_omni.diffusion.engine import admission
from vllm_omni.diffusion.engine.adapters import LoraRegistry
from vllm_omni.diffusion.engine.batching import batch_key
from vllm_omni.diffusion.engine.preprocess import RequestPreprocessor
from vllm_omni.diffusion.executor.base import WorkerGroupExecutor
from vllm_omni.diffusion.executor.multiproc import MultiprocExecutor
from vllm_omni.diffusion.model_source import (
    RAY_MISSING,
    check_pipeline_options,
    check_ulysses_degree,
    read_pipeline_spec,
    resolve_model_path,
)
from vllm_omni.diffusion.models.spec import PipelineSpec
from vllm_omni.diffusion.protocol import HealthState, ProgressCallback
from vllm_omni.diffusion.request import (
    DiffusionOutput,
    DiffusionRequest,
    GenerationParams,
    RequestCancelled,
    RequestError,
)
from vllm_omni.diffusion.worker.quantization import check_quantization
from vllm_omni.diffusion.worker.step_cache import step_cache_report
from vllm_omni.diffusion.worker.weight_prefetch import WeightPrefetch
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


def _cuda_device_count() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


WARMUP_PROMPT = "a warm-up request"
# Longer than the text bucket (64 tokens), so the second warm-up request has another text length too.
LONG_WARMUP_PROMPT = ", ".join([WARMUP_PROMPT] * 24)


def warmup_requests(spec: PipelineSpec, size: tuple[int, int] | None, dynamic: bool) -> list[GenerationParams]:
    """Two-step requests the engine runs before it reports ready.

    The first runs at `size` (the deploy's default; None: the family's). torch.compile specialises
    the compiled blocks to the first shapes it sees and recompiles once, with the sequence lengths
    dynamic, at the first other shape; from then on no size or prompt length recompiles. With
    compiled blocks (`dynamic`) a second request at another size (3/4 of the first, 768x768 where
    the pipeline picks the first; a video also with the fewest frames) and with a prompt longer
    than the text bucket pays that recompile here rather than in the first user request of
    another shape.
    """
    size = size or spec.default_size  # None: the pipeline picks its own
    shapes: list[tuple[tuple[int, int] | None, str, int | None]] = [(size, WARMUP_PROMPT, None)]
    if dynamic:
        width, height = size or (1024, 1024)
        step = spec.size_multiple
        other = (max(step, width * 3 // 4 // step * step), max(step, height * 3 // 4 // step * step))
        shapes.append((other, LONG_WARMUP_PROMPT, spec.frame_multiple + 1 if spec.takes("num_frames") else None))
    requests = []
    for i, (shape, prompt, frames) in enumerate(shapes):
        values: dict[str, Any] = {"num_inference_steps": max(spec.min_steps, 2)}
        values["request_id"] = "warm-up" if i == 0 else f"warm-up-{i + 1}"
        if shape is not None and spec.takes("height"):
            values.update(width=shape[0], height=shape[1])
        if spec.input_image_required:
            values["image"] = admission.gray_png(*(shape or (1024, 1024)))
        if frames is not None:
            values["num_frames"] = frames
        requests.append(GenerationParams(prompt=prompt, output_type="uint8", **values))
    return requests


def _join_ray(config: OmniDiffusionConfig):
    """Ray for the "ray" executor backend (ray_executor.RaySession); a clear error when it is not installed."""
    try:
        from vllm_omni.diffusion.executor.ray import RaySession
    except ImportError as exc:
        if exc.name is None or not exc.name.startswith("ray"):
            raise
        raise ImportError(RAY_MISSING) from exc
    return RaySession.join(config.ray_address, config.parallel_config.world_size)


class DiffusionEngine:
    def __init__(self, config: OmniDiffusionConfig, limits: EngineLimits | None = None) -> None:
        parallel = config.parallel_config
        check_attention_backend(config.attention_backend, parallel.mask_sp_padding)
        self.limits = limits or EngineLimits()
        self.model_path = resolve_model_path(config.model, config.download_dir, config.revision)
        self.spec = read_pipeline_spec(self.model_path)
        # before any GPU loads a weight
        check_ulysses_degree(
            self.model_path, parallel.ulysses_degree, parallel.ring_degree, self.spec.heads_over_sp_group
        )
        check_pipeline_options(self.spec, parallel.cfg_parallel_size, config.cache.policy if config.cache else None)
        ray_session = _join_ray(config) if parallel.distributed_executor_backend == "ray" else None
        try:
            self._configure_device(config, ray_session)
            check_quantization(config.quantization, config.device, config.dtype)  # before any worker starts
        except BaseException:
            if ray_session is not None:
                ray_session.release()
            raise
        self.config = config
        self._ids = itertools.count(1)
        self._id_lock = threading.Lock()
        self._cancel_tokens: dict[str, int] = {}  # running request id -> the executor's cancel token
        self._cancelled_early: dict[str, None] = {}  # ids cancelled before they ran (insertion-ordered)
        # The served LoRA adapters, each checked here before a worker starts (adapters.py).
        denoisers = [name for name in self.spec.family_pipeline().denoisers if (self.model_path / name).is_dir()]
        self.adapters = LoraRegistry(
            self.spec.diffusers_class, self.model_path, denoisers, config.max_lora_rank, config.lora_modules
        )
        if config.lora_modules and not self.adapters.supported:
            raise ValueError(f"--lora-modules: {self.spec.diffusers_class} has no diffusers LoRA loader")
        if config.lora_modules and not config.allow_runtime_lora:
            # The workers plan originals of what these adapters adapt; an adapter added later must fit that plan.
            self.adapters.planned = self.adapters.adapted_weights()
            config.lora_adapted = tuple(sorted(self.adapters.planned))
        self._preprocessor = RequestPreprocessor(
            self.spec, self.limits, self.model_path, config.cache, self.adapters.resolve
        )
        # Each rank's memory plan must fit the model's default request (or the user's token limit) and finds what
        # more fits: the envelope (admission.py). EngineArgs gives the rows the limits allow (max_n, max_batch_size).
        rows = config.admission.max_rows if config.admission is not None else self.limits.max_n
        target = self._preprocessor.target_size
        config.admission = admission.admission(self.spec, self.limits, target, rows)
        self._default_tokens = admission.default_request_tokens(self.spec, target)
        self._stopping = False
        logger.info(
            "Starting %d worker(s) for %s (%s) on %s, %s, quantization=%s, cache=%s, cpu_offload=%s, "
            "ulysses_degree=%d, ring_degree=%d, cfg_parallel_size=%d, padding=%s, executor=%s",
            parallel.world_size,
            config.model,
            self.spec.diffusers_class,
            config.device,
            config.dtype,
            config.quantization or "none",
            f"{config.cache.policy} (threshold {config.cache.threshold:g})" if config.cache else "none",
            config.cpu_offload
            + (" (no CUDA graphs: the weights move)" if config.cpu_offload in ("model", "layerwise") else ""),
            parallel.ulysses_degree,
            parallel.ring_degree,
            parallel.cfg_parallel_size,
            parallel.padding_mode,
            parallel.distributed_executor_backend,
        )
        # The weights come off the disk while the workers start (weight_prefetch.py).
        self._prefetch = WeightPrefetch.start(self.model_path)
        self.executor: WorkerGroupExecutor
        try:
            if ray_session is not None:
                from vllm_omni.diffusion.executor.ray import RayExecutor

                self.executor = RayExecutor(config, str(self.model_path), ray_session)  # releases it if it fails
            else:
                self.executor = MultiprocExecutor(config, str(self.model_path))
        except BaseException:
            self._stop_prefetch()
            raise
        self.executor.warmup_requests = self._warmup_requests()
        self.executor.profile_request = self._profile_request
        self._preprocessor.envelope = lambda: self.executor.envelope

    @staticmethod
    def _configure_device(config: OmniDiffusionConfig, ray_session) -> None:
        """Pick the device (CUDA when the machine, or the Ray cluster, has a GPU per rank) and the dtype."""
        world_size = (config.replica + 1) * config.parallel_config.world_size  # this replica's GPUs come after others'
        gpus = ray_session.gpu_count() if ray_session is not None else _cuda_device_count()
        where = " in the Ray cluster" if ray_session is not None else ""
        if config.device is None:
            config.device = "cuda" if gpus >= world_size else "cpu"
        elif config.device == "cuda" and gpus < world_size:
            raise ValueError(f"device='cuda' needs {world_size} GPU(s) for this parallel config, found {gpus}{where}")
        if config.dtype is None:
            config.dtype = "bfloat16" if config.device == "cuda" else "float32"

    # ---- lifecycle --------------------------------------------------------------------------

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until every worker has loaded and the group has run its warm-up requests."""
        try:
            self.executor.wait_until_ready(timeout)
        finally:
            self._stop_prefetch()  # every rank has loaded (or failed): the page cache has done its part
        if self.envelope is not None:
            logger.info("Serving %s", self.envelope_text())

    @property
    def envelope(self) -> Envelope | None:
        """What one forward holds on this deploy's GPUs (None: no device memory to size it by, as on a CPU)."""
        return self.executor.envelope

    def envelope_text(self) -> str | None:
        """The envelope in a user's terms ("up to 1 image of 2048x2048, or 4 of 1024x1024, per forward")."""
        envelope = self.envelope
        if envelope is None:
            return None
        limits = self.limits.for_model(self.spec)
        return admission.describe(envelope, self.spec, limits, self._default_tokens, self._preprocessor.target_size)

    def _profile_request(self, envelope: Envelope) -> DiffusionRequest | None:
        """The warm-up's measured step: the largest row the envelope holds that the limits accept (a family with an
        encode stage that grows with the size, as an autoregressive one, at its default size), two steps."""
        steps = max(self.spec.min_steps, 2)
        limits = self.limits.for_model(self.spec)
        if self.spec.family_pipeline().encodes_first:
            candidates = [GenerationParams("a measured warm-up step", num_inference_steps=steps, output_type="uint8")]
        else:
            candidates = admission.profile_params(self.spec, limits, envelope, self._preprocessor.target_size, steps)
        for params in candidates:
            try:
                request = self.preprocess(params)
            except RequestError:
                continue
            return dataclasses.replace(request, profile=True, request_id="warm-up-measured")
        logger.warning("No measured step: no request of the envelope's largest row is accepted (%s)", envelope)
        return None

    def _warmup_requests(self) -> list[DiffusionRequest]:
        """The checked warm-up requests (`warmup_requests`) that every worker group runs once it has
        loaded (the first and each restarted one), so the blocks compile and the graphs are captured
        then, not during user requests. None unless `config.warmup` (default: on CUDA, not eager)."""
        warmup = self.config.warmup
        if warmup is None:
            warmup = self.config.device == "cuda" and not self.config.enforce_eager
        if not warmup:
            return []
        compiled = self.config.device == "cuda" and not self.config.enforce_eager and self.spec.compile_blocks
        try:
            return [self.preprocess(params) for params in warmup_requests(self.spec, self.config.warmup_size, compiled)]
        except Exception as exc:  # noqa: BLE001 - the engine serves anyway, only slower at first
            logger.error("Warm-up requests refused (%s: %s); serving without a warm-up", type(exc).__name__, exc)
            return []

    @property
    def warmup_s(self) -> float | None:
        """How long the last warm-up took (0.0: it failed; None: none ran)."""
        return self.executor.warmup_s

    @property
    def is_ready(self) -> bool:
        return self.executor.is_ready

    def is_healthy(self) -> bool:
        return self.executor.is_healthy()

    def health_status(self) -> tuple[HealthState, str | None]:
        """The worker group's state and, where there is one, why (for /health and the watchdog)."""
        status = self.executor.status()
        return status.state, status.detail

    @property
    def restarts(self) -> int:
        """How many times the worker group was restarted."""
        return self.executor.restarts

    @property
    def last_restart_reason(self) -> str | None:
        return self.executor.last_restart_reason

    @property
    def graph_capture_failures(self) -> int:
        """CUDA graph captures that failed on a rank (each sent its SP group eager until a restart)."""
        return self.executor.graph_capture_failures

    @property
    def last_graph_capture_failure(self) -> str | None:
        return self.executor.last_graph_capture_failure

    def rank_counts(self, name: Literal["graph_captures", "compiles"]) -> dict[int, int]:
        """Each rank's `name` (a count of protocol.Stats) since its group started, as of its last request."""
        return {rank: getattr(s, name) for rank, s in sorted(self.executor.rank_stats.items())}

    @property
    def peak_memory_bytes(self) -> dict[int, int]:
        """Each CUDA rank's peak allocated memory during its last request (none on the CPU)."""
        return self.memory_bytes("peak")

    def memory_bytes(self, kind: Literal["peak", "allocated", "reserved"]) -> dict[int, int]:
        """Each CUDA rank's memory as of its last request (none on the CPU): "peak" allocated during it,
        "allocated" and "reserved" (the caching allocator's) once its tensors were dropped."""
        name = f"{kind}_memory_bytes"
        stats = sorted(self.executor.rank_stats.items())
        return {rank: getattr(s, name) for rank, s in stats if getattr(s, name) is not None}

    def check_workers(self) -> None:
        """Respawn the group if a worker died while idle; the server's watchdog calls it."""
        self.executor.check_workers()

    def begin_shutdown(self) -> None:
        """From now on `step()` starts nothing; `close()` ends the workers.

        The running request is not touched: the caller cancels it if it wants to.
        """
        self._stopping = True
        self.executor.begin_shutdown()

    def close(self) -> None:
        self._stop_prefetch()
        self.executor.shutdown()

    def _stop_prefetch(self) -> None:
        if self._prefetch is not None:
            self._prefetch.stop()

    # ---- requests ---------------------------------------------------------------------------

    def load_lora_adapter(self, name: str, path: str | list[str]) -> None:
        """Serve the adapter at `path` as `name` from now on (checked first: RequestError naming the field); a file
        per expert of a two-expert model as "HIGH,LOW" or [HIGH, LOW]. The workers read it when a request first
        names it."""
        self.adapters.load(name, path)
        logger.info("LoRA adapter %r loaded from %s", name, path)

    def unload_lora_adapter(self, name: str) -> None:
        """Stop serving `name` (LoraNotFound if it is not served). Requests already accepted with it still run
        with it: each carries its adapter's file."""
        self.adapters.unload(name)
        logger.info("LoRA adapter %r unloaded; requests already accepted with it still run with it", name)

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
        """Validate user input into a request the workers run as is (preprocess.py); bad input is a
        RequestError naming the field."""
        with self._id_lock:
            token = next(self._ids)
        return self._preprocessor(params, params.request_id or self.new_request_id(), token)

    def step(
        self,
        params: GenerationParams | DiffusionRequest,
        on_progress: ProgressCallback | None = None,
        interleave: bool = False,
    ) -> DiffusionOutput:
        """Run one request end to end and log the time of each phase.

        A `DiffusionRequest` from `preprocess` (the server validates before queueing) is run as is.
        `on_progress(done, total, phase)` is called as the request starts (0) and as the workers report
        finished denoising steps ("denoise") or encode tokens ("encode"). `interleave`: run it inside the
        request the workers are running, from that one's next step (the scheduler's preemption; executor).
        """
        request = params if isinstance(params, DiffusionRequest) else self.preprocess(params)
        return self._run(request, on_progress, interleave)[0]

    def step_batch(
        self, requests: list[DiffusionRequest], on_progress: ProgressCallback | None = None
    ) -> list[DiffusionOutput]:
        """Run checked requests that share a forward (equal `batch_key`) as one pipeline call, one row
        each; one output per request, in order. Cancelling any of them cancels the call (the server's
        scheduler cancels it only once every request in it was cancelled)."""
        keys = {batch_key(request, self.spec) for request in requests}
        if None in keys or len(keys) != 1:
            raise ValueError("step_batch: these requests cannot share a forward (batch_key differs)")
        return self._run(dataclasses.replace(requests[0], batch=list(requests[1:])), on_progress)

    def _run(
        self, request: DiffusionRequest, on_progress: ProgressCallback | None, interleave: bool = False
    ) -> list[DiffusionOutput]:
        preprocessed = time.perf_counter()
        # More images than one forward holds: forwards in a row; CFG branches as rows where they fit (cfg_batch.py).
        config = self.config
        # (Whether a deploy that left it to the engine runs it is the ranks': their placement, worker.py.)
        one_pass = config.cfg_one_pass_allowed and self.spec.family_pipeline().uses_cfg(request)
        request = admission.fit(request, self.envelope, one_pass)
        ids = [row.request_id for row in request.rows]
        with self._id_lock:
            if self._stopping:
                raise RequestCancelled(f"request {request.request_id} not started: the engine is shutting down")
            if self._cancelled_early.pop(request.request_id, False) is None:
                raise RequestCancelled(f"request {request.request_id} cancelled before it started")
            self._cancel_tokens.update(dict.fromkeys(ids, request.cancel_token))
        try:
            images = self.executor.execute(request, on_progress, interleave)
        finally:
            for request_id in ids:
                self._cancel_tokens.pop(request_id, None)
        waited = time.perf_counter()
        audio = self.executor.request_audio  # the videos' sound, where the model makes some
        # The rows in request order: a request's n images, then the next request's.
        starts = np.cumsum([0] + [row.num_images for row in request.rows])
        outputs = [
            self.postprocess(row, images[start:end], row.output_type)
            for row, start, end in zip(request.rows, starts[:-1], starts[1:])
        ]
        if audio is not None:
            for output, start, end in zip(outputs, starts[:-1], starts[1:]):
                output.audio, output.audio_sample_rate = list(audio.samples[start:end]), audio.sample_rate
        done = time.perf_counter()
        timings = {
            "preprocess": request.preprocess_ms,
            "add_req_and_wait": (waited - preprocessed) * 1e3,
            "postprocess": (done - waited) * 1e3,
            "total": request.preprocess_ms + (done - preprocessed) * 1e3,
        }
        # Inside the workers (rank 0's): encode (text encoded once per SP group), denoise, decode.
        rank0 = self.executor.request_stats.get(0)
        phases = rank0.phase_seconds if rank0 is not None else {}
        timings.update({name: seconds * 1e3 for name, seconds in phases.items()})
        logger.info(
            "DiffusionEngine.step breakdown: preprocess=%.2f ms, add_req_and_wait=%.2f ms, "
            "postprocess=%.2f ms, total=%.2f ms%s%s",
            *(timings[name] for name in ("preprocess", "add_req_and_wait", "postprocess", "total")),
            "".join(f", {name}={timings[name]:.2f} ms" for name in phases),
            f" (a batch of {len(ids)} requests)" if request.batch else "",
        )
        cache = None
        if self.config.cache is not None:  # every rank's record: under CFG parallel each group has one branch
            records = [s.step_cache for s in self.executor.request_stats.values() if s.step_cache is not None]
            cache = step_cache_report(self.config.cache.policy, request.cache_threshold, records)
        for output in outputs:
            output.timings_ms = dict(timings)
            output.batch_size = len(ids)
            output.step_cache = cache
            output.cfg_one_pass_steps = rank0.cfg_one_pass_steps if rank0 is not None else 0
        return outputs

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
            seeds=request.image_seeds,
        )
