"""FLUX.2-dev: how a request becomes `diffusers.Flux2Pipeline` call arguments.

The generic runner loads the pipeline with our transformer in place of diffusers' own
and adds the generator, output type and cancel hook; this module maps what differs per family.
FLUX.2-dev is guidance-distilled: `guidance_scale` is the embedded guidance the transformer reads
(no negative prompt, no second forward), and input images are reference images the generated
image attends to.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from vllm_omni.diffusion.data import DiffusionRequest
from vllm_omni.diffusion.models.family import FamilyPipeline
from vllm_omni.diffusion.models.flux2.transformer import Flux2Transformer2DModel

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.registry import PipelineSpec


class Flux2Family(FamilyPipeline):
    denoisers = {"transformer": Flux2Transformer2DModel}  # no CFG: guidance is embedded

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


FAMILY = Flux2Family()
