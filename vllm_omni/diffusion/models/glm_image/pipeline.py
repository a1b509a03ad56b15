"""GLM-Image (`GlmImagePipeline`: text-to-image, and image-to-image with source images) with our SP DiT.

The pipeline runs two stages. The autoregressive (AR) one, `vision_language_encoder` (a GLM-4
decoder, about 9B) fed by `processor`, samples the image's prior tokens: text-to-image, a preview
grid, then one token per 32x32 pixels; image-to-image, after reading the source images (their own
AR tokens, one per 32x32 pixels), the 32-pixel grid alone. It upsamples them to one per DiT token.
The DiT then denoises with them, conditioned on the glyph embeddings (ByT5 over the prompt's
quoted text), with CFG as two forwards per step (uncond: glyph text "", prior tokens dropped).
Image-to-image first runs each source (its VAE latents and AR tokens) through the DiT once, which
caches its keys and values for every cond forward (models/glm_image/transformer.py).

Sampled tokens differ from rank to rank (and a rank's AR is the costliest part of a request), so
the AR runs once per SP group: `encode_text` generates the prior token ids (and the sources' AR
tokens) on the group's rank 0 and the runner broadcasts them; every rank calls the pipeline with
`prior_token_ids` (and `prior_token_image_ids`, `source_image_grid_thw`), which skips its AR. The
glyph encoder (ByT5's encoder, small and deterministic) stays on every rank: the pipeline refuses
`prompt_embeds` and `negative_prompt_embeds` of different shapes, and the cond and uncond glyph
texts have different lengths whenever the prompt quotes text.

Sources are put on the AR's 32-pixel grid (sides floored, as the engine's spec states) before the
pipeline sees them: there the AR's tokens of a source, upsampled, match its DiT tokens one for
one, which the pipeline needs (off the grid it fails for many sizes). diffusers 0.42.1's own AR
stage cannot read sources with transformers 5 (it hands the vision features to `get_image_tokens`
concatenated, which that reads per image); `generate_prior_tokens` here hands them per image.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from PIL import Image
from transformers import StoppingCriteria, StoppingCriteriaList

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.models.branch_rows import stack_branches
from vllm_omni.diffusion.models.family import FamilyPipeline
from vllm_omni.diffusion.models.glm_image.transformer import GlmImageTransformer2DModel
from vllm_omni.diffusion.request import DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.spec import PipelineSpec

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
    device: torch.device,
    prompt: str,
    height: int,
    width: int,
    generator: torch.Generator | None,
    progress: Callable[[int, int], None] | None = None,
    generate_kwargs: dict[str, Any] | None = None,
    images: list[Any] | None = None,
) -> dict[str, torch.Tensor]:
    """`pipe.generate_prior_tokens` for one prompt, and its source `images` where given, seeded as the
    pipeline seeds it, with `progress` reported through the AR's `generate` (KV cache, transformers' own).

    Returns `prior_token_ids` [1, (H/16)(W/16)]; with images also the sources' upsampled AR tokens
    `prior_token_image_ids` [sum of their DiT tokens] and their grids `source_image_grid_thw` [n, 3].
    `generate_kwargs`: more of `generate`'s arguments (benchmarks/glm_image.py measures a static cache)."""
    content = [{"type": "image", "image": image} for image in images or []]
    messages = [[{"role": "user", "content": [*content, {"type": "text", "text": prompt}]}]]
    inputs = pipe.processor.apply_chat_template(
        messages, tokenize=True, padding=False, target_h=height, target_w=width, return_dict=True, return_tensors="pt"
    ).to(device)
    # Text-to-image: ph*pw preview tokens, then (H/32)(W/32) image tokens, then the end token; with
    # sources, the image tokens and the end token.
    total, image_offset, token_h, token_w = diffusers_compat.pipeline_method(pipe, "compute_generation_params")(
        inputs["image_grid_thw"], is_text_to_image=not images
    )
    out = {}
    if images:
        out.update(_source_tokens(pipe, inputs, images))
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
    tokens = diffusers_compat.pipeline_method(pipe, "extract_large_image_tokens")(
        outputs, prompt_len, image_offset, token_h * token_w
    )
    check_image_tokens(pipe, tokens, token_h * token_w)
    upsample = diffusers_compat.pipeline_method(pipe, "upsample_token_ids")
    return {"prior_token_ids": upsample(tokens, token_h, token_w), **out}


def check_image_tokens(pipe: Any, tokens: torch.Tensor, expected: int) -> None:
    """The AR's image tokens must be `expected` codebook ids: a shorter run (an end token sampled early) would fail
    later with an unclear shape error, and an id past the DiT's codebook (the AR's vocabulary also holds the image
    start, end and other specials) as a device-side assert in its embedding lookup, which leaves the worker's GPU
    unusable. Raised here, on the rank that sampled them, the request fails alone (runner._shared_embeddings)."""
    if tokens.numel() != expected:
        raise RuntimeError(f"the AR stage stopped after {tokens.numel()} of the image's {expected} prior tokens")
    transformer = getattr(pipe, "transformer", None)
    if transformer is None:  # an AR-only pipeline (benchmarks/glm_image.py): nothing to look the ids up in
        return
    codebook = transformer.config.prior_vq_quantizer_codebook_size
    outside = int(((tokens < 0) | (tokens >= codebook)).sum())  # one small sync a request
    if outside:
        raise RuntimeError(
            f"the AR stage sampled {outside} of the image's {expected} prior tokens outside the DiT's codebook of "
            f"{codebook} ids (not image tokens: the AR model and the DiT do not match, or the AR model is untrained)"
        )


def _source_tokens(pipe: Any, inputs: Any, images: list[Any]) -> dict[str, torch.Tensor]:
    """The sources' AR tokens as the pipeline's AR stage computes them, upsampled to one per DiT token."""
    ar = pipe.vision_language_encoder
    grids = inputs["image_grid_thw"][: len(images)]  # then the target's grid
    features = ar.get_image_features(inputs["pixel_values"], grids).pooler_output  # per source: [C, h, w]
    ids, upsampled = [], grids.clone()
    upsampled[:, 1:] *= 2
    step = pipe.vae_scale_factor * pipe.transformer.config.patch_size
    for image, feature, grid, (_, rows, cols) in zip(images, features, grids, upsampled.tolist()):
        if (rows, cols) != (image.height // step, image.width // step):
            raise ValueError(
                f"the AR stage reads a {image.width}x{image.height} source as {cols // 2}x{rows // 2} tokens, which "
                f"do not match its {image.width // step}x{image.height // step} DiT tokens: use a source on the "
                "32-pixel grid within the processor's size bounds"
            )
        tokens = ar.get_image_tokens(feature[None], grid[None])
        upsample = diffusers_compat.pipeline_method(pipe, "upsample_token_ids")
        ids.append(upsample(tokens, *grid[1:].tolist()).squeeze(0))
    return {"prior_token_image_ids": torch.cat(ids), "source_image_grid_thw": upsampled}


def on_token_grid(image: Any, step: int = 32) -> Any:
    """`image` with its sides floored to `step` pixels (the AR's grid), resized as the pipeline resizes for its VAE."""
    width, height = image.width // step * step, image.height // step * step
    if (width, height) == image.size:
        return image
    return image.resize((width, height), Image.LANCZOS)


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

    def cfg_rows(self, cond: dict[str, Any], uncond: dict[str, Any]) -> dict[str, Any] | None:
        """The prompt's and the negative prompt's rows in one forward; not while the source images' KV caches are
        in use (an edit): the pipeline switches their mode between the two calls (read, then skip)."""
        caches = cond.get("kv_caches")
        if caches is not None and any(layer.mode is not None for layer in caches.caches):
            return None
        return stack_branches(cond, uncond)

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """Keyword arguments of the pipeline's `__call__`; the size is always given (the engine restates
        the default: the pipeline's AR stage fails without one), the sources on the AR's grid."""
        if request.images and request.cache_threshold is not None:
            # The sources' DiT pass would count as a step, and its shapes differ from the steps'.
            raise ValueError(
                "image: the step cache does not run GLM-Image's image-to-image (the sources' K/V pass is not a "
                "denoising step); serve it without --cache"
            )
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "height": request.height,
            "width": request.width,
            "num_inference_steps": request.num_inference_steps,
            "num_images_per_prompt": request.num_images,  # every image shares the prompt's prior tokens
        }
        if request.guidance_scale is not None:
            kwargs["guidance_scale"] = request.guidance_scale
        if request.images:
            kwargs["image"] = [on_token_grid(image, spec.size_multiple) for image in request.images]
        return kwargs

    def encode_text(
        self,
        pipe,
        kwargs: dict[str, Any],
        device: torch.device,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The AR stage's prior token ids for the call (one row: the pipeline repeats them per image), and
        with source images their AR tokens and grids."""
        generator = kwargs.get("generator")
        if isinstance(generator, list):  # one per image: the AR stage runs once, seeded by the first (as diffusers')
            generator = generator[0]
        return generate_prior_tokens(
            pipe,
            device,
            kwargs["prompt"],
            kwargs["height"],
            kwargs["width"],
            generator,
            progress,
            images=kwargs.get("image"),
        )

    def with_text(self, kwargs: dict[str, Any], embeds: dict[str, torch.Tensor]) -> dict[str, Any]:
        """`kwargs` with the prior token ids (the sources' as the pipeline's one-sample lists); the prompt
        stays, for the glyph encoder (every rank runs it)."""
        sources = ("prior_token_image_ids", "source_image_grid_thw")
        per_sample = {name: [embeds[name]] for name in sources if name in embeds}
        return {**kwargs, **embeds, **per_sample} if embeds else kwargs


FAMILY = GlmImageFamily()
