"""Tiny embedded HunyuanVideo 1.5 models: complete diffusers pipeline folders with seeded random weights.

Tests and demos call :func:`tiny_model_path` (or :func:`build_tiny_model`) to get a folder that
``DiffusionPipeline.from_pretrained`` loads like a real HunyuanVideo 1.5 480p checkpoint
(text-to-video, or image-to-video), without any hub access. Every component is the real class
(``HunyuanVideo15Transformer3DModel``, ``AutoencoderKLHunyuanVideo15``, ``Qwen2_5_VLTextModel`` with
a ``Qwen2Tokenizer``, ``T5EncoderModel`` with a ``ByT5Tokenizer`` for glyphs, ``SiglipVisionModel``
for the input image, ``FlowMatchEulerDiscreteScheduler``, ``ClassifierFreeGuidance``) with small
widths and depths, while the geometry callers depend on is kept: 16x spatial and 4x temporal VAE
compression with 1x1x1 patches (so 848x480 x 121 frames gives 31x30x53 = 49290 video tokens), 729
image tokens, and a tokenizer whose split of the prompt template matches the pipeline's crop (108).
"""

from __future__ import annotations

import inspect
import os
import pathlib

import torch

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.models.hunyuan_video_15.spec import FAMILY
from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model
from vllm_omni.diffusion.models.tiny_qwen_tokenizer import (
    CHAT_TEMPLATE,
    build_qwen2_tokenizer,
    check_prefix_tokens,
    qwen2_5_vl_text_config,
)

TINY_MODELS: dict[str, str] = FAMILY.tiny_models  # name -> diffusers pipeline, declared in spec.py

# Bump when the generated folders change so stale caches are not reused.
_CACHE_VERSION = "v1"

_TEXT_HIDDEN = 64  # Qwen2.5-VL hidden size: the transformer's text_embed_dim
_GLYPH_HIDDEN = 32  # ByT5 d_model: text_embed_2_dim
_IMAGE_HIDDEN = 32  # SigLIP hidden size: image_embed_dim
_LATENT_CHANNELS = 8  # the real VAE has 32; the transformer takes 2 x latent + 1 channels
_SIGLIP_SIZE, _SIGLIP_PATCH = 384, 14  # 27 x 27 = 729 image tokens, as the real SigLIP
# Pixel area the pipelines size videos for. Text-to-video: 640, the real 480p value (default size
# 848x480). Image-to-video takes no size (the input image's aspect ratio at this area): kept small
# so that CPU tests stay fast.
_T2V_TARGET_SIZE, _I2V_TARGET_SIZE = 640, 160
# Assumed values of the released 480p checkpoints' scheduler and guider configs.
_FLOW_SHIFT = 5.0
_GUIDANCE_SCALE = 6.0


def _pipeline_class(name: str) -> type:
    import diffusers

    return getattr(diffusers, TINY_MODELS[name])


def _prompt_template() -> tuple[str, int]:
    """The Qwen2.5-VL prompt as the pipeline renders it for an empty prompt, and its crop (tokens dropped)."""
    from diffusers import HunyuanVideo15Pipeline

    template = diffusers_compat.unbound_method(HunyuanVideo15Pipeline, "get_mllm_prompt_embeds")
    defaults = inspect.signature(template).parameters
    system, crop = defaults["system_message"].default, defaults["crop_start"].default
    return f"<|im_start|>system\n{system}<|im_end|>\n<|im_start|>user\n", crop


def _build_tokenizer():
    prefix, crop = _prompt_template()
    tokenizer = build_qwen2_tokenizer([prefix + " <|im_end|>\n<|im_start|>assistant\n"])
    tokenizer.chat_template = CHAT_TEMPLATE  # the pipeline calls tokenizer.apply_chat_template
    check_prefix_tokens(tokenizer, prefix, crop, "HunyuanVideo15Pipeline")
    return tokenizer


def _build_text_encoder(tokenizer):
    """Two layers: the pipeline reads hidden_states[-3]."""
    from transformers import Qwen2_5_VLTextConfig, Qwen2_5_VLTextModel

    torch.manual_seed(0)
    return Qwen2_5_VLTextModel(Qwen2_5_VLTextConfig(**qwen2_5_vl_text_config(tokenizer, _TEXT_HIDDEN))).eval()


def _build_glyph_encoder():
    from transformers import ByT5Tokenizer, T5Config, T5EncoderModel

    tokenizer = ByT5Tokenizer()
    torch.manual_seed(0)
    config = T5Config(
        vocab_size=len(tokenizer),  # 256 bytes, 3 specials, 125 extra ids, as ByT5
        d_model=_GLYPH_HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=1,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        use_cache=False,
    )
    return tokenizer, T5EncoderModel(config).eval()


def _build_image_encoder():
    from transformers import SiglipImageProcessor, SiglipVisionConfig, SiglipVisionModel

    torch.manual_seed(0)
    config = SiglipVisionConfig(
        hidden_size=_IMAGE_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        image_size=_SIGLIP_SIZE,
        patch_size=_SIGLIP_PATCH,
    )
    processor = SiglipImageProcessor(size={"height": _SIGLIP_SIZE, "width": _SIGLIP_SIZE})
    return processor, SiglipVisionModel(config).eval()


def _build_transformer(task_type: str, target_size: int):
    from diffusers import HunyuanVideo15Transformer3DModel

    torch.manual_seed(0)
    return HunyuanVideo15Transformer3DModel(
        in_channels=2 * _LATENT_CHANNELS + 1,  # noisy latents, condition latents, condition mask
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=6,
        attention_head_dim=16,
        num_layers=2,
        num_refiner_layers=2,
        patch_size=1,
        patch_size_t=1,
        text_embed_dim=_TEXT_HIDDEN,
        text_embed_2_dim=_GLYPH_HIDDEN,
        image_embed_dim=_IMAGE_HIDDEN,
        rope_axes_dim=(4, 6, 6),  # frame/height/width rotary dims, summing to attention_head_dim
        target_size=target_size,
        task_type=task_type,
    ).eval()


def _build_vae():
    from diffusers import AutoencoderKLHunyuanVideo15

    torch.manual_seed(0)
    return AutoencoderKLHunyuanVideo15(
        latent_channels=_LATENT_CHANNELS,
        # Five blocks: four spatial downsamples, two of them temporal. Few channels at full
        # resolution, where CPU conv3d is slowest.
        block_out_channels=(4, 8, 8, 16, 16),
        layers_per_block=1,
        spatial_compression_ratio=16,
        temporal_compression_ratio=4,
    ).eval()


def build_tiny_model(name: str, folder: str | os.PathLike) -> None:
    """Write the complete diffusers folder of tiny model ``name`` into ``folder``."""
    from diffusers import ClassifierFreeGuidance, FlowMatchEulerDiscreteScheduler

    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    image_to_video = name.endswith("-i2v")
    tokenizer = _build_tokenizer()
    tokenizer_2, text_encoder_2 = _build_glyph_encoder()
    components = {
        "text_encoder": _build_text_encoder(tokenizer),
        "tokenizer": tokenizer,
        "transformer": _build_transformer(
            "i2v" if image_to_video else "t2v", _I2V_TARGET_SIZE if image_to_video else _T2V_TARGET_SIZE
        ),
        "vae": _build_vae(),
        "scheduler": FlowMatchEulerDiscreteScheduler(shift=_FLOW_SHIFT),
        "text_encoder_2": text_encoder_2,
        "tokenizer_2": tokenizer_2,
        "guider": ClassifierFreeGuidance(guidance_scale=_GUIDANCE_SCALE),
    }
    if image_to_video:
        components["feature_extractor"], components["image_encoder"] = _build_image_encoder()
    _pipeline_class(name)(**components).save_pretrained(folder, safe_serialization=True)


def tiny_model_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """Return the cached folder of tiny model ``name``, building it on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_model, cache_dir)
