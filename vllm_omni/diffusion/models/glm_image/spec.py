"""GLM-Image: what the engine knows of the family without importing torch (models/spec.py), collected by
models/registry.py."""

from __future__ import annotations

from vllm_omni.diffusion.models.spec import COMMON_FIELDS, Family, PipelineSpec

FAMILY = Family(
    "glm_image",
    # The AR stage samples the prior tokens once (family.encode_text), then the DiT runs with CFG.
    # No negative prompt (the uncond pass's glyph text is always ""). Source images are optional
    # (one checkpoint does text-to-image and image-to-image, so one spec): the AR reads them, and
    # the DiT caches their keys and values once for every cond forward.
    (
        PipelineSpec(
            "GlmImagePipeline",
            "glm_image",
            "generate",
            COMMON_FIELDS | {"guidance_scale"},
            max_input_images=4,
            # Sources go on the AR's 32-pixel grid (sides floored; there its tokens match the DiT's). Without
            # a size the output takes the first source's: the pipeline's rule (its size floored to 16
            # pixels), on the 32-pixel grid its AR needs (the pipeline's own AR stage fails without a size).
            source_resize="grid",
            # Their keys and values join every cond forward's attention (keys only: counted in full).
            sources_in_sequence=True,
            max_source_aspect_ratio=4.0,  # the AR's image processor refuses sources more elongated
            # 8x VAE and 2x2 patches: 16-pixel DiT tokens; the AR generates one token per 32x32 pixels.
            size_multiple=32,
            token_pixels=16,
            exact_size=True,
            # default_sample_size 128 x the VAE's 8; the pipeline's AR stage needs a size, so one is always given.
            default_size=(1024, 1024),
            cfg_parallel_refusal="runs classifier-free guidance, but its uncond pass also drops the prior tokens, "
            "which CFG parallel's prompt swap cannot express",
            # A list of prompts shares one AR sampling seed and left-pads the glyph texts: a request's
            # image would depend on its company.
            batchable=False,
        ),
    ),
    {"tiny/glm-image": "GlmImagePipeline"},
)
