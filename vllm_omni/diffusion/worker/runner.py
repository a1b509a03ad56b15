"""One runner for every model family: a diffusers pipeline with our SP denoisers swapped in.

A worker (worker.py) builds one `PipelineRunner` and calls `run` per request. What every family
shares lives here: loading the pipeline with the family's SP class for each of its denoisers
(models/family.py), the wrappers on its denoisers, scheduler and VAE (forward_chain.py, once at
load), decoding the source images, one CPU generator seeded identically on every rank, the
per-step hook (cancellation, progress, the end of a CFG step), and the result as uint8 (images
[n, H, W, 3], videos [n, F, H, W, 3]) unless the caller asked for float arrays.

A family supplies only what differs, as `FAMILY` in `models/<family>/pipeline.py`; a video family whose
pipeline makes sound too gives it (`FamilyPipeline.audio`), kept beside the frames (`PipelineRunner.audio`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import time
import zlib
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import diffusers
import numpy as np
import torch

from vllm_omni.diffusion.attention.backends import set_denoising_step
from vllm_omni.diffusion.config import StepCacheConfig
from vllm_omni.diffusion.distributed.comm import SourceFailed, broadcast_tensors
from vllm_omni.diffusion.distributed.parallel_state import every_rank, get_parallel_state, same_on_every_rank
from vllm_omni.diffusion.images import decode_image
from vllm_omni.diffusion.models.family import FamilyPipeline, attention_heads, undeclared_denoisers
from vllm_omni.diffusion.models.spec import PipelineSpec
from vllm_omni.diffusion.protocol import RunPhase
from vllm_omni.diffusion.request import Audio, DiffusionRequest, LoraRequest, RequestError
from vllm_omni.diffusion.worker.cfg_batch import CFGBatch
from vllm_omni.diffusion.worker.cfg_parallel import CFGParallel, swap_prompts
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphs, compile_repeated_blocks
from vllm_omni.diffusion.worker.forward_chain import (
    install_decode_split,
    install_denoiser_chain,
    install_step_report,
    load_decode_split_vae,
    reset_step_cache,
    sharded_graphs,
)
from vllm_omni.diffusion.worker.fused_gelu import fuse_gelu_epilogues
from vllm_omni.diffusion.worker.hooks import HookPoint, RankHooks
from vllm_omni.diffusion.worker.interleave import put_aside
from vllm_omni.diffusion.worker.lora import LoraAdapters
from vllm_omni.diffusion.worker.memory_guard import GroupOutOfMemory, allocation_check, is_out_of_memory
from vllm_omni.diffusion.worker.memory_plan import size
from vllm_omni.diffusion.worker.offload import apply_offload
from vllm_omni.diffusion.worker.quantization import grad_mode, quantize_denoisers, stored_bytes
from vllm_omni.diffusion.worker.step_cache import CacheRecord
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

StepCallback = Callable[[int], None]


def present_components(path: Path, names: Iterable[str] | None = None) -> list[str]:
    """Those of `names` (None: every one) this checkpoint has (model_index.json lists absent ones as null, or
    not at all)."""
    index = json.loads((Path(path) / "model_index.json").read_text())
    names = [name for name in index if not name.startswith("_")] if names is None else names
    return [name for name in names if isinstance(index.get(name), list) and index[name][0] is not None]


def shares_text(family: FamilyPipeline) -> tuple[bool, bool]:
    """(text_peers, encodes_text) of this rank: whether its SP group encodes the prompts once (on its rank 0,
    which broadcasts the embeddings) and whether this rank encodes them."""
    state = get_parallel_state()
    text_peers = state is not None and state.sp_world_size > 1 and bool(family.text_encoders)
    return text_peers, not text_peers or state.sp_rank == 0


def skipped_text_encoders(path: Path, family: FamilyPipeline) -> list[str]:
    """The text encoders this rank does not load (text encoded once: a 7B vision-language encoder is 16 GB a rank)."""
    return [] if shares_text(family)[1] else present_components(path, family.text_encoders)


# Elements of one picture chunk converted at a time (float32 on the device: 256 MiB): a long video's frames are
# not all widened to float32 at once at the end of a request, when the decode may have left little room.
CONVERT_CHUNK_ELEMENTS = 2**26


def frames_to_host(frames: torch.Tensor, as_float: bool) -> np.ndarray:
    """A pipeline's output_type="pt" frames (images [n, C, H, W], videos [n, F, C, H, W], in [0, 1], on its
    device) as the worker returns them, channels last: float32 (`as_float`), else uint8, converted on the device
    (x clipped to [0, 1], times 255, rounded half to even, in float32: the values numpy gave on the host), so a
    video crosses to the host at a quarter of float32's bytes and the host does no per-pixel work. Raises
    FloatingPointError on a NaN or Inf value (one check on the device)."""
    if not bool(torch.isfinite(frames).all()):
        raise FloatingPointError("the pipeline produced non-finite pixel values (NaN or Inf)")
    leading, (channels, height, width) = frames.shape[:-3], frames.shape[-3:]
    pictures = frames.reshape(-1, channels, height, width)
    if as_float:
        host = pictures.permute(0, 2, 3, 1).float().cpu()
    else:
        host = torch.empty((pictures.shape[0], height, width, channels), dtype=torch.uint8)
        step = max(1, CONVERT_CHUNK_ELEMENTS // (channels * height * width))
        for start in range(0, pictures.shape[0], step):
            chunk = pictures[start : start + step].permute(0, 2, 3, 1).float().clamp(0, 1).mul_(255).round_()
            host[start : start + step].copy_(chunk.to(torch.uint8))  # straight from the device into its rows
    return host.reshape(*leading, height, width, channels).numpy()


class PipelineRunner:
    def __init__(
        self,
        path: str | Path,
        spec: PipelineSpec,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        enforce_eager: bool = False,
        quantization: str | None = None,
        cache: StepCacheConfig | None = None,
        cpu_offload: str = "none",
        resident_blocks: Mapping[str, int] | None = None,
        loras: tuple[int, int] | None = None,
        cfg_one_pass: bool = True,
        hooks: RankHooks | None = None,
    ) -> None:
        self.spec = spec
        self.hooks = hooks  # the rank's test seams (worker/hooks.py); None in production
        self.device = device
        self.phase_seconds: dict[str, float] = {}  # the last request's: encode (text once), denoise, decode, onload
        self.step_peak_bytes: int | None = None  # a profile request's measured step (CUDA): its peak activations
        self.phase: RunPhase = "denoise"  # where the current (or last) request is: what an out-of-memory names
        self.audio: Audio | None = None  # the last request's sound, where the family's videos have some
        self.family: FamilyPipeline = spec.family_pipeline()
        # Straight onto the device, without a random initialisation first (accelerate's meta-device load);
        # offloaded weights load onto the CPU, where they wait between their phases (offload.py).
        home = device if cpu_offload in ("none", "encoders") else torch.device("cpu")  # the denoisers'
        self.denoisers: dict[str, torch.nn.Module] = {
            name: self.family.denoisers[name].from_pretrained(path, subfolder=name, dtype=dtype, device_map=str(home))
            for name in present_components(path, self.family.denoisers)
        }
        # Before compile and graphs (they see the FP8 layers); offloaded denoisers wait on the CPU and are converted on
        # `device` a layer at a time.
        quantize_denoisers(self.denoisers, quantization, device)
        # After quantization (its FP8 layers keep the reference path), before compile (the blocks trace the swap).
        if device.type == "cuda":
            fused = sum(fuse_gelu_epilogues(denoiser) for denoiser in self.denoisers.values())
            if fused:
                logger.info("fused bias+GELU into %d MLP GEMMs (cuBLASLt epilogue)", fused)
        self.grad_mode = grad_mode(quantization, cpu_offload)  # what a request runs under: inference mode, mostly
        # A profile request's step is measured only where no weight moves during the call (a text encoder moving in
        # would count as the step's).
        self.measures_steps = device.type == "cuda" and cpu_offload == "none"
        # Text encoded once per SP group: its rank 0 encodes and broadcasts the embeddings; its peers
        # load the pipeline without the text encoder(s).
        state = get_parallel_state()
        self.text_peers, self.encodes_text = shares_text(self.family)
        self.skipped: list[str] = skipped_text_encoders(path, self.family)
        # The VAE decode, tiled and split over every rank of the group (SP and CFG ranks hold the same latents).
        world = state.world_size if state is not None else 1
        vae_parallel = state.config.vae_parallel if state is not None else None
        vae = load_decode_split_vae(path, dtype, vae_parallel)
        pipeline_class = getattr(diffusers, spec.diffusers_class)
        self.pipe = pipeline_class.from_pretrained(
            path,
            **self.denoisers,
            **dict.fromkeys(self.skipped),
            **({"vae": vae} if vae is not None else {}),
            dtype=dtype,
        )
        if cpu_offload == "none":
            self.pipe.to(device)  # the others load onto the CPU
        undeclared = undeclared_denoisers(self.pipe, self.denoisers)
        if undeclared:
            raise ValueError(
                f"{spec.diffusers_class} has denoiser(s) {undeclared} that the {spec.family} family does not "
                "declare (models/family.py): they would run unsharded on every rank"
            )
        self.family.prepare_pipeline(self.pipe)
        self.pipe.set_progress_bar_config(disable=rank != 0, desc="denoising")

        self.graph_capture_failures: list[str] = []  # this rank's, since the worker last reported them
        graphs = None
        backend = hooks.graph_backend() if hooks is not None else None  # a test's, on any device
        # Offloaded weights move between phases (new addresses each time): a captured graph would read stale ones.
        # Under encoders the denoisers stay.
        graphed = cpu_offload in ("none", "encoders")
        if (device.type == "cuda" or backend is not None) and not enforce_eager and graphed:
            # One backend for every denoiser: the experts' graphs share its memory pool.
            backend = backend if backend is not None else CUDAGraphs()
            graphs = dict(on_failure=self.graph_capture_failures.append, backend=backend)
        self.cfg: CFGParallel | None = None
        self.cfg_rank = 0
        if state is not None and state.config.cfg_parallel_size > 1:
            self.cfg = CFGParallel(state.cfg_group)
            self.cfg_rank = state.cfg_rank
        # Without CFG parallel, a step's two branches may run as one forward (the request says: cfg_one_pass).
        self.cfg_batch = CFGBatch(self.family.cfg_rows) if self.cfg is None and cfg_one_pass else None
        self.cfg_one_pass_steps = 0
        self.forwards: Counter = Counter()  # per denoiser, in the current request
        self.cache = CacheRecord(cache) if cache is not None else None  # shared by the denoisers (two experts')
        # Compiled blocks also under offload: its hooks move the weights in before the compiled forward runs.
        compile_blocks = device.type == "cuda" and not enforce_eager and spec.compile_blocks
        for name, denoiser in self.denoisers.items():
            if compile_blocks:
                compile_repeated_blocks(denoiser)
            install_denoiser_chain(denoiser, graphs, self.cfg or self.cfg_batch, self.forwards, name, self.cache)
        # A pipeline without a step callback: its scheduler's `step` reports instead.
        self.step_callback = "callback_on_step_end" in inspect.signature(self.pipe.__call__).parameters
        self.step_report = install_step_report(self.pipe, self.step_callback)
        self._on_decode_tile: Callable[[int], None] | None = None
        self.decode_split = install_decode_split(
            self.pipe.vae,
            rank,
            world,
            torch.distributed.group.WORLD if world > 1 else None,
            state.control_group if state is not None else None,
            vae_parallel,
            on_tile=lambda tile: self._on_decode_tile is not None and self._on_decode_tile(tile),
            fits=allocation_check(device, hooks.device_memory() if hooks is not None else None),
        )
        # LoRA adapters merged into the denoisers per request (lora.py); `loras`: (max_loras, max_cpu_loras).
        self.adapters = LoraAdapters(self.pipe, self.denoisers, device, *loras) if loras is not None else None
        # Last: its hooks go outside every wrapper. `resident_blocks`: the memory plan's (layerwise).
        self.model_offload = apply_offload(self.pipe, cpu_offload, device, self.denoisers, resident_blocks)

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights this rank holds (every torch module of its pipeline)."""
        modules = [c for c in self.pipe.components.values() if isinstance(c, torch.nn.Module)]
        return sum(stored_bytes(t) for m in modules for t in (*m.parameters(), *m.buffers()))  # FP8: as stored

    @property
    def graph_captures(self) -> int:
        """CUDA graphs this rank captured so far (one per shape of each denoiser's sharded forward)."""
        wrappers = [sharded_graphs(denoiser) for denoiser in self.denoisers.values()]
        return sum(w.captures for w in wrappers if w is not None)

    @staticmethod
    def compiles() -> int:
        """Graphs torch.compile compiled in this process so far (its blocks, each new shape class)."""
        from torch._dynamo.utils import counters

        return int(counters["stats"]["unique_graphs"])

    @property
    def attention_heads(self) -> dict[str, int]:
        """Attention heads of each denoiser (the Ulysses degree must divide every one)."""
        return {name: attention_heads(model.config) for name, model in self.denoisers.items()}

    def run(
        self,
        request: DiffusionRequest,
        on_step_end: StepCallback,
        on_decode_tile: Callable[[int], None] | None = None,
        on_encode_progress: Callable[[int, int], None] | None = None,
        cancelled: Callable[[], bool] = lambda: False,
    ) -> np.ndarray:
        """Run one request; `on_step_end(step)` is called after every denoising step and may raise to stop.

        `on_decode_tile(tile)`, likewise, at every tile of a split VAE decode, on every rank;
        `on_encode_progress(done, total)` as a family's long encode stage advances (an autoregressive prior's
        tokens), on the rank that runs it (the SP group's rank 0), and may raise to stop it. The hooks' points
        "text" (that rank starts encoding the prompts once for its group) and "lora" (a rank merges the request's
        adapter) are passed here, `cancelled()` telling them whether the request was; what they raise reaches the
        group as an encoding failure, or a failed adapter.

        Returns uint8 [n, H, W, 3] (video [n, F, H, W, 3]), or float32 in [0, 1] for output_type="np"; the videos'
        sound, where the family gives some, is in `self.audio` until the next request.
        """
        if request.images:
            # The engine checked the files' headers; they travel compressed and are decoded here, once.
            names = [f"image[{i}]" if len(request.images) > 1 else "image" for i in range(len(request.images))]
            request = dataclasses.replace(
                request, images=[decode_image(image, name) for image, name in zip(request.images, names)]
            )
        self._activate_adapter(request.lora, lambda: self._at("lora", request, cancelled))
        self.forwards.clear()
        self.cfg_one_pass_steps = 0  # the request's steps whose CFG branches ran as one forward (all its calls)
        self.step_peak_bytes = None
        self.phase_seconds = {}
        self.audio = None
        sounds: list[Audio] = []  # each pipeline call's, in order
        # Each image has a generator of its own (its seed, DiffusionRequest.image_seeds): an image does not depend
        # on the batch or the chunk it runs in.
        seeds = [seed for row in request.rows for seed in row.image_seeds]
        embeds: list[Any] = []  # the prompts' embeddings, encoded once for every chunk (text once, encode stages)
        arrays, first = [], 0
        try:
            for index, count in enumerate(request.forward_chunks):
                part = request if count == request.num_images else dataclasses.replace(request, num_images=count)
                step_offset = index * request.num_inference_steps
                chunk_seeds = seeds if request.batch else seeds[first : first + count]  # a batch is one call
                calls = (on_step_end, on_decode_tile, on_encode_progress, lambda: self._at("text", request, cancelled))
                frames = self._call(part, chunk_seeds, step_offset, *calls, embeds, sounds)
                if frames is not None:
                    arrays.append(frames_to_host(frames, as_float=request.output_type == "np"))
                first += count
        finally:
            if self.model_offload is not None:
                self.model_offload.release()  # between requests every weight waits on the CPU
                moved, seconds = self.model_offload.moved()
                if moved:  # the copies' own time; the phases that waited for them include it
                    self.phase_seconds["onload"] = seconds
                    logger.debug("Offloaded weights moved in: %s in %.2f s", size(moved), seconds)
        if request.profile:
            return np.zeros((0,), dtype=np.uint8)
        array = arrays[0] if len(arrays) == 1 else np.concatenate(arrays)
        if sounds:
            samples = np.concatenate([sound.samples for sound in sounds])
            if not np.isfinite(samples).all():
                raise FloatingPointError("the pipeline produced non-finite audio samples (NaN or Inf)")
            self.audio = Audio(samples, sounds[0].sample_rate)
        return array

    def _call(
        self,
        request: DiffusionRequest,
        seeds: list[int],
        step_offset: int,
        on_step_end: StepCallback,
        on_decode_tile: Callable[[int], None] | None,
        on_encode_progress: Callable[[int, int], None] | None,
        on_text_encode: Callable[[], None] | None,
        embeds: list[Any],
        sounds: list[Audio],
    ) -> torch.Tensor | None:
        """One pipeline call of `request`'s rows (a chunk of its images, or a batch), `seeds` one per image; its
        steps reported as `step_offset` + step. `embeds` holds the embeddings the first call encoded once (text
        once, a family's encode stage), for the calls after it; the call's sound, if any, is added to `sounds`.
        Adds its phases to `phase_seconds`."""
        kwargs = self._call_kwargs(request)
        # CPU generators on every rank: identical latents everywhere, on any device.
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
        # "pt": the frames stay on the device, where frames_to_host converts them (pipelines' "np" is pt_to_numpy).
        kwargs.update(generator=generators if len(generators) > 1 else generators[0], output_type="pt")
        if request.profile:
            kwargs["output_type"] = "latent"  # the denoising is what is measured
        if self.cfg is not None:
            self.cfg.start_request(self.family.uses_cfg(request))
            if self.cfg.active and self.cfg_rank == 1:
                kwargs = swap_prompts(kwargs, self.family.default_negative_prompt)
        if self.cfg_batch is not None:
            self.cfg_batch.start_request(request.cfg_one_pass and self.family.uses_cfg(request))
        started = time_now = time.perf_counter()
        encodes_first = self.text_peers or self.family.encodes_first
        if encodes_first:
            self.phase = "encode"
            if not embeds:
                embeds.append(self._shared_embeddings(kwargs, on_encode_progress, on_text_encode))
            kwargs = self.family.with_text(kwargs, embeds[0])
            time_now = time.perf_counter()
            self._add_phase("encode", time_now - started)
        self.phase = "denoise"
        called = time_now
        denoised = {"at": called}
        if self.cache is not None:
            for denoiser in self.denoisers.values():
                reset_step_cache(denoiser)  # a new request starts with empty caches
            swapped = self.cfg is not None and self.cfg.active and self.cfg_rank == 1
            self.cache.start_request(request.cache_threshold or self.cache.config.threshold, swapped)
        last_step = request.num_inference_steps - 1
        set_denoising_step(0, request.num_inference_steps)  # attention's per-step precision rule (backends.py)
        measure = request.profile and self.measures_steps
        if measure:  # the step's activations: the peak above what the call starts with (the weights, the inputs)
            torch.cuda.reset_peak_memory_stats(self.device)
            baseline = torch.cuda.memory_allocated(self.device)

        def step_end(step: int) -> None:
            for branches in (self.cfg, self.cfg_batch, self.cache):
                if branches is not None:
                    branches.end_step()
            if step >= last_step and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # the phases end where the GPU's work ends, once a request
                if measure:
                    self.step_peak_bytes = torch.cuda.max_memory_allocated(self.device) - baseline
            denoised["at"] = time.perf_counter()
            on_step_end(step_offset + step)
            set_denoising_step(step + 1, request.num_inference_steps)
            if step >= last_step:
                self.phase = "decode"

        self._on_decode_tile = on_decode_tile
        pipe = self.family.pipeline_for(self.pipe, request)
        try:
            with self._per_step_hook(kwargs, step_end), self.grad_mode():
                result = pipe(**kwargs)
        finally:
            self._on_decode_tile = None
            set_denoising_step(None)
        # Denoising: from the pipeline call to its last step (the pipeline's own prompt encoding and
        # latent preparation included unless the text was encoded first); decode: the rest.
        self._add_phase("denoise", denoised["at"] - called)
        self._add_phase("decode", time.perf_counter() - denoised["at"])
        logger.debug("Request %s: forwards per denoiser %s", request.request_id, dict(self.forwards))
        if self.cfg_batch is not None:
            self.cfg_one_pass_steps += self.cfg_batch.one_pass_steps
        if request.profile:
            return None
        frames = result.frames if self.spec.modality == "video" else result.images
        sound = self.family.audio(pipe, result)
        if sound is not None:
            sounds.append(sound)
        return frames

    def _at(self, point: HookPoint, request: DiffusionRequest, cancelled: Callable[[], bool]) -> None:
        if self.hooks is not None:
            self.hooks.at(point, 0, request, cancelled)

    def _add_phase(self, name: str, seconds: float) -> None:
        self.phase_seconds[name] = self.phase_seconds.get(name, 0.0) + seconds

    def _activate_adapter(self, lora: LoraRequest | None, on_start: Callable[[], None] | None = None) -> None:
        """Merge the request's adapter (None: none) on this rank, then agree with every other rank that each one
        runs this request with the same adapter at the same scale: a rank that could not read it, or merged
        another, fails the request on every rank here, before any step (the whole group, SP and CFG ranks alike,
        reaches this point for every request)."""
        if self.adapters is None:
            if lora is not None:
                raise RequestError("this engine serves no LoRA adapters", "lora")
            return
        error: Exception | None = None
        try:
            if on_start is not None and lora is not None:
                on_start()
            self.adapters.activate(lora)
        except Exception as exc:  # noqa: BLE001 - agreed on below, then raised on every rank
            error = exc
            logger.warning("LoRA adapter %r failed on this rank: %s: %s", lora and lora.name, type(exc).__name__, exc)
        state = get_parallel_state()
        if state is None or state.world_size == 1:
            if error is not None:
                raise RuntimeError(f"adapter {lora.name!r} could not be merged: {error}") from error
            return
        merged = self.adapters.merged
        fingerprint = zlib.crc32(repr(merged).encode())  # name, path, scale and version
        if not every_rank(error is None) or not same_on_every_rank(fingerprint):
            reason = f"{type(error).__name__}: {error}" if error is not None else "it failed on another rank"
            name = lora.name if lora is not None else None
            raise RuntimeError(f"adapter {name!r} is not the same on every rank: {reason}")

    def _call_kwargs(self, request: DiffusionRequest) -> dict[str, Any]:
        """The family's call arguments; for a batch, each row's prompts as lists (the rest is shared:
        `data.batch_key` let only requests whose other arguments are equal share a call)."""
        kwargs = self.family.call_kwargs(self.pipe, request, self.spec)
        if not request.batch:
            return kwargs
        rows = [kwargs, *(self.family.call_kwargs(self.pipe, row, self.spec) for row in request.batch)]
        texts = [name for name in ("prompt", "negative_prompt") if kwargs.get(name) is not None]
        shared = [{k: v for k, v in row.items() if k not in texts} for row in rows]
        if any(other != shared[0] for other in shared[1:]):
            raise ValueError(f"request {request.request_id}: batched requests differ beyond their prompts")
        return {**kwargs, **{name: [row[name] for row in rows] for name in texts}}

    def _shared_embeddings(
        self,
        kwargs: dict[str, Any],
        progress: Callable[[int, int], None] | None,
        on_start: Callable[[], None] | None = None,
    ) -> Any:
        """The prompt embeddings that rank 0 of this SP group encoded (the same prompts on every rank of the
        group: under CFG parallel each group encodes its own, swapped ones), for `family.with_text`.

        Where rank 0 fails (a cancel from `progress` included), its peers, waiting in the broadcast,
        raise the same error there: the whole group stops at that one point (an out-of-memory error
        as GroupOutOfMemory, which says so)."""
        embeds: dict[str, torch.Tensor] | BaseException | None = None
        if self.encodes_text:
            try:
                if on_start is not None:
                    on_start()
                with self.grad_mode():
                    embeds = self.family.encode_text(self.pipe, kwargs, self.device, progress=progress)
                if not embeds:
                    raise RuntimeError(f"{self.spec.family} gave no embeddings to share; its SP peers cannot encode")
            except Exception as exc:  # noqa: BLE001 - the peers are told, then every rank raises it
                embeds = exc
        if self.text_peers:
            state = get_parallel_state()
            src = state.cfg_rank * state.sp_world_size  # the group's SP rank 0, as a global rank
            try:
                embeds = broadcast_tensors(embeds, src, state.sp_group, state.sp_control_group)
            except SourceFailed as failed:
                if is_out_of_memory(failed.error):
                    raise GroupOutOfMemory(failed.error) from None
                raise failed.error from None
        elif isinstance(embeds, BaseException):
            raise embeds
        return embeds

    @contextlib.contextmanager
    def suspended(self, request: DiffusionRequest) -> Iterator[None]:
        """Put the running `request` aside while another runs to its end inside its step callback (the worker nests
        them), then bring it back as it was: what its pipeline call left on shared objects (interleave.py), this
        runner's phase, counters and decode callback, and its adapter, merged again (an agreed point: every rank
        of the group comes back here after the same inner request)."""
        fields = (self.phase, self.phase_seconds, Counter(self.forwards), self._on_decode_tile, self.cfg_one_pass_steps)
        kept = [self.cfg, self.cfg_batch, self.cache, self.step_report]
        state = put_aside(self.pipe, list(self.denoisers.values()), kept)
        try:
            yield
        finally:
            state.restore()
            self.phase, self.phase_seconds, forwards, self._on_decode_tile, self.cfg_one_pass_steps = fields
            self.forwards.clear()  # in place: the denoisers' hooks count into this Counter
            self.forwards.update(forwards)
        self._activate_adapter(request.lora)

    def end_failed_request(self) -> None:
        """Drop the per-request state a failed request left mid-way: the CFG exchange's branches, the step
        cache's residuals (the next request would reset them; until then they would hold memory)."""
        for branches in (self.cfg, self.cfg_batch):
            if branches is not None:
                branches.end_step()
        if self.cache is not None:
            for denoiser in self.denoisers.values():
                reset_step_cache(denoiser)
        self.forwards.clear()

    @contextlib.contextmanager
    def _per_step_hook(self, kwargs: dict[str, Any], step_end: Callable[[int], None]) -> Iterator[None]:
        """Call `step_end(step)` after every denoising step, through the pipeline's own callback.

        `callback_on_step_end` runs after the step's scheduler update in every pipeline that has
        one; where a pipeline has none, its scheduler reports the step
        (forward_chain.StepReportingScheduler).
        """
        if self.step_report is not None:
            with self.step_report.reporting(step_end):
                yield
            return

        def callback(pipe: Any, step: int, timestep: Any, tensors: dict[str, Any]) -> dict[str, Any]:
            step_end(step)
            return {}  # nothing replaced

        kwargs["callback_on_step_end"] = callback
        yield
