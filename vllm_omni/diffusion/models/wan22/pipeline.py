"""Wan2.2 pipelines (`WanPipeline` text-to-video, `WanImageToVideoPipeline`) with our SP experts.

The diffusers pipeline does everything else: UMT5 prompt encoding (padded to 512 tokens), the
input image's VAE latents (image-to-video conditions through the latent channels), latents,
the UniPC scheduler, CFG as two forwards per step, the switch from the high-noise expert
(`transformer`) to the low-noise one (`transformer_2`) at `boundary_ratio`, and VAE decoding.
Both experts are declared, so both are sharded, compiled and graphed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.models.branch_rows import stack_branches
from vllm_omni.diffusion.models.family import FamilyPipeline, call_arg
from vllm_omni.diffusion.models.wan22.transformer import WanTransformer3DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.spec import PipelineSpec

IMAGE_TO_VIDEO_PIPELINE = "WanImageToVideoPipeline"
DEFAULT_GUIDANCE_SCALE = 5.0  # both pipelines' `guidance_scale` default


class Wan22Family(FamilyPipeline):
    # transformer_2 is null in TI2V-5B's model_index.json: the runner loads the experts a checkpoint has.
    denoisers = {"transformer": WanTransformer3DModel, "transformer_2": WanTransformer3DModel}
    default_negative_prompt = ""  # what encode_prompt uses when a CFG request gives none
    # UMT5 and its tokenizer serve only prompt encoding (the Wan2.2 checkpoints have no image encoder).
    text_encoders = ("text_encoder", "tokenizer")

    def uses_cfg(self, request: DiffusionRequest) -> bool:
        """`do_classifier_free_guidance`: guidance_scale above 1 (the default, 5.0, is)."""
        scale = DEFAULT_GUIDANCE_SCALE if request.guidance_scale is None else request.guidance_scale
        return scale > 1

    def cfg_rows(self, cond: dict[str, Any], uncond: dict[str, Any]) -> dict[str, Any] | None:
        """The prompt's and the negative prompt's rows in one forward (the text is padded to one length already)."""
        return stack_branches(cond, uncond)

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """Keyword arguments of the pipeline's `__call__` (None fields keep the pipeline's defaults)."""
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "negative_prompt": request.negative_prompt,
            "num_inference_steps": request.num_inference_steps,
            "num_videos_per_prompt": request.num_images,
        }
        for name, value in (
            ("height", request.height),
            ("width", request.width),
            ("num_frames", request.num_frames),
            ("guidance_scale", request.guidance_scale),
            ("guidance_scale_2", request.guidance_scale_2),  # A14B's low-noise expert; the pipeline: guidance_scale
        ):
            if value is not None:
                kwargs[name] = value
        if spec.diffusers_class == IMAGE_TO_VIDEO_PIPELINE:
            if not request.images:
                raise ValueError("image-to-video needs an input image")
            kwargs["image"] = request.images[0]  # resized to the video's size by the pipeline
        return kwargs

    def encode_text(
        self, pipe, kwargs: dict[str, Any], device: torch.device, progress: Any = None
    ) -> dict[str, torch.Tensor]:
        """The prompt's embeddings, and the negative prompt's under CFG, num_videos_per_prompt rows
        each: given embeddings, the pipeline takes its batch from them and repeats nothing."""
        prompt_embeds, negative_prompt_embeds = pipe.encode_prompt(
            kwargs["prompt"],
            kwargs.get("negative_prompt"),
            do_classifier_free_guidance=call_arg(pipe, kwargs, "guidance_scale") > 1,  # as the pipeline's property
            num_videos_per_prompt=call_arg(pipe, kwargs, "num_videos_per_prompt"),
            max_sequence_length=call_arg(pipe, kwargs, "max_sequence_length"),  # encode_prompt's default is 226
            device=device,
        )
        embeds = {"prompt_embeds": prompt_embeds}
        if negative_prompt_embeds is not None:
            embeds["negative_prompt_embeds"] = negative_prompt_embeds
        return embeds

    def with_text(self, kwargs: dict[str, Any], embeds: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The prompts replaced, and one video per embeddings row (they hold num_videos_per_prompt rows)."""
        if not embeds:
            return kwargs
        return dict(super().with_text(kwargs, embeds), num_videos_per_prompt=1)


FAMILY = Wan22Family()
