"""FLUX.2-dev and klein: what the engine knows of the family without importing torch (models/spec.py), collected by
models/registry.py."""

from __future__ import annotations

from vllm_omni.diffusion.models.spec import COMMON_FIELDS, Family, PipelineSpec

FLUX2_STEP_CACHE_REFUSAL = (
    "joins text and image into one stream for its single-stream blocks, which diffusers' First-Block-Cache "
    "(0.42.1) cannot cache (its residuals change shape); serve it uncached"
)


def _flux2(diffusers_class: str, fields: frozenset[str], **overrides) -> PipelineSpec:
    """FLUX.2-dev and klein: input images are optional references, each shrunk to at most 1 MP and adding its
    tokens (at most 4096) to the sequence; without a size the output takes the first reference's size."""
    return PipelineSpec(
        diffusers_class,
        "flux2",
        "generate",
        fields,
        max_input_images=10,
        default_size=(1024, 1024),  # default_sample_size 128 x the VAE's 8
        source_resize="shrink",
        sources_in_sequence=True,  # klein KV: at the first step; later steps reuse their keys and values
        step_cache_refusal=FLUX2_STEP_CACHE_REFUSAL,
        **overrides,
    )


FAMILY = Family(
    "flux2",
    (
        # FLUX.2-dev is guidance-distilled: guidance_scale is embedded, one forward per step.
        _flux2("Flux2Pipeline", COMMON_FIELDS | {"guidance_scale"}),
        # FLUX.2 klein base (no `is_distilled`): CFG against the fixed empty prompt at guidance_scale > 1.
        _flux2(
            "Flux2KleinPipeline",
            COMMON_FIELDS | {"guidance_scale"},
            cfg_parallel_refusal="runs classifier-free guidance against a fixed empty prompt that the pipeline "
            "encodes itself (it takes no negative prompt), which CFG parallel's prompt swap cannot express",
        ),
        # klein step-distilled (FLUX.2-klein-4B / 9B, `is_distilled`) and klein KV: 4 steps, no guidance at all.
        _flux2("Flux2KleinPipeline", COMMON_FIELDS, default_steps=4, model_index=(("is_distilled", True),)),
        _flux2("Flux2KleinKVPipeline", COMMON_FIELDS, default_steps=4),
    ),
    {
        "tiny/flux2": "Flux2Pipeline",
        "tiny/flux2-klein": "Flux2KleinPipeline",
        "tiny/flux2-klein-kv": "Flux2KleinKVPipeline",
    },
)
