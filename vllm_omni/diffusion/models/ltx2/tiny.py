"""Tiny embedded LTX-2 models: complete diffusers pipeline folders with seeded random weights.

Tests and demos call :func:`tiny_model_path` (or :func:`build_tiny_model`) to get a folder that
``DiffusionPipeline.from_pretrained`` loads like the LTX-2 (2.0) checkpoint, without any hub access:
``tiny/ltx-2`` as ``LTX2Pipeline`` (text-to-video; a request with an image runs image-to-video on the same
components) and ``tiny/ltx-2-i2v`` as ``LTX2ImageToVideoPipeline``. Every component is the real class
(``LTX2VideoTransformer3DModel``, ``AutoencoderKLLTX2Video``, ``AutoencoderKLLTX2Audio``, ``LTX2Vocoder``,
``LTX2TextConnectors``, ``Gemma3ForConditionalGeneration`` with a ``GemmaTokenizer``,
``FlowMatchEulerDiscreteScheduler``) with small widths and depths, while the geometry callers depend on is
kept: the video VAE's 32x spatial and 8x temporal compression (4x4 pixel patches, then three downsamples), the
audio path's 16 kHz mel spectrogram (64 bins, hop 160, 4x compression in time and frequency: 25 audio tokens a
second) and the vocoder's 240x upsampling to 24 kHz stereo, 1x1x1 transformer patches (768x512 x 121 frames is
24 x 16 x 16 = 6144 video tokens and 126 audio tokens), 6 attention heads in both streams (Ulysses 2 and 3
divide them), 1024 prompt tokens and 128 connector registers. The tokenizer is a small BPE trained offline.
"""

from __future__ import annotations

import json
import os
import pathlib

import torch

from vllm_omni.diffusion.models.ltx2.spec import FAMILY
from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model
from vllm_omni.diffusion.models.tiny_qwen_tokenizer import ENGLISH_TEXT

TINY_MODELS: dict[str, str] = FAMILY.tiny_models  # name -> diffusers pipeline, declared in spec.py

# Bump when the generated folders change so stale caches are not reused.
_CACHE_VERSION = "v1"

_TEXT_HIDDEN = 32  # Gemma hidden size: the connectors' and the transformer's caption_channels
_TEXT_LAYERS = 2  # the pipeline stacks every hidden state: 3 of them (text_proj_in_factor)
_BPE_VOCAB_SIZE = 512  # trained pieces, after the specials and the 256 byte-fallback tokens
_SPECIALS = ("<pad>", "<eos>", "<bos>", "<unk>", "<mask>")  # GemmaTokenizer's ids 0-4
_LATENT_CHANNELS = 8  # the video VAE's latents (the real one has 128): the transformer's in_channels
# The real mel spectrogram (64 bins) with 2 latent channels (the real VAE has 8): 2 x 64 / 4 = 32 audio channels a
# token. The audio VAE normalizes them by a buffer of base_channels values, so its base_channels is that number.
_AUDIO_LATENT_CHANNELS, _MEL_BINS = 2, 64
_AUDIO_CHANNELS = _AUDIO_LATENT_CHANNELS * _MEL_BINS // 4
_HEADS, _HEAD_DIM, _AUDIO_HEAD_DIM = 6, 8, 4


def _pipeline_class(name: str) -> type:
    import diffusers

    return getattr(diffusers, TINY_MODELS[name])


def _build_tokenizer():
    """A ``GemmaTokenizer`` (BPE with byte fallback, spaces as "▁") over a vocabulary trained offline."""
    from tokenizers import Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import GemmaTokenizer

    bpe = Tokenizer(BPE())
    # GemmaTokenizer's own normalizer and pre-tokenizer, so training sees its word pieces.
    bpe.normalizer = normalizers.Replace(" ", "▁")
    bpe.pre_tokenizer = pre_tokenizers.Split(pattern="▁", behavior="merged_with_previous", invert=False)
    trainer = trainers.BpeTrainer(vocab_size=_BPE_VOCAB_SIZE, min_frequency=1, show_progress=False)
    bpe.train_from_iterator(ENGLISH_TEXT.splitlines(), trainer=trainer)
    model = json.loads(bpe.to_str())["model"]
    vocab = {token: i for i, token in enumerate(_SPECIALS)}
    for byte in range(256):  # byte fallback: any character outside the corpus
        vocab[f"<0x{byte:02X}>"] = len(vocab)
    for piece, _ in sorted(model["vocab"].items(), key=lambda item: item[1]):
        vocab.setdefault(piece, len(vocab))
    merges = [tuple(pair) if isinstance(pair, list) else tuple(pair.split(" ")) for pair in model["merges"]]
    return GemmaTokenizer(
        vocab=vocab, merges=merges, add_bos_token=True, model_max_length=1024
    )  # <bos> first, as Gemma


def _build_text_encoder(tokenizer):
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    torch.manual_seed(0)
    text = dict(
        vocab_size=len(tokenizer),
        hidden_size=_TEXT_HIDDEN,
        intermediate_size=64,
        num_hidden_layers=_TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        max_position_embeddings=2048,
        sliding_window=512,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # A vision tower the text path never runs (Gemma 3 is an image-text model); token ids past the vocabulary.
    vision = dict(
        hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28, patch_size=14
    )
    n = len(tokenizer)
    config = Gemma3Config(
        text_config=text,
        vision_config=vision,
        mm_tokens_per_image=4,
        boi_token_index=n,
        eoi_token_index=n + 1,
        image_token_index=n + 2,
    )
    return Gemma3ForConditionalGeneration(config).eval()


def _build_connectors():
    from diffusers.pipelines.ltx2 import LTX2TextConnectors

    torch.manual_seed(0)
    heads, head_dim = 2, _TEXT_HIDDEN // 2  # the connectors run at the text width (caption_channels)
    return LTX2TextConnectors(
        caption_channels=_TEXT_HIDDEN,
        text_proj_in_factor=_TEXT_LAYERS + 1,
        video_connector_num_attention_heads=heads,
        video_connector_attention_head_dim=head_dim,
        video_connector_num_layers=1,
        video_connector_num_learnable_registers=128,
        audio_connector_num_attention_heads=heads,
        audio_connector_attention_head_dim=head_dim,
        audio_connector_num_layers=1,
        audio_connector_num_learnable_registers=128,
        rope_type="split",
    ).eval()


def _build_transformer():
    from diffusers import LTX2VideoTransformer3DModel

    torch.manual_seed(0)
    return LTX2VideoTransformer3DModel(
        in_channels=_LATENT_CHANNELS,
        out_channels=_LATENT_CHANNELS,
        num_attention_heads=_HEADS,
        attention_head_dim=_HEAD_DIM,
        cross_attention_dim=_HEADS * _HEAD_DIM,
        audio_in_channels=_AUDIO_CHANNELS,
        audio_out_channels=_AUDIO_CHANNELS,
        audio_num_attention_heads=_HEADS,
        audio_attention_head_dim=_AUDIO_HEAD_DIM,
        audio_cross_attention_dim=_HEADS * _AUDIO_HEAD_DIM,
        num_layers=2,
        caption_channels=_TEXT_HIDDEN,
        rope_type="split",  # LTX-2.0's
    ).eval()


def _build_vae():
    from diffusers import AutoencoderKLLTX2Video

    torch.manual_seed(0)
    # The real layout (4x4 pixel patches; downsamples spatial, temporal, then two spatiotemporal: 32x and 8x),
    # at a few channels and one layer a block.
    return AutoencoderKLLTX2Video(
        latent_channels=_LATENT_CHANNELS,
        block_out_channels=(8, 8, 8, 8),
        decoder_block_out_channels=(8, 16, 32),  # each upsample halves the channels, as (256, 512, 1024)
        layers_per_block=(1, 1, 1, 1, 1),
        decoder_layers_per_block=(1, 1, 1, 1),
        decoder_causal=False,
        spatial_compression_ratio=32,  # as the released config states them (the class would count 64 and 16)
        temporal_compression_ratio=8,
    ).eval()


def _build_audio_vae():
    from diffusers import AutoencoderKLLTX2Audio

    torch.manual_seed(0)
    return AutoencoderKLLTX2Audio(
        base_channels=_AUDIO_CHANNELS,
        output_channels=2,
        ch_mult=(1, 2, 4),  # 4x in time and in mel bins, as the real one
        num_res_blocks=1,
        attn_resolutions=None,
        in_channels=2,
        resolution=256,
        latent_channels=_AUDIO_LATENT_CHANNELS,
        norm_type="pixel",
        causality_axis="height",
        mid_block_add_attention=False,
        sample_rate=16000,
        mel_hop_length=160,
        is_causal=True,
        mel_bins=_MEL_BINS,
    ).eval()


def _build_vocoder():
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder

    torch.manual_seed(0)
    return LTX2Vocoder(
        in_channels=2 * _MEL_BINS,  # stereo mel spectrogram
        hidden_channels=64,
        out_channels=2,
        upsample_kernel_sizes=[16, 15, 8, 4, 4],
        upsample_factors=[6, 5, 2, 2, 2],  # 240x: 100 mel frames a second to 24 kHz, as the real one
        resnet_kernel_sizes=[3],
        resnet_dilations=[[1, 3, 5]],
        output_sampling_rate=24000,
    ).eval()


def build_tiny_model(name: str, folder: str | os.PathLike) -> None:
    """Write the complete diffusers folder of tiny model ``name`` into ``folder``."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    tokenizer = _build_tokenizer()
    components = {
        "tokenizer": tokenizer,
        "text_encoder": _build_text_encoder(tokenizer),
        "connectors": _build_connectors(),
        "transformer": _build_transformer(),
        "vae": _build_vae(),
        "audio_vae": _build_audio_vae(),
        "vocoder": _build_vocoder(),
        # The released (not distilled) checkpoint's scheduler.
        "scheduler": FlowMatchEulerDiscreteScheduler(
            use_dynamic_shifting=True,
            base_shift=0.95,
            max_shift=2.05,
            base_image_seq_len=1024,
            max_image_seq_len=4096,
            shift_terminal=0.1,
        ),
        "processor": None,
        "prompt_enhancer": None,
        "duration_head": None,
    }
    _pipeline_class(name)(**components).save_pretrained(folder, safe_serialization=True)


def tiny_model_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """Return the cached folder of tiny model ``name``, building it on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_model, cache_dir)
