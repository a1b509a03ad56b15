"""FLUX.2-dev: how a request becomes `diffusers.Flux2Pipeline` call arguments.

The generic runner loads the pipeline with our transformer in place of diffusers' own
and adds the generator, output type and cancel hook; this module maps what differs per family.
FLUX.2-dev is guidance-distilled: `guidance_scale` is the embedded guidance the transformer reads
(no negative prompt, no second forward), and input images are reference images the generated
image attends to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.models.family import FamilyPipeline, call_arg
from vllm_omni.diffusion.models.flux2.transformer import Flux2Transformer2DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.registry import PipelineSpec


class Flux2Family(FamilyPipeline):
    denoisers = {"transformer": Flux2Transformer2DModel}  # no CFG: guidance is embedded
    # Mistral 3 and its processor (the chat template): only prompt encoding (and prompt upsampling,
    # which the runner never asks for) uses them; reference images go to the VAE alone.
    text_encoders = ("text_encoder", "tokenizer")

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """Keyword arguments of `Flux2Pipeline.__call__` for `request`; None fields keep the pipeline's defaults."""
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "height": request.height,  # None: the pipeline's default (or the first reference image's size)
            "width": request.width,
            "num_images_per_prompt": request.num_images,
        }
        if request.num_inference_steps is not None:
            kwargs["num_inference_steps"] = request.num_inference_steps
        if request.guidance_scale is not None:
            kwargs["guidance_scale"] = request.guidance_scale  # embedded guidance; the pipeline's default is 4.0
        if request.images:
            if len(request.images) > spec.max_input_images:
                raise ValueError(
                    f"images: {spec.diffusers_class} takes at most {spec.max_input_images} reference images, "
                    f"got {len(request.images)}"
                )
            kwargs["image"] = list(request.images)
        return kwargs

    def encode_text(self, pipe, kwargs: dict[str, Any], progress: Any = None) -> dict[str, torch.Tensor]:
        """The prompt's embeddings, one row (the pipeline repeats them num_images_per_prompt times;
        its text ids follow from them). No negative prompt: FLUX.2-dev's guidance is embedded."""
        if kwargs.get("caption_upsample_temperature"):
            return {}  # the pipeline would rewrite the prompt with its text encoder first
        prompt_embeds, _ = pipe.encode_prompt(
            kwargs["prompt"],
            device=pipe._execution_device,
            max_sequence_length=call_arg(pipe, kwargs, "max_sequence_length"),
            text_encoder_out_layers=call_arg(pipe, kwargs, "text_encoder_out_layers"),
        )
        return {"prompt_embeds": prompt_embeds}


FAMILY = Flux2Family()
