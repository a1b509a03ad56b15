"""Z-Image (text-to-image) and its img2img pipeline: how a request becomes their call arguments.

The generic runner loads `diffusers.ZImagePipeline` / `ZImageImg2ImgPipeline` with our transformer
in place of diffusers' own and adds the generator, output type and cancel hook. A checkpoint of the
text-to-image pipeline (Z-Image-Turbo's) serves edits too: a request with a source image runs the
img2img pipeline built on the same components. Guidance is real
classifier-free guidance whenever `guidance_scale` > 0 (the Turbo runs 0.0: one forward per step),
with the negative prompt as the uncond branch; the pipelines run both branches as one batched
forward. Prompt embeddings are a list (one tensor per prompt, of its own length), so they travel
between ranks as one tensor per row.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from diffusers import ZImageImg2ImgPipeline

from vllm_omni.diffusion.models.family import FamilyPipeline, call_arg
from vllm_omni.diffusion.models.z_image.transformer import ZImageTransformer2DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.spec import PipelineSpec

EMBEDS = ("prompt_embeds", "negative_prompt_embeds")


class ZImageFamily(FamilyPipeline):
    # CFG runs as one batched forward ([prompts, negative prompts]), so `uses_cfg` (two calls a step) stays False.
    denoisers = {"transformer": ZImageTransformer2DModel}
    default_negative_prompt = ""  # the pipelines' own default, one per prompt
    # Qwen3 and its tokenizer (the chat template): only prompt encoding uses them.
    text_encoders = ("text_encoder", "tokenizer")

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """Keyword arguments of the pipeline's `__call__` for `request`; None fields keep its defaults."""
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "height": request.height,  # None: 1024 (text-to-image) or the source image's size (img2img)
            "width": request.width,
            "num_images_per_prompt": request.num_images,
        }
        if request.num_inference_steps is not None:
            kwargs["num_inference_steps"] = request.num_inference_steps
        if request.guidance_scale is not None:
            kwargs["guidance_scale"] = request.guidance_scale
        if request.negative_prompt is not None:
            kwargs["negative_prompt"] = request.negative_prompt
        if request.images:
            kwargs["image"] = request.images[0]
        return kwargs

    def pipeline_for(self, pipe: Any, request: DiffusionRequest) -> Any:
        """The img2img pipeline on `pipe`'s components for a request with a source image; else `pipe`."""
        if not request.images or isinstance(pipe, ZImageImg2ImgPipeline):
            return pipe
        img2img = ZImageImg2ImgPipeline(**pipe.components)  # the same modules: no weights copied
        img2img.set_progress_bar_config(**getattr(pipe, "_progress_bar_config", {}))
        return img2img

    def call_kwargs(self, pipe: Any, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """As `pipeline_kwargs`; a source image of another size than the request's is resized to it first, by
        the pipeline's own image processor (img2img encodes the source at its own size and would not match)."""
        kwargs = self.pipeline_kwargs(request, spec)
        image, width, height = kwargs.get("image"), kwargs["width"], kwargs["height"]
        if image is not None and width is not None and height is not None:
            multiple = pipe.image_processor.config.vae_scale_factor
            if (image.width // multiple * multiple, image.height // multiple * multiple) != (width, height):
                kwargs["image"] = pipe.image_processor.resize(image, height, width)
        return kwargs

    def encode_text(
        self, pipe: Any, kwargs: dict[str, Any], device: torch.device, progress: Any = None
    ) -> dict[str, torch.Tensor]:
        """The prompts' embeddings (and the negative prompts' where the call runs CFG), one row per prompt
        (the pipeline repeats them num_images_per_prompt times), as `<argument>.<row>`."""
        prompt, negative = kwargs["prompt"], kwargs.get("negative_prompt")
        prompt_embeds, negative_embeds = pipe.encode_prompt(
            # Copies: the pipeline writes the chat-templated prompts into the list it is given.
            list(prompt) if isinstance(prompt, list) else prompt,
            device=device,
            do_classifier_free_guidance=call_arg(pipe, kwargs, "guidance_scale") > 0,  # the pipelines' rule
            negative_prompt=list(negative) if isinstance(negative, list) else negative,
            max_sequence_length=call_arg(pipe, kwargs, "max_sequence_length"),
        )
        rows = {name: embeds for name, embeds in zip(EMBEDS, (prompt_embeds, negative_embeds))}
        return {f"{name}.{i}": row for name, embeds in rows.items() for i, row in enumerate(embeds)}

    def with_text(self, kwargs: dict[str, Any], embeds: dict[str, torch.Tensor]) -> dict[str, Any]:
        """`kwargs` with the embedding lists rebuilt from `encode_text`'s rows in place of the prompts."""
        if not embeds:
            return kwargs
        lists = {}
        for name in EMBEDS:
            rows = [embeds[f"{name}.{i}"] for i in range(len(embeds)) if f"{name}.{i}" in embeds]
            if rows:
                lists[name] = rows
        return {**kwargs, "prompt": None, "negative_prompt": None, **lists}


FAMILY = ZImageFamily()
