"""Qwen-Image pipelines (generate, edit, edit-plus): what the generic runner needs from this family.

The diffusers pipeline does everything but the transformer: prompt encoding, latents, scheduler,
true CFG with a negative prompt, VAE. `FAMILY` (models/family.py) maps a validated request onto its call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_omni.diffusion.data import DiffusionRequest
from vllm_omni.diffusion.models.family import FamilyPipeline
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.registry import PipelineSpec


class QwenImageFamily(FamilyPipeline):
    denoisers = {"transformer": QwenImageTransformer2DModel}
    default_negative_prompt = " "  # unused: true CFG only runs with a negative prompt

    def uses_cfg(self, request: DiffusionRequest) -> bool:
        """True CFG (two forwards per step) runs only with a negative prompt and a scale above 1."""
        return request.negative_prompt is not None and request.true_cfg_scale > 1

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            height=request.height,
            width=request.width,
            num_inference_steps=request.num_inference_steps,
            true_cfg_scale=request.true_cfg_scale,
            num_images_per_prompt=request.num_images,
        )
        if request.guidance_scale is not None:
            kwargs["guidance_scale"] = request.guidance_scale
        if spec.task == "edit":
            kwargs["image"] = request.images if spec.max_input_images > 1 else request.images[0]
        return kwargs


FAMILY = QwenImageFamily()
