"""Qwen-Image pipelines (generate, edit, edit-plus): what the generic runner needs from this family.

The diffusers pipeline does everything but the transformer: prompt encoding, latents, scheduler,
true CFG with a negative prompt, VAE. `FAMILY` (models/family.py) maps a validated request onto its call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from diffusers import QwenImageEditPipeline, QwenImageEditPlusPipeline
from diffusers.pipelines.qwenimage import pipeline_qwenimage_edit, pipeline_qwenimage_edit_plus

from vllm_omni.diffusion.models.branch_rows import pad_text, stack_branches
from vllm_omni.diffusion.models.family import FamilyPipeline, call_arg
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.spec import PipelineSpec


class QwenImageFamily(FamilyPipeline):
    denoisers = {"transformer": QwenImageTransformer2DModel}
    default_negative_prompt = " "  # unused: true CFG only runs with a negative prompt
    # Qwen2.5-VL, and what feeds it: the edits' processor (chat template, and the source images
    # at the VL model's resolution) serves only prompt encoding; the VAE takes its own resize.
    text_encoders = ("text_encoder", "tokenizer", "processor")

    def uses_cfg(self, request: DiffusionRequest) -> bool:
        """True CFG (two forwards per step) runs only with a negative prompt and a scale above 1."""
        return request.negative_prompt is not None and request.true_cfg_scale > 1

    def cfg_rows(self, cond: dict[str, Any], uncond: dict[str, Any]) -> dict[str, Any] | None:
        """The prompt's and the negative prompt's rows in one forward: texts of different lengths padded and
        masked (the transformer keeps each row's valid text, attention runs per row)."""
        return stack_branches(*pad_text(cond, uncond, "encoder_hidden_states", "encoder_hidden_states_mask"))

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

    def encode_text(
        self, pipe, kwargs: dict[str, Any], device: torch.device, progress: Any = None
    ) -> dict[str, torch.Tensor]:
        """The prompt's embeddings (and the negative prompt's under true CFG), one row each: the
        pipeline repeats given embeddings num_images_per_prompt times itself.

        The edits' text encoder also sees the source images; the pipelines take the embeddings all
        the same (the sources still go to the VAE), so edits are encoded once too.
        """
        encode = dict(
            device=device,
            max_sequence_length=call_arg(pipe, kwargs, "max_sequence_length"),  # encode_prompt's default differs
        )
        if isinstance(pipe, (QwenImageEditPipeline, QwenImageEditPlusPipeline)):
            encode["image"] = _prompt_images(pipe, kwargs["image"])
        branches = ["prompt"]
        if call_arg(pipe, kwargs, "true_cfg_scale") > 1 and kwargs.get("negative_prompt") is not None:  # do_true_cfg
            branches.append("negative_prompt")
        embeds = {}
        for name in branches:
            prompt_embeds, mask = pipe.encode_prompt(kwargs[name], **encode)
            # encode_prompt gives no mask when every token is valid; the pipeline then takes None and an
            # all-ones mask alike (it drops the latter), but warns at every call without one.
            if mask is None:
                mask = torch.ones(prompt_embeds.shape[:2], dtype=torch.long, device=prompt_embeds.device)
            embeds[f"{name}_embeds"], embeds[f"{name}_embeds_mask"] = prompt_embeds, mask
        return embeds


def _prompt_images(pipe, image: Any) -> Any:
    """The source image(s) as the edit pipeline's `__call__` resizes them for its text encoder."""
    if isinstance(pipe, QwenImageEditPlusPipeline):  # each source at about 384 x 384
        module = pipeline_qwenimage_edit_plus
        image = image if isinstance(image, list) else [image]
        sizes = [module.calculate_dimensions(module.CONDITION_IMAGE_SIZE, img.width / img.height) for img in image]
        return [pipe.image_processor.resize(img, height, width) for img, (width, height) in zip(image, sizes)]
    first = image[0] if isinstance(image, list) else image  # Edit: the first source's size, at about 1 MP
    width, height, _ = pipeline_qwenimage_edit.calculate_dimensions(1024 * 1024, first.width / first.height)
    return pipe.image_processor.resize(image, height, width)


FAMILY = QwenImageFamily()
