"""What the engine knows of a served diffusers pipeline without importing torch: `PipelineSpec` (modality,
task, size and token rules, defaults, accepted request fields) and its arithmetic, and `Family`, what each family
package declares in its `spec.py` (its specs, tiny models and adapters). models/registry.py collects them.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Literal

# Request fields every pipeline takes (beyond the prompt); see diffusion/engine/request_fields.py.
COMMON_FIELDS = frozenset(
    {"height", "width", "num_inference_steps", "n", "seed", "cache_threshold", "lora", "priority"}
)
VIDEO_FIELDS = frozenset({"num_frames", "fps"})


@dataclass(frozen=True)
class PipelineSpec:
    diffusers_class: str
    family: str  # the package under vllm_omni.diffusion.models
    task: Literal["generate", "edit"]
    fields: frozenset[str]  # optional request fields this pipeline takes (COMMON_FIELDS plus its own)
    modality: Literal["image", "video"] = "image"
    max_input_images: int = 0  # 0: text-only input; 1: one source image; more: several (multi-image edits, references)
    input_image_required: bool = False  # edits need one; reference images may be optional
    # Pixels per token side, the VAE's compression times the patch (8 x 2 for most image models, 16 x 1 for a
    # 16x VAE without patches): sizes are rounded down to it.
    size_multiple: int = 16
    # Where sizes follow a coarser grid than the tokens, the pixels per token side (16-pixel DiT tokens with
    # sides on an autoregressive prior's 32-pixel grid: size_multiple 32); None: size_multiple.
    token_pixels: int | None = None
    # Refuse sizes that are not multiples of size_multiple rather than round them down (where diffusers checks
    # only part of the rule and fails late, in the DiT, with a tensor-size error).
    exact_size: bool = False
    frame_multiple: int = 1  # video: num_frames is k * frame_multiple + 1 (the VAE's temporal compression)
    default_steps: int = 50
    min_steps: int = 1
    default_true_cfg_scale: float | None = None  # used when a negative prompt is given (true CFG)
    default_fps: int = 24
    cfg_parallel: bool = False  # the pipeline runs CFG as two forwards per step (cfg_parallel_size=2 splits them)
    # Why cfg_parallel is False although the pipeline runs CFG (the engine's refusal); None: it runs none.
    cfg_parallel_refusal: str | None = None
    # Compile the repeated blocks on GPUs: only where it was measured on one (benchmarks/*_sp.py --compile).
    compile_blocks: bool = True
    # Sizes the pipeline picks by itself, restated so the engine can check them against its limits
    # before any worker runs (and then passes them explicitly). Without a size and without a source
    # image the pipeline draws `default_size` (width, height); with source images it takes the size
    # at which it encodes source `auto_size_source` (-1: the last; see `source_size`).
    default_size: tuple[int, int] | None = None
    auto_size_source: int = 0
    # How the pipeline resizes a source image before its VAE encodes it: "area" (calculate_dimensions: the
    # aspect ratio at about `source_area` pixels, sides rounded to 32), "shrink" (down to at most `source_area`
    # pixels, sides floored to 16), "grid" (sides floored to size_multiple, an autoregressive prior's grid);
    # None: as given (img2img: the engine floors the sides to size_multiple, as the image processor does).
    source_resize: Literal["area", "shrink", "grid"] | None = None
    source_area: int = 1024 * 1024
    # The encoded sources' latent tokens join the transformer's sequence (edits, reference images):
    # each adds its tokens to every denoising step.
    sources_in_sequence: bool = False
    # Sizes from the checkpoint's buckets of about target_size**2 pixels (transformer config `target_size`; this
    # when the config has none): the bucket nearest the source's aspect ratio, or `default_aspect_ratio`. 0: none.
    size_buckets: int = 0
    default_aspect_ratio: tuple[int, int] = (16, 9)  # (width, height)
    default_frames: int | None = None  # video: the pipeline's num_frames default
    # Sources more elongated than this break the pipeline's own resizing (a side rounds to 0).
    max_source_aspect_ratio: float | None = None
    # Prompt tokens the pipeline reads; it cuts longer prompts silently, so the engine refuses them.
    max_prompt_tokens: int | None = None
    # The default of EngineLimits.max_tokens_per_step (see `tokens_per_step`): admits the sizes the
    # checkpoints are made for, refuses requests no step could finish (docs/serving.md#limits; the
    # time a step takes at the limit is not benchmarked yet). Image models: 81920 = a 4096x4096 output (the
    # default max_image_size, 65536 tokens) plus four 1 MP sources (4096 tokens each, the default
    # max_input_images): at the default limits those bind first; this bounds a deploy that raises them.
    max_tokens_per_step: int = 81920
    # model_index.json values that select this spec over its class's first one: one diffusers class can
    # serve checkpoints of different geometry (WanPipeline: A14B, and TI2V-5B with `expand_timesteps`).
    model_index: tuple[tuple[str, object], ...] = ()
    # Requests may share a pipeline call (request batching: a list of prompts, one generator per row).
    batchable: bool = True
    # Why the step cache (diffusion/worker/step_cache.py) cannot run on this pipeline's denoiser; None: it can.
    step_cache_refusal: str | None = None
    # The denoiser also exchanges heads over every SP rank, ring ranks included (a cross-stream attention that runs one
    # all-to-all over the whole group): ulysses_degree x ring_degree must divide its heads, not Ulysses alone.
    heads_over_sp_group: bool = False

    def family_module(self, name: str) -> ModuleType:
        """`vllm_omni.diffusion.models.<family>.<name>` (imports torch: workers and tests only)."""
        return importlib.import_module(f"vllm_omni.diffusion.models.{self.family}.{name}")

    def family_pipeline(self) -> Any:
        """The family's contract with the runner, `<family>.pipeline.FAMILY` (a models/family.FamilyPipeline, not
        imported here: that module imports this one)."""
        return self.family_module("pipeline").FAMILY

    def takes(self, field_name: str) -> bool:
        return field_name in self.fields

    @property
    def token_side(self) -> int:
        """Pixels per token side of the output (the latent grid the transformer sees)."""
        return self.token_pixels or self.size_multiple

    def source_size(self, width: int, height: int) -> tuple[int, int]:
        """(width, height) at which the pipeline encodes a source image of width x height (not for buckets)."""
        if self.source_resize == "area":
            return area_size(width / height, self.source_area, 32)
        if self.source_resize == "grid":
            return width // self.size_multiple * self.size_multiple, height // self.size_multiple * self.size_multiple
        if self.source_resize == "shrink":
            if width * height > self.source_area:  # diffusers' resize to a target area
                scale = math.sqrt(self.source_area / (width * height))
                width, height = int(width * scale), int(height * scale)
            return width // self.size_multiple * self.size_multiple, height // self.size_multiple * self.size_multiple
        return width, height

    def output_size(
        self, source_sizes: list[tuple[int, int]], target_size: int | None = None
    ) -> tuple[int, int] | None:
        """(width, height) the pipeline runs at when the request gives no size; None: not known here.

        `target_size`: the checkpoint's bucket size, for `size_buckets` pipelines (None: not known).
        """
        if self.size_buckets:
            if target_size is None:
                return None
            width, height = source_sizes[self.auto_size_source] if source_sizes else self.default_aspect_ratio
            return bucket_size(width, height, target_size, self.size_multiple)
        if source_sizes:
            return self.source_size(*source_sizes[self.auto_size_source])
        return self.default_size

    def tokens_per_step(self, width: int, height: int, num_frames: int | None, sources: list[tuple[int, int]]) -> int:
        """Image (video) tokens in one denoising forward: the output's latent grid, one token per
        `token_side` pixels a side (VAE and patch together), times its latent frames, plus the tokens
        of each encoded source where they join the sequence. Text tokens (bounded by the prompt limit,
        fixed per model) and `n` (a batch of independent sequences) are not counted."""
        step = self.token_side
        frames = 1 if num_frames is None else (num_frames - 1) // self.frame_multiple + 1
        tokens = (width // step) * (height // step) * frames
        if self.sources_in_sequence:
            encoded = (self.source_size(w, h) for w, h in sources)
            tokens += sum((w // step) * (h // step) for w, h in encoded)
        return tokens


def area_size(ratio: float, area: int, step: int) -> tuple[int, int]:
    """An edit pipeline's calculate_dimensions: (width, height) of aspect `ratio` at about `area` pixels."""
    exact_width = math.sqrt(area * ratio)
    return round(exact_width / step) * step, round(exact_width / ratio / step) * step


def bucket_size(width: int, height: int, target_size: int, step: int = 16, max_ratio: float = 4.0) -> tuple[int, int]:
    """A bucketed video pipeline's calculate_default_height_width: the size bucket of about target_size**2 pixels
    nearest the aspect ratio of width x height, as (width, height)."""
    patches = round((target_size / step) ** 2)
    buckets = []  # (height, width), in generate_crop_size_list's order
    wp, hp = patches, 1
    while wp > 0:
        if max(wp, hp) / min(wp, hp) <= max_ratio:
            buckets.append((wp * step, hp * step))
        if (hp + 1) * wp <= patches:
            hp += 1
        else:
            wp -= 1
    aspect = height / width
    diffs = [round(h / w, 5) - aspect for h, w in buckets]
    on_side = [(i, d) for i, d in enumerate(diffs) if (d <= 0 if aspect >= 1 else d >= 0)]
    bucket_height, bucket_width = buckets[min(on_side, key=lambda pair: abs(pair[1]))[0]]
    return bucket_width, bucket_height


@dataclass(frozen=True)
class Family:
    package: str
    specs: tuple[PipelineSpec, ...]
    tiny_models: dict[str, str] = field(default_factory=dict)  # "tiny/<name>" -> diffusers pipeline class
    tiny_adapters: dict[str, str] = field(default_factory=dict)  # "tiny/<name>-lora" -> the tiny model it adapts
    # Pipelines of the family's diffusers classes that are refused at start, and why (the engine's error names them).
    refused: dict[str, str] = field(default_factory=dict)
    # An untiled decode's peak activations per output pixel in bfloat16, by VAE class (vae/config.json), where
    # measured (benchmarks/vae_decode.py): the memory plan counts it, and a decode that cannot allocate it is tiled.
    decode_bytes_per_pixel: dict[str, int] = field(default_factory=dict)
