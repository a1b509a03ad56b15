"""Tiny embedded Z-Image model: a complete diffusers folder with seeded random weights.

Tests and demos call :func:`tiny_model_path` (or :func:`build_tiny_model`) to get a folder that
``ZImagePipeline`` (and ``ZImageImg2ImgPipeline``) load exactly like Z-Image-Turbo, without any hub
access. Every component is the real class (``ZImageTransformer2DModel``, the FLUX.1-style
``AutoencoderKL``, ``Qwen3Model`` with a ``Qwen2Tokenizer`` trained here, and the Turbo's
``FlowMatchEulerDiscreteScheduler``) with shrunken widths, depths and vocabulary, while the geometry
that callers depend on is kept: 8x VAE compression, 16 latent channels and 2x2 patches (one token
per 16x16 pixels, so 1024x1024 gives 4096 image tokens), and 6 attention heads (Ulysses 2 and 3).
"""

from __future__ import annotations

import os
import pathlib

import torch

from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model
from vllm_omni.diffusion.models.tiny_qwen_tokenizer import CHAT_TEMPLATE, build_qwen2_tokenizer, special_token_ids
from vllm_omni.diffusion.models.z_image.spec import FAMILY

TINY_MODELS: dict[str, str] = FAMILY.tiny_models  # name -> diffusers pipeline, declared in spec.py

# Bump when the generated folder changes so stale caches are not reused.
_CACHE_VERSION = "v1"

# Text encoder width: the transformer's cap_feat_dim (the pipeline passes hidden_states[-2]).
_TEXT_HIDDEN = 32
_LATENT_CHANNELS = 16
# The Z-Image-Turbo checkpoint's scheduler: a static shift of 3 (the pipeline's mu is then unused).
SCHEDULER_CONFIG = dict(num_train_timesteps=1000, shift=3.0, use_dynamic_shifting=False)


# The chat template as the pipelines render it around a prompt (Qwen3's, with thinking enabled: no think block).
PROMPT_TEMPLATE = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def _build_tokenizer():
    # The pipelines keep every token the mask marks valid: no fixed prefix to match, unlike Qwen-Image's.
    tokenizer = build_qwen2_tokenizer([PROMPT_TEMPLATE.format("")])
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _build_text_encoder(tokenizer):
    """A two-layer Qwen3 whose hidden size is the transformer's cap_feat_dim."""
    from transformers import Qwen3Config, Qwen3Model

    ids = special_token_ids(tokenizer)
    config = Qwen3Config(
        vocab_size=-(-len(tokenizer) // 64) * 64,  # padded past the tokenizer's length, like the real model
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=2 * _TEXT_HIDDEN,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        pad_token_id=ids["<|endoftext|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen3Model(config).to(torch.float32).eval()


def _build_transformer():
    from diffusers import ZImageTransformer2DModel

    torch.manual_seed(1)
    model = ZImageTransformer2DModel(
        all_patch_size=(2,),
        all_f_patch_size=(1,),
        in_channels=_LATENT_CHANNELS,
        dim=96,
        n_layers=2,
        n_refiner_layers=1,
        n_heads=6,
        n_kv_heads=6,
        cap_feat_dim=_TEXT_HIDDEN,
        axes_dims=[4, 6, 6],  # frame/height/width rotary dims, summing to the head dim (96 / 6)
        axes_lens=[1024, 128, 128],
    ).eval()
    # The pad tokens start at zero; move them (and every weight) so no path is trivially zero.
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _build_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(2)
    return AutoencoderKL(  # four levels: 8x
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 8, 8, 8),
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        layers_per_block=1,
        norm_num_groups=4,
        # The FLUX.1 VAE's latent normalisation, which Z-Image's pipelines apply.
        scaling_factor=0.3611,
        shift_factor=0.1159,
        use_quant_conv=False,
        use_post_quant_conv=False,
    ).eval()


def build_tiny_model(name: str, folder: str | os.PathLike) -> None:
    """Write the complete diffusers folder of tiny model ``name`` into ``folder``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, ZImagePipeline

    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    tokenizer = _build_tokenizer()
    pipe = ZImagePipeline(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=_build_vae(),
        text_encoder=_build_text_encoder(tokenizer),
        tokenizer=tokenizer,
        transformer=_build_transformer(),
    )
    pipe.save_pretrained(folder, safe_serialization=True)


def tiny_model_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """Return the cached folder of tiny model ``name``, building it on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_model, cache_dir)
