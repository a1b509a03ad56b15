"""Qwen-Image 2.1: what the engine knows of the family without importing torch (models/spec.py), collected by
models/registry.py."""

from __future__ import annotations

from vllm_omni.diffusion.models.spec import COMMON_FIELDS, Family, PipelineSpec

FAMILY = Family(
    "qwen_image21",
    # Text-to-image. Its pipeline also takes condition images, but not with precomputed prompt
    # embeddings (no image_pad_mask argument), so those could not be encoded once per SP group.
    (
        PipelineSpec(
            "QwenImage21Pipeline",
            "qwen_image21",
            "generate",
            COMMON_FIELDS | {"negative_prompt", "true_cfg_scale"},
            # 16x VAE, unpatched latents: 16-pixel tokens; the pipeline rounds sides down to 32.
            size_multiple=32,
            token_pixels=16,
            default_steps=40,
            # The pipeline's default: meant to be sampled without guidance; true CFG with a scale above 1.
            default_true_cfg_scale=1.0,
            default_size=(1024, 1024),  # output_resolution's default
            cfg_parallel_refusal="runs true CFG as two forwards, but its transformer gives a row per prompt "
            "token too, so the branches' outputs differ in length and CFG parallel's exchange (equal shapes) "
            "cannot carry them; it is sampled without guidance by default (true_cfg_scale 1)",
            # The prompts of a list are padded to the longest, and the padding moves the image's rotary
            # positions: a request's image would depend on its company.
            batchable=False,
        ),
    ),
    {"tiny/qwen-image-2.1": "QwenImage21Pipeline"},
)
