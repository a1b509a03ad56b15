"""GLM-Image (`GlmImagePipeline`, text-to-image) with our SP DiT: what the generic runner needs.

The pipeline runs two stages. The autoregressive (AR) one, `vision_language_encoder` (a GLM-4
decoder, about 9B) fed by `processor`, samples the image's prior tokens: a preview grid, then
one token per 32x32 pixels, which it upsamples to one per DiT token. The DiT then denoises with
them, conditioned on the glyph embeddings (ByT5 over the prompt's quoted text), with CFG as two
forwards per step (uncond: glyph text "", prior tokens dropped).

Sampled tokens differ from rank to rank (and a rank's AR is the costliest part of a request), so
the AR runs once per SP group: `encode_text` generates the prior token ids on the group's rank 0
and the runner broadcasts them; every rank calls the pipeline with `prior_token_ids`, which skips
its AR. The glyph encoder (ByT5's encoder, small and deterministic) stays on every rank: the
pipeline refuses `prompt_embeds` and `negative_prompt_embeds` of different shapes, and the cond
and uncond glyph texts have different lengths whenever the prompt quotes text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from vllm_omni.diffusion.models.family import FamilyPipeline
from vllm_omni.diffusion.models.glm_image.transformer import GlmImageTransformer2DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.registry import PipelineSpec

DEFAULT_GUIDANCE_SCALE = 1.5  # the pipeline's `guidance_scale` default


class ReportProgress(StoppingCriteria):
    """Calls `progress(done, total)` after every generated token; never stops generation itself,
    but whatever `progress` raises ends it (cancellation between decode steps)."""

    def __init__(self, prompt_len: int, total: int, progress: Callable[[int, int], None]) -> None:
        self.prompt_len, self.total, self.progress = prompt_len, total, progress

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor, **kwargs: Any) -> torch.BoolTensor:
        self.progress(input_ids.shape[1] - self.prompt_len, self.total)
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def generate_prior_tokens(
    pipe: Any,
    prompt: str,
    height: int,
    width: int,
    generator: torch.Generator | None,
    progress: Callable[[int, int], None] | None = None,
    generate_kwargs: dict[str, Any] | None = None,
) -> torch.Tensor:
    """`pipe.generate_prior_tokens`' text-to-image path for one prompt ([1, (H/16)(W/16)] ids), seeded as
    the pipeline seeds it, with `progress` reported through the AR's `generate` (KV cache, transformers' own).
    `generate_kwargs`: more of `generate`'s arguments (benchmarks/glm_image.py measures a static cache)."""
    device = pipe._execution_device
    messages = [[{"role": "user", "content": [{"type": "text", "text": prompt}]}]]
    inputs = pipe.processor.apply_chat_template(
        messages, tokenize=True, padding=False, target_h=height, target_w=width, return_dict=True, return_tensors="pt"
    ).to(device)
    # ph*pw preview tokens, then (H/32)(W/32) image tokens, then the end token.
    total, image_offset, token_h, token_w = pipe._compute_generation_params(
        inputs["image_grid_thw"], is_text_to_image=True
    )
    if generator is not None:  # the pipeline's seeding: generate() takes no generator
        seed = generator.initial_seed()
        torch.manual_seed(seed)
        if device.type == "cuda":
            torch.cuda.manual_seed(seed)
    prompt_len = inputs["input_ids"].shape[-1]
    stopping = StoppingCriteriaList([ReportProgress(prompt_len, total, progress)] if progress is not None else [])
    outputs = pipe.vision_language_encoder.generate(
        **inputs, max_new_tokens=total, do_sample=True, stopping_criteria=stopping, **(generate_kwargs or {})
    )
    tokens = pipe._extract_large_image_tokens(outputs, prompt_len, image_offset, token_h * token_w)
    return pipe._upsample_token_ids(tokens, token_h, token_w)


class GlmImageFamily(FamilyPipeline):
    denoisers = {"transformer": GlmImageTransformer2DModel}
    default_negative_prompt = ""  # the uncond pass's glyph text; the pipeline takes no negative prompt
    # The AR model and its processor: a pipeline given prior_token_ids uses neither.
    text_encoders = ("vision_language_encoder", "processor")
    encodes_first = True  # the AR reports its tokens and stops at a cancel, on one process too

    def uses_cfg(self, request: DiffusionRequest) -> bool:
        """`do_classifier_free_guidance`: guidance_scale above 1 (the default, 1.5, is)."""
        scale = DEFAULT_GUIDANCE_SCALE if request.guidance_scale is None else request.guidance_scale
        return scale > 1

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """Keyword arguments of the pipeline's `__call__`; the size is always given (the engine restates
        the default: the pipeline's AR stage fails without one)."""
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "height": request.height,
            "width": request.width,
            "num_inference_steps": request.num_inference_steps,
            "num_images_per_prompt": request.num_images,  # every image shares the prompt's prior tokens
        }
        if request.guidance_scale is not None:
            kwargs["guidance_scale"] = request.guidance_scale
        return kwargs

    def encode_text(
        self, pipe, kwargs: dict[str, Any], progress: Callable[[int, int], None] | None = None
    ) -> dict[str, torch.Tensor]:
        """The AR stage's prior token ids for the call (one row: the pipeline repeats them per image)."""
        ids = generate_prior_tokens(
            pipe, kwargs["prompt"], kwargs["height"], kwargs["width"], kwargs.get("generator"), progress
        )
        return {"prior_token_ids": ids}

    def with_text(self, kwargs: dict[str, Any], embeds: dict[str, torch.Tensor]) -> dict[str, Any]:
        """`kwargs` with the prior token ids; the prompt stays, for the glyph encoder (every rank runs it)."""
        return {**kwargs, **embeds} if embeds else kwargs


FAMILY = GlmImageFamily()
