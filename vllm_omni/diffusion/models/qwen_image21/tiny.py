"""The tiny embedded Qwen-Image 2.1 model: a complete diffusers pipeline folder with seeded random weights.

Tests and demos call :func:`tiny_model_path`. Every component is the real class
(``QwenImage21Transformer2DModel``, ``AutoencoderKLQwenImage21``, ``Qwen3VLForConditionalGeneration``,
``Qwen3VLProcessor``, ``FlowMatchEulerDiscreteScheduler``) with small widths and depths, keeping the
geometry callers depend on: 16x VAE compression to 64 latent channels, unpatched latents (one token per
16x16 pixels, sides rounded to 32), RGBA in and out of the VAE.
"""

from __future__ import annotations

import os
import pathlib

import torch

from vllm_omni.diffusion.models.qwen_image21.spec import FAMILY
from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model
from vllm_omni.diffusion.models.tiny_qwen_tokenizer import (
    CHAT_TEMPLATE,
    build_qwen2_tokenizer,
    qwen2_5_vl_text_config,
    special_token_ids,
)

TINY_MODELS: dict[str, str] = FAMILY.tiny_models  # name -> diffusers pipeline, declared in spec.py

# Bump when the generated folder changes so stale caches are not reused.
_CACHE_VERSION = "v1"

_TEXT_HIDDEN = 64  # the text encoder's width: the transformer's context_in_dim
_LATENT_CHANNELS = 64  # the real VAE's z_dim; the transformer reads latents unpatched


def _build_text_encoder(tokenizer):
    """A two-layer Qwen3-VL (the pipeline reads the last layer's hidden states, before the final norm)."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    ids = special_token_ids(tokenizer)
    text_config = qwen2_5_vl_text_config(tokenizer, _TEXT_HIDDEN)
    text_config.update(head_dim=_TEXT_HIDDEN // 4)
    config = Qwen3VLConfig(
        text_config=text_config,
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 16,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "out_hidden_size": _TEXT_HIDDEN,
            "num_position_embeddings": 256,
            "deepstack_visual_indexes": [1],
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3VLForConditionalGeneration(config).to(torch.float32).eval()


def _build_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

    # Qwen3-VL's preprocessing: 16px patches merged 2x2, mean/std 0.5.
    vision = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**vision),
        chat_template=CHAT_TEMPLATE,
    )


def _build_transformer():
    from diffusers import QwenImage21Transformer2DModel

    torch.manual_seed(0)
    return QwenImage21Transformer2DModel(
        patch_size=1,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=6,
        context_in_dim=_TEXT_HIDDEN,
        mlp_ratio=3,
        axes_dims_rope=(4, 6, 6),  # frame/height/width rotary dims, summing to attention_head_dim
    ).eval()


def _build_vae():
    from diffusers import AutoencoderKLQwenImage21

    torch.manual_seed(0)
    return AutoencoderKLQwenImage21(
        base_dim=8,
        decoder_base_dim=8,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 1, 1, 1, 1],
        num_res_blocks=1,
        temperal_downsample=[False, True, True, True],  # four downsamples: 16x spatial like the real VAE
    ).eval()


def _build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # The resolution-dependent shift the pipeline computes (calculate_shift's defaults).
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        time_shift_type="exponential",
    )


def build_tiny_model(name: str, folder: str | os.PathLike) -> None:
    """Write the complete diffusers folder of tiny model ``name`` into ``folder``."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    import diffusers

    tokenizer = build_qwen2_tokenizer([])
    pipe = getattr(diffusers, TINY_MODELS[name])(
        scheduler=_build_scheduler(),
        vae=_build_vae(),
        text_encoder=_build_text_encoder(tokenizer),
        processor=_build_processor(tokenizer),
        transformer=_build_transformer(),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def tiny_model_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """Return the cached folder of tiny model ``name``, building it on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_model, cache_dir)
