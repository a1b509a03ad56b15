"""FLUX.2: how a request becomes the call arguments of `diffusers.Flux2Pipeline` (FLUX.2-dev),
`Flux2KleinPipeline` or `Flux2KleinKVPipeline` (FLUX.2 klein).

The generic runner loads the pipeline with our transformer in place of diffusers' own and adds the
generator, output type and cancel hook; this module maps what differs. Input images are reference
images the generated image attends to. FLUX.2-dev is guidance-distilled: `guidance_scale` is the
embedded guidance the transformer reads (no negative prompt, no second forward). klein's base
checkpoints run classifier-free guidance against the empty prompt (`guidance_scale` > 1, two
forwards per step); its step-distilled ones (`is_distilled`, and the KV pipeline) run neither.
The KV pipeline computes the reference images' keys and values at the first step only; our
transformer's processors do that under SP too (transformer.py), so they replace the ones it installs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from vllm_omni.diffusion.models.family import FamilyPipeline, call_arg
from vllm_omni.diffusion.models.flux2.transformer import Flux2Transformer2DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.spec import PipelineSpec


class Flux2Family(FamilyPipeline):
    denoisers = {"transformer": Flux2Transformer2DModel}
    # FLUX.2-dev: Mistral 3 and its processor (the chat template); klein: Qwen3 and its tokenizer. Only
    # prompt encoding (and FLUX.2-dev's prompt upsampling, which the runner never asks for) uses them;
    # reference images go to the VAE alone.
    text_encoders = ("text_encoder", "tokenizer")

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """Keyword arguments of the pipeline's `__call__` for `request`; None fields keep the pipeline's defaults."""
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "height": request.height,  # None: the pipeline's default (or the first reference image's size)
            "width": request.width,
            "num_images_per_prompt": request.num_images,
        }
        if request.num_inference_steps is not None:
            kwargs["num_inference_steps"] = request.num_inference_steps
        if request.guidance_scale is not None:  # the specs of klein's step-distilled checkpoints refuse it
            # FLUX.2-dev: embedded guidance (default 4.0); klein base: the CFG scale (default 4.0).
            kwargs["guidance_scale"] = request.guidance_scale
        if request.images:
            if len(request.images) > spec.max_input_images:
                raise ValueError(
                    f"images: {spec.diffusers_class} takes at most {spec.max_input_images} reference images, "
                    f"got {len(request.images)}"
                )
            kwargs["image"] = list(request.images)
        return kwargs

    def call_kwargs(self, pipe: Any, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        kwargs = self.pipeline_kwargs(request, spec)
        if type(pipe).__name__ == "Flux2KleinPipeline" and pipe.config.is_distilled:
            kwargs.setdefault("guidance_scale", 1.0)  # step-distilled: no CFG either way; its 4.0 default only warns
        return kwargs

    def prepare_pipeline(self, pipe: Any) -> None:
        """The KV pipeline installs diffusers' KV processors, which attend to one rank's tokens only under SP;
        ours take the same arguments (transformer.py), so they go back in."""
        if type(pipe).__name__ == "Flux2KleinKVPipeline":
            pipe.transformer.use_sequence_parallel_processors()

    def encode_text(
        self, pipe, kwargs: dict[str, Any], device: torch.device, progress: Any = None
    ) -> dict[str, torch.Tensor]:
        """The prompt's embeddings, one row per prompt (the pipeline repeats them num_images_per_prompt times;
        its text ids follow from them); klein base's empty negative prompt's too where it runs CFG."""
        if kwargs.get("caption_upsample_temperature"):
            return {}  # FLUX.2-dev would rewrite the prompt with its text encoder first
        encode = dict(
            device=device,
            max_sequence_length=call_arg(pipe, kwargs, "max_sequence_length"),
            text_encoder_out_layers=call_arg(pipe, kwargs, "text_encoder_out_layers"),
        )
        prompt = kwargs["prompt"]
        embeds = {"prompt_embeds": pipe.encode_prompt(prompt, **encode)[0]}
        if self.runs_cfg(pipe, kwargs):
            # klein base's unconditional branch: the empty prompt, one per prompt (as its __call__ builds it).
            negative = [""] * len(prompt) if isinstance(prompt, list) else ""
            embeds["negative_prompt_embeds"] = pipe.encode_prompt(negative, **encode)[0]
        return embeds

    @staticmethod
    def runs_cfg(pipe: Any, kwargs: dict[str, Any]) -> bool:
        """Whether `pipe(**kwargs)` runs classifier-free guidance (klein base, guidance_scale > 1)."""
        if type(pipe).__name__ != "Flux2KleinPipeline" or pipe.config.is_distilled:
            return False
        return call_arg(pipe, kwargs, "guidance_scale") > 1


FAMILY = Flux2Family()
