"""Tiny embedded GLM-Image model: a complete diffusers pipeline folder with seeded random weights.

``tiny/glm-image`` is a ``GlmImagePipeline`` folder that ``from_pretrained`` loads like
zai-org/GLM-Image, without hub access, built from the real classes: the autoregressive (AR)
``GlmImageForConditionalGeneration`` with its ``GlmImageProcessor`` (a byte-level BPE tokenizer
whose special tokens come first, as the real one's do), the ByT5 glyph encoder
(``T5EncoderModel`` with ``ByT5Tokenizer``), ``GlmImageTransformer2DModel``, an ``AutoencoderKL``
and ``FlowMatchEulerDiscreteScheduler``. Widths and depths are small; the geometry is kept: the
VAE's 8x and the DiT's 2x2 patches (16 px per image token), the AR's 32 px grid, 6 DiT heads (so
Ulysses 2 and 3 both divide). The AR samples from a vision vocabulary of 128 ids, below its
image-end (eos) id, so it always generates the full token count (a short sequence would break the
pipeline's upsampling).
"""

from __future__ import annotations

import os
import pathlib

import torch

from vllm_omni.diffusion.models.glm_image.spec import FAMILY
from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model

TINY_MODELS: dict[str, str] = FAMILY.tiny_models  # name -> diffusers pipeline, declared in spec.py

# Bump when the generated folder changes so stale caches are not reused.
_CACHE_VERSION = "v2"

_VISION_VOCAB = 128  # AR output ids (and the DiT's prior codebook); the real model has 16512 (16384 codebook)
_GLYPH_HIDDEN = 32  # ByT5 d_model: the DiT's text_embed_dim (real: 1472)
_LATENT_CHANNELS = 16
# The AR tokenizer's special tokens after the V vision ids, named as in the real vocabulary: image
# start (also the generation's bos), image end (its eos), the image placeholder, the grid brackets, pad.
_IMAGE_START, _IMAGE_END = "<|dit_token_16384|>", "<|dit_token_16385|>"
_SPECIALS = [_IMAGE_START, _IMAGE_END, "<|image|>", "<sop>", "<eop>", "<|endoftext|>"]
# Text passes through; an image becomes <image start><|image|><image end> (image-to-image).
_CHAT_TEMPLATE = (
    "{%- for m in messages -%}{%- if m.content is string -%}{{ m.content }}{%- else -%}"
    "{%- for item in m.content -%}{%- if item.type == 'image' -%}"
    "<|dit_token_16384|><|image|><|dit_token_16385|>"
    "{%- elif item.type == 'text' -%}{{ item.text }}{%- endif -%}{%- endfor -%}{%- endif -%}{%- endfor -%}"
)
_CORPUS = """\
A poster with the title 'OPEN' in bold red letters on a white wall.
A cat sitting on a wooden table next to a cup of coffee, soft morning light.
A neon sign that says "Hello World" above a shop door at night, rain on the street.
A watercolor painting of mountains and a lake at sunrise, calm and misty.
A recipe card titled 'Raspberry Mousse Cake' with a list of ingredients and four steps.
A red kite flying over a sandy beach, blue sky, a few white clouds.
A minimalist logo of a paper boat, flat design, two colours.
Portrait of an astronaut riding a horse on mars, cinematic, detailed, 4k.
"""


def build_ar_tokenizer(vision_vocab: int = _VISION_VOCAB):
    """The AR tokenizer: `<|dit_token_i|>` for the vision ids 0..V-1, then the specials (image start = V,
    image end = V + 1, ...), then a byte-level BPE. benchmarks/glm_image.py builds it with the real V."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import TokenizersBackend

    specials = [f"<|dit_token_{i}|>" for i in range(vision_vocab)] + _SPECIALS
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=len(specials) + 256 + 96,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_CORPUS.splitlines(), trainer=trainer)
    return TokenizersBackend(
        tokenizer_object=bpe,
        bos_token=_IMAGE_START,
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        padding_side="left",
        extra_special_tokens={"image_token": "<|image|>", "grid_bos_token": "<sop>", "grid_eos_token": "<eop>"},
    )


def _build_ar(tokenizer):
    from transformers import GenerationConfig, GlmImageConfig, GlmImageForConditionalGeneration

    ids = tokenizer.convert_tokens_to_ids
    pad, image_end = ids("<|endoftext|>"), ids(_IMAGE_END)
    torch.manual_seed(0)
    config = GlmImageConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=2,
            num_key_value_heads=1,
            max_position_embeddings=4096,
            vision_vocab_size=_VISION_VOCAB,
            # M-RoPE sections sum to half the rotary dims (head_dim 16, partial rotary 0.5 in the real model).
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [4, 2, 2]},
            pad_token_id=pad,
            eos_token_id=image_end,
        ),
        vision_config=dict(depth=1, hidden_size=32, num_heads=2, image_size=64, patch_size=16, intermediate_size=64),
        vq_config=dict(embed_dim=32, num_embeddings=_VISION_VOCAB, latent_channels=32),
        image_token_id=ids("<|image|>"),
        image_start_token_id=ids(_IMAGE_START),
        image_end_token_id=image_end,
    )
    model = GlmImageForConditionalGeneration(config).eval()
    # The real checkpoint samples (temperature 0.9, top-p 0.75); the pipeline passes do_sample=True.
    model.generation_config = GenerationConfig(
        pad_token_id=pad, eos_token_id=image_end, temperature=0.9, top_p=0.75, do_sample=True
    )
    return model


def build_ar_processor(tokenizer):
    """The pipeline's `processor`: GLM-Image's image processor, `tokenizer` and a pass-through chat template.

    The image processor cuts a source into the AR vision encoder's 16-pixel patches, one frame, no merge,
    at half the source's size: one AR token per 32 pixels of the source, which the pipeline upsamples to
    one per DiT token. Its pixel bounds keep small sources at that scale."""
    from transformers import GlmImageImageProcessor, GlmImageProcessor

    image_processor = GlmImageImageProcessor(
        patch_size=16, temporal_patch_size=1, merge_size=1, size={"shortest_edge": 32 * 32, "longest_edge": 2048 * 2048}
    )
    return GlmImageProcessor(image_processor=image_processor, tokenizer=tokenizer, chat_template=_CHAT_TEMPLATE)


def _build_glyph_encoder():
    from transformers import T5Config, T5EncoderModel

    torch.manual_seed(1)
    config = T5Config(
        vocab_size=384,  # ByT5: 3 specials, 256 bytes, 125 extra ids
        d_model=_GLYPH_HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_heads=4,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=0,
        eos_token_id=1,
    )
    return T5EncoderModel(config).eval()


def _build_transformer():
    from diffusers import GlmImageTransformer2DModel

    torch.manual_seed(2)
    return GlmImageTransformer2DModel(
        patch_size=2,
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_layers=2,
        attention_head_dim=16,  # 2D rotary: 8 dims for rows, 8 for columns
        num_attention_heads=6,
        text_embed_dim=_GLYPH_HIDDEN,
        time_embed_dim=32,
        condition_dim=16,
        prior_vq_quantizer_codebook_size=_VISION_VOCAB,  # at least the AR's vision vocabulary
    ).eval()


def _build_vae():
    from diffusers import AutoencoderKL

    torch.manual_seed(3)
    return AutoencoderKL(  # four levels: 8x
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 8, 8, 8),
        down_block_types=["DownEncoderBlock2D"] * 4,
        up_block_types=["UpDecoderBlock2D"] * 4,
        layers_per_block=1,
        norm_num_groups=4,
        latents_mean=[0.0] * _LATENT_CHANNELS,
        latents_std=[1.0] * _LATENT_CHANNELS,
    ).eval()


def build_tiny_model(name: str, folder: str | os.PathLike) -> None:
    """Write the complete diffusers folder of tiny model ``name`` into ``folder``."""
    from diffusers import FlowMatchEulerDiscreteScheduler, GlmImagePipeline
    from transformers import ByT5Tokenizer

    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    ar_tokenizer = build_ar_tokenizer()
    GlmImagePipeline(
        tokenizer=ByT5Tokenizer(),
        processor=build_ar_processor(ar_tokenizer),
        text_encoder=_build_glyph_encoder(),
        vision_language_encoder=_build_ar(ar_tokenizer),
        vae=_build_vae(),
        transformer=_build_transformer(),
        # The pipeline passes its own mu (image-size shift) at every call.
        scheduler=FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True, base_shift=0.25, max_shift=0.75, base_image_seq_len=256, time_shift_type="linear"
        ),
    ).save_pretrained(folder, safe_serialization=True)


def tiny_model_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """Return the cached folder of tiny model ``name``, building it on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_model, cache_dir)
