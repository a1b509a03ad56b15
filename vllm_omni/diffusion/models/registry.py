"""Which diffusers pipelines we serve, and how: one `Family` per package under models/.

The engine reads `_class_name` from a model folder's model_index.json and looks its spec up
here, so it knows the modality, task, size and token rules, defaults and accepted request fields
without importing torch. Generic code reaches a family's code only through these entries:
`vllm_omni.diffusion.models.<family>.pipeline.FAMILY` (the contract of models/family.py) for the
runner, and `...<family>.tiny` (tiny_model_path) for the loader. Adding a family is one
package and one entry in FAMILIES.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.family import FamilyPipeline

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
    max_input_images: int = 0  # 0: text-only input; 1: one source image; more: several (Edit-Plus, FLUX.2)
    input_image_required: bool = False  # edits need one; FLUX.2's reference images are optional
    # Pixels per token side, the VAE's compression times the patch (8 x 2 for the image models, 16 x 1 for
    # HunyuanVideo 1.5): sizes are rounded down to it.
    size_multiple: int = 16
    # Where sizes follow a coarser grid than the tokens, the pixels per token side (GLM-Image: 16-pixel DiT
    # tokens, sides on its AR's 32-pixel grid, size_multiple 32); None: size_multiple.
    token_pixels: int | None = None
    # Refuse sizes that are not multiples of size_multiple rather than round them down (GLM-Image: diffusers
    # checks only part of its rule and fails late, in the DiT, with a tensor-size error).
    exact_size: bool = False
    frame_multiple: int = 1  # video: num_frames is k * frame_multiple + 1 (the VAE's temporal compression)
    default_steps: int = 50
    min_steps: int = 1
    default_true_cfg_scale: float | None = None  # used when a negative prompt is given (Qwen-Image true CFG)
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
    # How the pipeline resizes a source image before its VAE encodes it: "area" (Qwen-Image-Edit's
    # calculate_dimensions: the aspect ratio at about `source_area` pixels, sides rounded to 32),
    # "shrink" (FLUX.2: down to at most `source_area` pixels, sides floored to 16), "grid" (GLM-Image:
    # sides floored to size_multiple, its AR's grid); None: as given (Z-Image img2img: the engine floors the
    # sides to size_multiple, as the pipeline's image processor does).
    source_resize: Literal["area", "shrink", "grid"] | None = None
    source_area: int = 1024 * 1024
    # The encoded sources' latent tokens join the transformer's sequence (Qwen-Image-Edit, FLUX.2):
    # each adds its tokens to every denoising step.
    sources_in_sequence: bool = False
    # HunyuanVideo 1.5: sizes come from the checkpoint's buckets (transformer config `target_size`):
    # the bucket nearest the source's aspect ratio, or without a source `default_aspect_ratio`.
    size_buckets: bool = False
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

    def family_module(self, name: str) -> ModuleType:
        """`vllm_omni.diffusion.models.<family>.<name>` (imports torch: workers and tests only)."""
        return importlib.import_module(f"vllm_omni.diffusion.models.{self.family}.{name}")

    def family_pipeline(self) -> FamilyPipeline:
        """The family's contract with the runner (models/family.py), `<family>.pipeline.FAMILY`."""
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
            if width * height > self.source_area:  # Flux2ImageProcessor._resize_to_target_area
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
    """Qwen-Image-Edit's calculate_dimensions: (width, height) of aspect `ratio` at about `area` pixels."""
    exact_width = math.sqrt(area * ratio)
    return round(exact_width / step) * step, round(exact_width / ratio / step) * step


def bucket_size(width: int, height: int, target_size: int, step: int = 16, max_ratio: float = 4.0) -> tuple[int, int]:
    """HunyuanVideo 1.5's calculate_default_height_width: the size bucket of about target_size**2 pixels
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


def _qwen(diffusers_class: str, task: str, max_input_images: int) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "qwen_image",
        task,
        COMMON_FIELDS | {"negative_prompt", "guidance_scale", "true_cfg_scale"},
        max_input_images=max_input_images,
        input_image_required=task == "edit",
        # Qwen-Image's scheduler stretches sigmas to a terminal shift: one step divides 0 by 0 (NaN image).
        min_steps=2,
        default_true_cfg_scale=4.0,
        default_size=(1024, 1024),  # default_sample_size 128 x the VAE's 8
        # Each source is encoded at about 1 MP and its tokens join the sequence. Without a size the
        # output takes Edit's (first) source's size, Edit-Plus's last one's.
        source_resize="area" if task == "edit" else None,
        sources_in_sequence=task == "edit",
        auto_size_source=-1 if max_input_images > 1 else 0,
        # Edit-Plus shows each source to the text encoder at about 384x384 and Qwen2.5-VL's image
        # processor refuses sides more than 200:1 apart: 100:1 stays clear of both (and of Edit's 1 MP).
        max_source_aspect_ratio=100.0 if task == "edit" else None,
        # The generation pipeline keeps 512 text tokens (max_sequence_length) after its system
        # prompt: the user's prompt and the 5 tokens that close the chat template.
        max_prompt_tokens=507 if task == "generate" else None,
        cfg_parallel=True,
    )


def _hunyuan(diffusers_class: str, fields: frozenset[str], max_input_images: int) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "hunyuan_video_15",
        "generate",
        fields | VIDEO_FIELDS | {"negative_prompt", "guidance_scale"},
        modality="video",
        max_input_images=max_input_images,
        input_image_required=max_input_images > 0,
        frame_multiple=4,  # the VAE compresses time 4x: 4k + 1 frames
        default_frames=121,
        # Text-to-video draws the 16:9 bucket, image-to-video the input image's: its latent joins the
        # first frame's channels (no tokens of its own; its 729 SigLIP tokens are fixed, text side).
        size_buckets=True,
        # Qwen2.5-VL reads 1000 tokens after the 108 of its system prompt: the user's prompt and the
        # 5 that close the chat template (tokenizer_max_length, prompt_template_encode_start_idx).
        max_prompt_tokens=995,
        # 2**17: admits the 720p checkpoints' 1280x720 x 121 frames (80 x 45 x 31 = 111600 tokens) and
        # 848x480 up to 257 frames (103350); refuses 1920x1080 x 121 (249240) and 4096x4096 x 257
        # (4.3M tokens, hours a step).
        max_tokens_per_step=131072,
        cfg_parallel=True,
    )


FLUX2_STEP_CACHE_REFUSAL = (
    "joins text and image into one stream for its single-stream blocks, which diffusers' First-Block-Cache "
    "(0.42.1) cannot cache (its residuals change shape); serve it uncached"
)


def _flux2(diffusers_class: str, fields: frozenset[str], **overrides) -> PipelineSpec:
    """FLUX.2-dev and klein: input images are optional references, each shrunk to at most 1 MP and adding its
    tokens (at most 4096) to the sequence; without a size the output takes the first reference's size."""
    return PipelineSpec(
        diffusers_class,
        "flux2",
        "generate",
        fields,
        max_input_images=10,
        default_size=(1024, 1024),  # default_sample_size 128 x the VAE's 8
        source_resize="shrink",
        sources_in_sequence=True,  # klein KV: at the first step; later steps reuse their keys and values
        step_cache_refusal=FLUX2_STEP_CACHE_REFUSAL,
        **overrides,
    )


WAN_EXPERT_FIELDS = {False: frozenset({"guidance_scale_2"}), True: frozenset()}


def _wan22(diffusers_class: str, max_input_images: int, five_b: bool = False) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "wan22",
        "generate",
        # guidance_scale_2 is the low-noise expert's scale, which TI2V-5B (one transformer) has not.
        COMMON_FIELDS | VIDEO_FIELDS | {"negative_prompt", "guidance_scale"} | WAN_EXPERT_FIELDS[five_b],
        modality="video",
        max_input_images=max_input_images,
        input_image_required=max_input_images > 0,
        # A14B: the Wan2.1 VAE's 8x and 2x2 patches; TI2V-5B: the Wan2.2 VAE's 16x and 2x2 patches.
        size_multiple=32 if five_b else 16,
        frame_multiple=4,  # 4k + 1 frames
        default_frames=81,
        default_size=(832, 480),  # both pipelines' height/width defaults
        default_fps=24 if five_b else 16,  # the checkpoints' frame rates
        # Image-to-video resizes the input image to the video's size; without a size, the video takes the
        # image's aspect ratio at the default's area (rounded to 32), rather than stretching it to 832x480.
        source_resize="area" if max_input_images else None,
        source_area=832 * 480,
        # UMT5 reads 512 tokens, the closing </s> included (max_sequence_length).
        max_prompt_tokens=511,
        # A14B: 76800 admits its released 1280x720 x 81 frames (80 x 45 x 21 = 75600 tokens) and 832x480 up
        # to 193 frames, and lets both experts serve from one H200 at the default --gpu-memory-utilization
        # (the memory plan refuses one at 2**17: a step there needs 100 GiB beside 64 GiB of weights).
        # TI2V-5B (one 5B transformer): 2**17, as HunyuanVideo 1.5; its 1280x704 x 121 frames is 27280.
        max_tokens_per_step=131072 if five_b else 76800,
        cfg_parallel=True,
        model_index=(("expand_timesteps", True),) if five_b else (),
    )


def _z_image(diffusers_class: str, task: str) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "z_image",
        task,
        COMMON_FIELDS | {"negative_prompt", "guidance_scale"},
        # One source image at most: text-to-image checkpoints run a request with one as img2img (pipeline.py).
        max_input_images=1,
        input_image_required=task == "edit",
        # Without a source, __call__'s height/width default of 1024. img2img starts from the source, at its
        # own size floored to 16 (a requested size resizes the source first: pipeline.py).
        default_size=(1024, 1024) if task == "generate" else None,
        # Qwen3 reads 512 tokens (max_sequence_length) of the chat-templated prompt: the user's prompt and the
        # 3 + 5 template tokens around it.
        max_prompt_tokens=504,
        cfg_parallel_refusal="runs classifier-free guidance (guidance_scale > 0) as one batched forward per step "
        "(prompts and negative prompts in one call), which CFG parallel's exchange of two calls per step cannot split",
        step_cache_refusal="does not fit diffusers' First-Block-Cache (0.42.1): its transformer has no cache "
        "contexts (no CacheMixin) and its blocks name their input `x`, where the hook looks up `hidden_states` "
        "and fails; serve it uncached",
    )


FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen_image",
        (
            _qwen("QwenImagePipeline", "generate", 0),
            _qwen("QwenImageEditPipeline", "edit", 1),
            _qwen("QwenImageEditPlusPipeline", "edit", 3),
        ),
        {
            "tiny/qwen-image": "QwenImagePipeline",
            "tiny/qwen-image-edit": "QwenImageEditPipeline",
            "tiny/qwen-image-edit-plus": "QwenImageEditPlusPipeline",
        },
        {"tiny/qwen-image-lora": "tiny/qwen-image"},
    ),
    Family(
        "qwen_image21",
        # Text-to-image. Its pipeline also takes condition images, but not with precomputed prompt
        # embeddings (no image_pad_mask argument), so those could not be encoded once per SP group.
        (
            PipelineSpec(
                "QwenImage21Pipeline",
                "qwen_image21",
                "generate",
                COMMON_FIELDS | {"negative_prompt", "true_cfg_scale"},
                # 16x VAE, unpatched latents: 16-pixel tokens; the pipeline rounds sides down to 32.
                size_multiple=32,
                token_pixels=16,
                default_steps=40,
                # The pipeline's default: meant to be sampled without guidance; true CFG with a scale above 1.
                default_true_cfg_scale=1.0,
                default_size=(1024, 1024),  # output_resolution's default
                cfg_parallel_refusal="runs true CFG as two forwards, but its transformer gives a row per prompt "
                "token too, so the branches' outputs differ in length and CFG parallel's exchange (equal shapes) "
                "cannot carry them; it is sampled without guidance by default (true_cfg_scale 1)",
                # The prompts of a list are padded to the longest, and the padding moves the image's rotary
                # positions: a request's image would depend on its company.
                batchable=False,
            ),
        ),
        {"tiny/qwen-image-2.1": "QwenImage21Pipeline"},
    ),
    Family(
        "flux2",
        (
            # FLUX.2-dev is guidance-distilled: guidance_scale is embedded, one forward per step.
            _flux2("Flux2Pipeline", COMMON_FIELDS | {"guidance_scale"}),
            # FLUX.2 klein base (no `is_distilled`): CFG against the fixed empty prompt at guidance_scale > 1.
            _flux2(
                "Flux2KleinPipeline",
                COMMON_FIELDS | {"guidance_scale"},
                cfg_parallel_refusal="runs classifier-free guidance against a fixed empty prompt that the pipeline "
                "encodes itself (it takes no negative prompt), which CFG parallel's prompt swap cannot express",
            ),
            # klein step-distilled (FLUX.2-klein-4B / 9B, `is_distilled`) and klein KV: 4 steps, no guidance at all.
            _flux2("Flux2KleinPipeline", COMMON_FIELDS, default_steps=4, model_index=(("is_distilled", True),)),
            _flux2("Flux2KleinKVPipeline", COMMON_FIELDS, default_steps=4),
        ),
        {
            "tiny/flux2": "Flux2Pipeline",
            "tiny/flux2-klein": "Flux2KleinPipeline",
            "tiny/flux2-klein-kv": "Flux2KleinKVPipeline",
        },
    ),
    Family(
        "hunyuan_video_15",
        (
            _hunyuan("HunyuanVideo15Pipeline", COMMON_FIELDS, 0),
            # Image-to-video sizes the video from the input image's aspect ratio: no height or width.
            _hunyuan("HunyuanVideo15ImageToVideoPipeline", COMMON_FIELDS - {"height", "width"}, 1),
        ),
        {
            "tiny/hunyuan-video-1.5": "HunyuanVideo15Pipeline",
            "tiny/hunyuan-video-1.5-i2v": "HunyuanVideo15ImageToVideoPipeline",
        },
    ),
    Family(
        "wan22",
        # T2V-A14B and I2V-A14B (two experts), TI2V-5B (one transformer, per-token timesteps) as text-to-video.
        (_wan22("WanPipeline", 0), _wan22("WanImageToVideoPipeline", 1), _wan22("WanPipeline", 0, five_b=True)),
        {
            "tiny/wan2.2-t2v": "WanPipeline",
            "tiny/wan2.2-i2v": "WanImageToVideoPipeline",
            "tiny/wan2.2-ti2v": "WanPipeline",
        },
        {"tiny/wan2.2-t2v-lora": "tiny/wan2.2-t2v"},
    ),
    Family(
        "glm_image",
        # The AR stage samples the prior tokens once (family.encode_text), then the DiT runs with CFG.
        # No negative prompt (the uncond pass's glyph text is always ""). Source images are optional
        # (one checkpoint does text-to-image and image-to-image, so one spec): the AR reads them, and
        # the DiT caches their keys and values once for every cond forward.
        (
            PipelineSpec(
                "GlmImagePipeline",
                "glm_image",
                "generate",
                COMMON_FIELDS | {"guidance_scale"},
                max_input_images=4,
                # Sources go on the AR's 32-pixel grid (sides floored; there its tokens match the DiT's). Without
                # a size the output takes the first source's: the pipeline's rule (its size floored to 16
                # pixels), on the 32-pixel grid its AR needs (the pipeline's own AR stage fails without a size).
                source_resize="grid",
                # Their keys and values join every cond forward's attention (keys only: counted in full).
                sources_in_sequence=True,
                max_source_aspect_ratio=4.0,  # the AR's image processor refuses sources more elongated
                # 8x VAE and 2x2 patches: 16-pixel DiT tokens; the AR generates one token per 32x32 pixels.
                size_multiple=32,
                token_pixels=16,
                exact_size=True,
                # default_sample_size 128 x the VAE's 8; the pipeline's AR stage needs a size, so one is always given.
                default_size=(1024, 1024),
                cfg_parallel_refusal="runs classifier-free guidance, but its uncond pass also drops the prior tokens, "
                "which CFG parallel's prompt swap cannot express",
                # A list of prompts shares one AR sampling seed and left-pads the glyph texts: a request's
                # image would depend on its company.
                batchable=False,
            ),
        ),
        {"tiny/glm-image": "GlmImagePipeline"},
    ),
    Family(
        "z_image",
        # Z-Image and its 8-step Turbo: one single-stream DiT; CFG (guidance_scale > 0) is batched in one forward.
        # Text-to-image checkpoints take an optional source image (img2img on the same components).
        (_z_image("ZImagePipeline", "generate"), _z_image("ZImageImg2ImgPipeline", "edit")),
        {"tiny/z-image": "ZImagePipeline"},
    ),
)

SPECS: tuple[PipelineSpec, ...] = tuple(spec for family in FAMILIES for spec in family.specs)
# Each served class's first spec: what a checkpoint of that class gets unless its model_index selects another.
REGISTRY: dict[str, PipelineSpec] = {}
for _spec in SPECS:
    REGISTRY.setdefault(_spec.diffusers_class, _spec)
TINY_MODELS: dict[str, PipelineSpec] = {
    name: REGISTRY[pipeline] for family in FAMILIES for name, pipeline in family.tiny_models.items()
}


# Pipelines of a served family that are refused at start, and why (the engine's error names them).
REFUSED: dict[str, str] = {
    "QwenImageLayeredPipeline": "returns several RGBA layers per image (a list of layers per prompt), while the "
    "engine returns images per request; serving it needs a per-family output hook and a `layers` request field, "
    "and diffusers 0.42.1's pipeline splits the layers of a batch of more than one image at the wrong offsets",
}


def spec_for(diffusers_class: str, model_index: dict | None = None) -> PipelineSpec:
    """The spec of a checkpoint of `diffusers_class` whose model_index.json holds `model_index`."""
    if diffusers_class in REFUSED:
        raise ValueError(f"pipeline {diffusers_class!r} is not served: it {REFUSED[diffusers_class]}")
    if diffusers_class not in REGISTRY:
        raise ValueError(f"pipeline {diffusers_class!r} is not supported; supported pipelines: {', '.join(REGISTRY)}")
    for spec in SPECS:
        if spec.diffusers_class == diffusers_class and spec.model_index:
            if all((model_index or {}).get(key) == value for key, value in spec.model_index):
                return spec
    return REGISTRY[diffusers_class]
