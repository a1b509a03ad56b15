"""What a deploy admits, sized by its GPUs' memory: the request every rank's memory plan must fit, the request
the warm-up measures, and how a request is fitted to the envelope the ranks found (config.Envelope).

The engine (core.py) asks the plan to admit the model's default request, one image at its default size (or
the user's --max-tokens-per-step); each rank's plan (worker/memory_plan.py) answers with the envelope the rest of
its memory holds, and the narrowest rank decides. The warm-up measures one step at the envelope's largest row
(`profile_params`) and the measurement narrows or widens it (executor/base.py `_measure_step`). A row larger
than the envelope is refused naming its size (preprocess.py); more images than fit one forward run as consecutive
forwards (`fit`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from vllm_omni.diffusion.config import Admission, EngineLimits, Envelope
from vllm_omni.diffusion.models.spec import PipelineSpec
from vllm_omni.diffusion.request import DiffusionRequest, GenerationParams

# The source image a default (or measured) edit sends: the pipelines resize sources to about 1 MP.
SOURCE_SIDE = 1024


def default_request_tokens(spec: PipelineSpec, target_size: int | None) -> int:
    """Image (video) tokens of the model's default request: its default size and frame count, one source image
    of SOURCE_SIDE a side where it needs one."""
    sources = [(SOURCE_SIDE, SOURCE_SIDE)] if spec.input_image_required else []
    width, height = spec.output_size(sources, target_size) or (SOURCE_SIDE, SOURCE_SIDE)
    width, height = (side // spec.size_multiple * spec.size_multiple for side in (width, height))
    return spec.tokens_per_step(width, height, spec.default_frames, sources)


def admission(spec: PipelineSpec, limits: EngineLimits, target_size: int | None, max_rows: int) -> Admission:
    """What the ranks' plans must admit under `limits` (max_tokens_per_step None: the user set none)."""
    tokens_set = limits.max_tokens_per_step is not None
    cap = limits.max_tokens_per_step if tokens_set else spec.max_tokens_per_step
    return Admission(default_request_tokens(spec, target_size), cap, max(1, max_rows), tokens_set)


def profile_params(
    spec: PipelineSpec, limits: EngineLimits, envelope: Envelope, target_size: int | None, steps: int
) -> list[GenerationParams]:
    """Candidates for the measured step, largest first: for images, squares from the largest the envelope's row
    and the size limit allow down; for videos, the default size with the most frames the row and the frame limit
    allow down. The engine keeps the first it accepts (a source image's tokens count against the row too)."""
    base = dict(prompt="a measured warm-up step", num_inference_steps=steps, output_type="uint8")
    base["request_id"] = "warm-up-measured"
    if spec.input_image_required:
        base["image"] = gray_png(SOURCE_SIDE, SOURCE_SIDE)
    if spec.modality == "video" and spec.takes("num_frames"):
        most = max_frames(spec, limits, envelope.max_tokens_per_step, target_size)
        latent = (most - 1) // spec.frame_multiple + 1
        down = range(latent, 0, -max(1, latent // 20))
        return [GenerationParams(**base, num_frames=(count - 1) * spec.frame_multiple + 1) for count in down]
    largest = min(limits.max_image_size, math.isqrt(envelope.max_tokens_per_step) * spec.token_side)
    multiple = spec.size_multiple
    candidates, length = [], largest
    while length >= multiple and len(candidates) < 40:
        length = length // multiple * multiple
        candidates.append(GenerationParams(**base, width=length, height=length))
        length = int(length * 0.95)
    return candidates


def max_frames(spec: PipelineSpec, limits: EngineLimits, tokens: int, target_size: int | None) -> int:
    """The most frames of the default size a row of `tokens` tokens holds (within the frame limit)."""
    default_latent = ((spec.default_frames or 1) - 1) // spec.frame_multiple + 1
    per_latent_frame = max(1, default_request_tokens(spec, target_size) // default_latent)
    latent = min(max(1, tokens // per_latent_frame), (limits.max_frames - 1) // spec.frame_multiple + 1)
    return (latent - 1) * spec.frame_multiple + 1


def gray_png(width: int, height: int) -> bytes:
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.new("RGB", (width, height), (128, 128, 128)).save(buffer, format="PNG")
    return buffer.getvalue()


def fit(request: DiffusionRequest, envelope: Envelope | None, cfg_one_pass: bool = False) -> DiffusionRequest:
    """`request` with the images its forwards hold (`rows_per_forward`; the preprocessor refused rows the envelope
    cannot hold). `cfg_one_pass`: the request runs CFG and the deploy lets its two branches share a forward; they
    do where a forward holds both branches' rows of at least one image (a batch: of all its images), its images
    then in forwards of half the rows (worker/cfg_batch.py). Never the measured step: it measures one row."""
    rows = envelope.rows_for(request.tokens) if envelope is not None and request.tokens else None
    if cfg_one_pass and not request.profile:
        if rows is None:
            return dataclasses.replace(request, cfg_one_pass=True)
        # The branches' rows count against the memory, not against the images a forward may hold (--max-n).
        pairs = min(envelope.rows_fitting(request.tokens), 2 * envelope.max_rows) // 2
        images = sum(row.num_images for row in request.rows)
        if (request.batch and pairs >= images) or (not request.batch and pairs >= 1):
            request, rows = dataclasses.replace(request, cfg_one_pass=True), min(rows, pairs)
    if rows is not None and rows < request.num_images:
        request = dataclasses.replace(request, rows_per_forward=rows)
    return request


def describe(
    envelope: Envelope, spec: PipelineSpec, limits: EngineLimits, default_tokens: int, target_size: int | None
) -> str:
    """The envelope in a user's terms: "up to 1 image of 2048x2048, or 4 of 1024x1024, per forward"."""
    tail = f" per forward ({envelope.max_tokens_per_step} tokens a row, {envelope.forward_tokens} a forward)"
    if spec.modality == "video":
        frames = max_frames(spec, limits, envelope.max_tokens_per_step, target_size)
        rows = envelope.rows_for(default_tokens)
        return f"up to 1 video of {frames} frames at the default size, or {rows} of {spec.default_frames}," + tail
    side, multiple = spec.token_side, spec.size_multiple
    largest = min(limits.max_image_size, math.isqrt(envelope.max_tokens_per_step) * side) // multiple * multiple
    big = (largest // side) ** 2
    text = f"up to {envelope.rows_for(big)} image(s) of {largest}x{largest}"
    if default_tokens < big:
        default_side = math.isqrt(default_tokens) * side
        text += f", or {envelope.rows_for(default_tokens)} of {default_side}x{default_side}"
    return text + "," + tail


@dataclasses.dataclass(frozen=True)
class DeployPlan:
    """What `vllm-omni plan` says of a deploy on a GPU of `gpu_bytes`, before any weight is read: the plan of its
    rank 0 (the one that holds the most: text encoded once leaves the text encoders to it), and the envelope
    estimated from it (the warm-up measures it when it serves), or why it is refused."""

    model: str
    pipeline: str
    gpu_bytes: int
    plan: Any  # worker/memory_plan.MemoryPlan at the request the deploy must admit, when it fits
    envelope: Envelope | None
    description: str | None  # the envelope in words
    refusal: str | None

    @property
    def starts(self) -> bool:
        return self.refusal is None

    def lines(self) -> list[str]:
        head = f"{self.model} ({self.pipeline}) on a GPU of {self.gpu_bytes / 2**30:g} GiB:"
        if self.refusal is not None:
            return [head, f"  refused: {self.refusal}"]
        resident = self.plan.resident_blocks()
        placement = f"offload {self.plan.offload}" + (
            f" ({', '.join(f'{n} of {name} blocks resident' for name, n in resident.items())})" if resident else ""
        )
        return [
            head,
            f"  starts: {self.plan.line()}",
            f"  placement: {placement}",
            f"  envelope (estimated; the warm-up measures one step and serves what that leaves): {self.description}",
        ]


def plan_deploy(args: Any, gpu_bytes: int) -> DeployPlan:
    """The plan of `args` (EngineArgs) on a GPU of `gpu_bytes` (all free): rank 0's, as its worker would make it,
    with the weights from the checkpoint's safetensors headers or, where it holds only configs, its modules built
    on the meta device. Reads no weight and needs no GPU."""
    from vllm_omni.diffusion.engine.preprocess import bucket_target_size
    from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
    from vllm_omni.diffusion.worker.memory_plan import plan_rank
    from vllm_omni.diffusion.worker.runner import present_components

    config = args.engine_config()
    path = resolve_model_path(config.model, config.download_dir, config.revision)
    spec = read_pipeline_spec(path)
    limits = args.limits
    target = bucket_target_size(path, spec.size_buckets) if spec.size_buckets else None
    rows = config.admission.max_rows if config.admission is not None else limits.max_n
    config = dataclasses.replace(
        config, dtype=config.dtype or "bfloat16", admission=admission(spec, limits, target, rows)
    )
    try:
        ranked = plan_rank(config, spec, path, None, present_components(path), memory=(gpu_bytes, gpu_bytes))
    except ValueError as exc:
        return DeployPlan(config.model, spec.diffusers_class, gpu_bytes, None, None, None, str(exc))
    default = default_request_tokens(spec, target)
    described = describe(ranked.envelope, spec, limits.for_model(spec), default, target)
    return DeployPlan(config.model, spec.diffusers_class, gpu_bytes, ranked.plan, ranked.envelope, described, None)
