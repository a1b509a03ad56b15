"""HunyuanVideo 1.5 pipelines (text-to-video, image-to-video) with our SP transformer in place of theirs.

The diffusers pipeline does everything else: Qwen2.5-VL and ByT5 prompt encoding, SigLIP and
VAE encoding of the input image, latents, scheduler, CFG through its guider, VAE decoding.
The generic runner loads it with our transformer and calls it with `FAMILY.call_kwargs`
(plus generator, output type and the cancel hook).

The CFG scale is not a `__call__` argument here: it lives in the pipeline's guider
(`ClassifierFreeGuidance.guidance_scale`; 1.0 turns CFG off and skips the negative prompt), so
`call_kwargs` sets the guider for each request, going back to the checkpoint's guider
when the request leaves guidance_scale unset. The image-to-video pipeline takes no size: it
sizes the video from the input image's aspect ratio at the transformer's `target_size`.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.models.branch_rows import stack_branches
from vllm_omni.diffusion.models.family import FamilyPipeline
from vllm_omni.diffusion.models.hunyuan_video_15.transformer import HunyuanVideo15Transformer3DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.spec import PipelineSpec

IMAGE_TO_VIDEO_PIPELINE = "HunyuanVideo15ImageToVideoPipeline"

# Each pipeline's guider as loaded from its checkpoint (requests change pipe.guider).
_checkpoint_guiders: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class HunyuanVideo15Family(FamilyPipeline):
    denoisers = {"transformer": HunyuanVideo15Transformer3DModel}
    default_negative_prompt = ""  # what the pipeline's guider uses when the request gives none
    # Qwen2.5-VL and ByT5 with their tokenizers: only prompt encoding uses them (image-to-video's
    # SigLIP image encoder and its feature extractor stay).
    text_encoders = ("text_encoder", "tokenizer", "text_encoder_2", "tokenizer_2")

    def uses_cfg(self, request: DiffusionRequest) -> bool:
        """The guider runs two forwards per step unless the scale is 1 (the checkpoint's default scale is above 1)."""
        return request.guidance_scale is None or request.guidance_scale > 1

    def cfg_rows(self, cond: dict[str, Any], uncond: dict[str, Any]) -> dict[str, Any] | None:
        """The prompt's and the negative prompt's rows in one forward (texts padded to one length, with masks)."""
        return stack_branches(cond, uncond)

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """The per-request keyword arguments of the pipeline's `__call__` (None fields: pipeline defaults)."""
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "negative_prompt": request.negative_prompt,
            "num_inference_steps": request.num_inference_steps,
            "num_videos_per_prompt": request.num_images,
        }
        if request.num_frames is not None:
            kwargs["num_frames"] = request.num_frames
        if spec.diffusers_class == IMAGE_TO_VIDEO_PIPELINE:
            if not request.images:
                raise ValueError("image-to-video needs an input image")
            kwargs["image"] = request.images[0]
        else:
            kwargs["height"], kwargs["width"] = request.height, request.width
        return kwargs

    def call_kwargs(self, pipe, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """Set the pipeline's guider to the request's CFG scale, and return `pipeline_kwargs`.

        Also makes the VAE decode video by video, so that num_videos_per_prompt > 1 works.
        The runner calls it before each request; it replaces `pipe.guider` (the guider's own
        `new`), never mutating the checkpoint's guider, so requests do not leak into each other.
        """
        # diffusers' VAE mid-block attention breaks on a batch of several videos ([B, L, L] causal mask
        # against [B, 1, L, C] queries); decoding one video at a time gives the same frames.
        pipe.vae.enable_slicing()
        checkpoint_guider = _checkpoint_guiders.setdefault(pipe, pipe.guider)
        if request.guidance_scale is None:
            pipe.guider = checkpoint_guider
        else:
            pipe.guider = checkpoint_guider.new(guidance_scale=request.guidance_scale)
        return self.pipeline_kwargs(request, spec)

    def encode_text(
        self, pipe, kwargs: dict[str, Any], device: torch.device, progress: Any = None
    ) -> dict[str, torch.Tensor]:
        """Both encoders' embeddings and masks, one row each (the pipeline repeats them
        num_videos_per_prompt times); the negative prompt's only where the guider that
        `call_kwargs` set runs CFG."""
        branches = ["prompt"]
        if diffusers_compat.guider_enabled(pipe.guider) and pipe.guider.num_conditions > 1:  # as __call__ decides it
            branches.append("negative_prompt")
        embeds = {}
        for name in branches:
            # dtype as __call__ passes it (encode_prompt's own default reads the text encoder's dtype)
            outputs = pipe.encode_prompt(kwargs.get(name), device=device, dtype=pipe.transformer.dtype)
            keys = (f"{name}_embeds", f"{name}_embeds_mask", f"{name}_embeds_2", f"{name}_embeds_mask_2")
            embeds.update(zip(keys, outputs))
        return embeds


FAMILY = HunyuanVideo15Family()
