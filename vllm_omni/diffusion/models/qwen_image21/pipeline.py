"""Qwen-Image 2.1 (text-to-image): what the generic runner needs from this family.

The diffusers pipeline does everything but the transformer: prompt encoding (Qwen3-VL), latents,
scheduler, true CFG with a negative prompt, VAE. `FAMILY` (models/family.py) maps a validated
request onto its call. Its prefix KV cache is off (`use_kv_cache=False`): it is not sharded under
SP, and an image must not depend on the degree it ran at.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm_omni.diffusion.models.branch_rows import same_value, stack_branches
from vllm_omni.diffusion.models.family import FamilyPipeline, call_arg
from vllm_omni.diffusion.models.qwen_image21.transformer import QwenImage21Transformer2DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.spec import PipelineSpec


class QwenImage21Family(FamilyPipeline):
    denoisers = {"transformer": QwenImage21Transformer2DModel}
    default_negative_prompt = " "  # unused: true CFG only runs with a negative prompt
    # The processor stays: the pipeline's constructor reads its chat template and tokenizer.
    text_encoders = ("text_encoder",)

    def uses_cfg(self, request: DiffusionRequest) -> bool:
        """True CFG (two forwards per step) runs only with a negative prompt and a scale above 1."""
        return request.negative_prompt is not None and (request.true_cfg_scale or 1.0) > 1

    def cfg_rows(self, cond: dict[str, Any], uncond: dict[str, Any]) -> dict[str, Any] | None:
        """Two forwards: the transformer plans one joint layout (`img_mask`, which spans the text) for a whole
        batch, and a prompt and a negative prompt of different lengths have two; alike layouts stack."""
        if not same_value(cond.get("img_mask"), uncond.get("img_mask")):
            return None
        return stack_branches(cond, uncond)

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        kwargs: dict[str, Any] = dict(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            height=request.height,
            width=request.width,
            num_inference_steps=request.num_inference_steps,
            num_images_per_prompt=request.num_images,
            use_kv_cache=False,
        )
        if request.true_cfg_scale is not None:
            kwargs["true_cfg_scale"] = request.true_cfg_scale
        return kwargs

    def call_kwargs(self, pipe: Any, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        kwargs = self.pipeline_kwargs(request, spec)
        steps = request.num_inference_steps
        configured = pipe.config.get("sample_sigmas")
        if configured is not None and len(configured) != steps:
            # A checkpoint's own sigma grid fixes the step count; a request for another count gets the
            # pipeline's default grid at that count, so the steps run (and reported) are the requested ones.
            kwargs["sigmas"] = np.linspace(1.0, 1 / steps, steps).tolist()
        return kwargs

    def encode_text(
        self, pipe, kwargs: dict[str, Any], device: torch.device, progress: Any = None
    ) -> dict[str, torch.Tensor]:
        """The prompt's embeddings (and the negative prompt's under true CFG), one row each: the
        pipeline repeats given embeddings num_images_per_prompt times itself. Their masks only where
        the prompts of a batch differ in length (encode_prompt gives None otherwise)."""
        branches = ["prompt"]
        if call_arg(pipe, kwargs, "true_cfg_scale") > 1 and kwargs.get("negative_prompt") is not None:  # do_true_cfg
            branches.append("negative_prompt")
        embeds = {}
        for name in branches:
            prompt_embeds, mask, _ = pipe.encode_prompt(kwargs[name], device=device)
            embeds[f"{name}_embeds"] = prompt_embeds
            if mask is not None:
                embeds[f"{name}_embeds_mask"] = mask
        return embeds


FAMILY = QwenImage21Family()
