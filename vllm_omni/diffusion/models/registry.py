"""Which diffusers pipelines we serve, and how: diffusers pipeline class name -> our pipeline.

The engine reads `_class_name` from a model folder's model_index.json and looks it up here,
so it knows the task, the size multiple and the default steps without importing torch.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Literal


@dataclass(frozen=True)
class PipelineSpec:
    diffusers_class: str
    task: Literal["generate", "edit"]
    max_input_images: int  # 0: text-to-image; 1: one source image; more: several (Edit-Plus)
    runner: str  # "module:Class" of our pipeline runner
    size_multiple: int = 16  # VAE 8x times the 2x2 patch: sizes are rounded down to this
    default_steps: int = 50
    # Qwen-Image's scheduler stretches sigmas to a terminal shift: one step divides 0 by 0 (NaN image).
    min_steps: int = 2
    default_true_cfg_scale: float = 4.0

    def load_runner_class(self) -> type:
        module, name = self.runner.split(":")
        return getattr(importlib.import_module(module), name)


_QWEN_RUNNER = "vllm_omni.diffusion.models.qwen_image.pipeline:QwenImageRunner"
REGISTRY: dict[str, PipelineSpec] = {
    spec.diffusers_class: spec
    for spec in (
        PipelineSpec("QwenImagePipeline", "generate", 0, _QWEN_RUNNER),
        PipelineSpec("QwenImageEditPipeline", "edit", 1, _QWEN_RUNNER),
        PipelineSpec("QwenImageEditPlusPipeline", "edit", 3, _QWEN_RUNNER),
    )
}


def spec_for(diffusers_class: str) -> PipelineSpec:
    spec = REGISTRY.get(diffusers_class)
    if spec is None:
        raise ValueError(f"pipeline {diffusers_class!r} is not supported; supported pipelines: {', '.join(REGISTRY)}")
    return spec
