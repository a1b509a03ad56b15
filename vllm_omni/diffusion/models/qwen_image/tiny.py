"""Tiny embedded Qwen-Image models: complete diffusers pipeline folders with seeded random weights.

Tests and demos call :func:`tiny_model_path` (or :func:`build_tiny_model`) to get a folder that
``DiffusionPipeline.from_pretrained`` loads exactly like a real Qwen-Image / Qwen-Image-Edit /
Qwen-Image-Edit-2511 checkpoint, without any hub access. Every component is the real class
(``QwenImageTransformer2DModel``, ``AutoencoderKLQwenImage``, ``Qwen2_5_VLForConditionalGeneration``,
``Qwen2Tokenizer``, ``Qwen2VLProcessor``, ``FlowMatchEulerDiscreteScheduler``) with shrunken widths,
depths and vocabulary, while the geometry that callers depend on is kept: 8x VAE compression,
2x2 patches (so 1328x1328 gives 83x83 tokens), 16 latent channels, and a tokenizer that splits the
pipelines' prompt templates into exactly as many tokens as the real Qwen vocabulary does.
"""

from __future__ import annotations

import inspect
import os
import pathlib

import torch

from vllm_omni.diffusion.models.qwen_image.spec import FAMILY
from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model
from vllm_omni.diffusion.models.tiny_qwen_tokenizer import (
    CHAT_TEMPLATE,
    build_qwen2_tokenizer,
    check_prefix_tokens,
    qwen2_5_vl_text_config,
    special_token_ids,
)

TINY_MODELS: dict[str, str] = FAMILY.tiny_models  # name -> diffusers pipeline, declared in spec.py

# Bump when the generated folders change so stale caches are not reused.
_CACHE_VERSION = "v1"

# Text encoder hidden size; also the vision tower's output size and the transformer's joint_attention_dim.
_TEXT_HIDDEN = 64
# Latent channels of the real Qwen-Image VAE (the transformer packs 2x2 patches: 64 inputs).
_LATENT_CHANNELS = 16
_VAE_BASE_DIM = 16


def _pipeline_class(name: str) -> type:
    import diffusers

    return getattr(diffusers, TINY_MODELS[name])


def _prompt_templates() -> dict[str, tuple[str, int]]:
    """Return ``{pipeline class name: (prompt_template_encode, prompt_template_encode_start_idx)}``.

    The values are read from the installed diffusers pipelines (built with no components) so the
    tokenizer is trained on, and checked against, exactly what the pipelines will tokenize.
    """
    import diffusers

    templates = {}
    for class_name in sorted(set(TINY_MODELS.values())):
        cls = getattr(diffusers, class_name)
        params = [p for p in inspect.signature(cls.__init__).parameters if p != "self"]
        pipe = cls(**dict.fromkeys(params))
        templates[class_name] = (pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx)
    return templates


def _build_tokenizer():
    return build_qwen2_tokenizer(template.format("") for template, _ in _prompt_templates().values())


def _check_template_offsets(tokenizer) -> None:
    """Fail the build unless each template's fixed drop index removes exactly the system/user prefix."""
    for class_name, (template, start_idx) in _prompt_templates().items():
        # The real offsets cut right after "<|im_start|>user\n"; everything after it is user content.
        head = template[: template.index("<|im_start|>user\n") + len("<|im_start|>user\n")]
        check_prefix_tokens(tokenizer, head, start_idx, class_name)


def _build_text_encoder(tokenizer):
    """A two-layer Qwen2.5-VL whose hidden size feeds the transformer's ``joint_attention_dim``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = special_token_ids(tokenizer)
    config = Qwen2_5_VLConfig(
        text_config=qwen2_5_vl_text_config(tokenizer, _TEXT_HIDDEN),
        vision_config={
            "depth": 2,
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_heads": 2,
            "in_channels": 3,
            "patch_size": 14,
            "spatial_merge_size": 2,
            "temporal_patch_size": 2,
            "window_size": 112,
            "fullatt_block_indexes": [1],
            "tokens_per_second": 2,
            "out_hidden_size": _TEXT_HIDDEN,
        },
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Qwen2_5_VLForConditionalGeneration(config).to(torch.float32).eval()


def _build_transformer(zero_cond_t: bool):
    from diffusers import QwenImageTransformer2DModel

    torch.manual_seed(0)
    return QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=4 * _LATENT_CHANNELS,  # 2x2 patches of the 16 latent channels
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,
        num_attention_heads=6,
        joint_attention_dim=_TEXT_HIDDEN,
        guidance_embeds=False,
        axes_dims_rope=(4, 6, 6),  # frame/height/width rotary dims, summing to attention_head_dim
        zero_cond_t=zero_cond_t,
    ).eval()


def _build_vae():
    from diffusers import AutoencoderKLQwenImage

    torch.manual_seed(0)
    return AutoencoderKLQwenImage(
        base_dim=_VAE_BASE_DIM,
        z_dim=_LATENT_CHANNELS,
        dim_mult=[1, 2, 2, 2],
        num_res_blocks=1,
        attn_scales=[],
        temperal_downsample=[False, True, True],  # three downsamples: 8x spatial like the real VAE
        dropout=0.0,
    ).eval()


# The released Qwen-Image checkpoints' scheduler/scheduler_config.json: the resolution-dependent shift.
SCHEDULER_CONFIG = dict(
    num_train_timesteps=1000,
    shift=1.0,
    use_dynamic_shifting=True,
    base_shift=0.5,
    max_shift=0.9,
    base_image_seq_len=256,
    max_image_seq_len=8192,
    invert_sigmas=False,
    shift_terminal=0.02,
    use_karras_sigmas=False,
    use_exponential_sigmas=False,
    use_beta_sigmas=False,
    time_shift_type="exponential",
    stochastic_sampling=False,
)


def _build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    return FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)


def _build_processor(tokenizer):
    from transformers import Qwen2VLImageProcessor, Qwen2VLProcessor, Qwen2VLVideoProcessor

    # Qwen2.5-VL's preprocessing settings (CLIP normalization, 14px patches merged 2x2).
    vision = {
        "min_pixels": 56 * 56,
        "max_pixels": 28 * 28 * 16384,
        "patch_size": 14,
        "temporal_patch_size": 2,
        "merge_size": 2,
        "image_mean": [0.48145466, 0.4578275, 0.40821073],
        "image_std": [0.26862954, 0.26130258, 0.27577711],
    }
    return Qwen2VLProcessor(
        image_processor=Qwen2VLImageProcessor(**vision),
        tokenizer=tokenizer,
        video_processor=Qwen2VLVideoProcessor(**vision),
        chat_template=CHAT_TEMPLATE,
    )


def build_tiny_model(name: str, folder: str | os.PathLike) -> None:
    """Write the complete diffusers folder of tiny model ``name`` into ``folder``."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    tokenizer = _build_tokenizer()
    _check_template_offsets(tokenizer)
    components = {
        "scheduler": _build_scheduler(),
        "vae": _build_vae(),
        "text_encoder": _build_text_encoder(tokenizer),
        "tokenizer": tokenizer,
        "transformer": _build_transformer(zero_cond_t=name == "tiny/qwen-image-edit-plus"),
    }
    if name != "tiny/qwen-image":
        components["processor"] = _build_processor(tokenizer)
    pipe = _pipeline_class(name)(**components)
    pipe.save_pretrained(folder, safe_serialization=True)


def tiny_model_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """Return the cached folder of tiny model ``name``, building it on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_model, cache_dir)
