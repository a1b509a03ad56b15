"""Which diffusers pipelines we serve, and how: one `Family` per package under models/.

The engine reads `_class_name` from a model folder's model_index.json and looks its spec up
here, so it knows the modality, task, size rule, defaults and accepted request fields without
importing torch. Generic code reaches a family's code only through these entries:
`vllm_omni.diffusion.models.<family>.pipeline` (TRANSFORMER_CLASS, pipeline_kwargs) for the
runner, and `...<family>.tiny` (tiny_model_path) for the loader. Adding a family is one
package and one entry in FAMILIES.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from types import ModuleType
from typing import Literal

# Request fields every pipeline takes (beyond the prompt); see diffusion/request_fields.py.
COMMON_FIELDS = frozenset({"height", "width", "num_inference_steps", "n", "seed"})
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
    size_multiple: int = 16  # VAE 8x times the 2x2 patch: sizes are rounded down to this
    frame_multiple: int = 1  # video: num_frames is k * frame_multiple + 1 (the VAE's temporal compression)
    default_steps: int = 50
    min_steps: int = 1
    default_true_cfg_scale: float | None = None  # used when a negative prompt is given (Qwen-Image true CFG)
    default_fps: int = 24
    cfg_parallel: bool = False  # the pipeline runs CFG as two forwards per step (cfg_parallel_size=2 splits them)
    # Compile the repeated blocks on GPUs: only where it was measured on one (benchmarks/*_sp.py --compile).
    compile_blocks: bool = True
    # Sizes the pipeline picks by itself, restated so the engine can check them against its limits
    # before any worker runs (and then passes them explicitly). Without a size and without a source
    # image the pipeline draws `default_size` (width, height); with source images it keeps the
    # aspect ratio of source `auto_size_source` (-1: the last) at about `auto_size_area` pixels,
    # each side rounded to `auto_size_rounding`.
    default_size: tuple[int, int] | None = None
    auto_size_area: int | None = None
    auto_size_source: int = 0
    auto_size_rounding: int = 32
    # Sources more elongated than this break the pipeline's own resizing (a side rounds to 0).
    max_source_aspect_ratio: float | None = None
    # Prompt tokens the pipeline reads; it cuts longer prompts silently, so the engine refuses them.
    max_prompt_tokens: int | None = None

    def family_module(self, name: str) -> ModuleType:
        """`vllm_omni.diffusion.models.<family>.<name>` (imports torch: workers and tests only)."""
        return importlib.import_module(f"vllm_omni.diffusion.models.{self.family}.{name}")

    def takes(self, field_name: str) -> bool:
        return field_name in self.fields

    def output_size(self, source_sizes: list[tuple[int, int]]) -> tuple[int, int] | None:
        """(width, height) the pipeline runs at when the request gives no size; None: not known here."""
        if source_sizes and self.auto_size_area is not None:
            width, height = source_sizes[self.auto_size_source]
            exact_width = math.sqrt(self.auto_size_area * width / height)
            step = self.auto_size_rounding
            return round(exact_width / step) * step, round(exact_width * height / width / step) * step
        return self.default_size


@dataclass(frozen=True)
class Family:
    package: str
    specs: tuple[PipelineSpec, ...]
    tiny_models: dict[str, str] = field(default_factory=dict)  # "tiny/<name>" -> diffusers pipeline class


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
        # Edit: the first source at about 1 MP; Edit-Plus: the last one.
        auto_size_area=1024 * 1024 if task == "edit" else None,
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
        cfg_parallel=True,
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
    ),
    Family(
        "flux2",
        # Guidance-distilled: guidance_scale is embedded, one forward per step; input images are optional
        # references (each up to 1024x1024 adds up to 4096 tokens, so the engine's max_input_images caps them).
        (PipelineSpec("Flux2Pipeline", "flux2", "generate", COMMON_FIELDS | {"guidance_scale"}, max_input_images=10),),
        {"tiny/flux2": "Flux2Pipeline"},
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
)

REGISTRY: dict[str, PipelineSpec] = {spec.diffusers_class: spec for family in FAMILIES for spec in family.specs}
TINY_MODELS: dict[str, PipelineSpec] = {
    name: REGISTRY[pipeline] for family in FAMILIES for name, pipeline in family.tiny_models.items()
}


def spec_for(diffusers_class: str) -> PipelineSpec:
    spec = REGISTRY.get(diffusers_class)
    if spec is None:
        raise ValueError(f"pipeline {diffusers_class!r} is not supported; supported pipelines: {', '.join(REGISTRY)}")
    return spec
