"""Tiny embedded Wan2.2 models: complete diffusers pipeline folders with seeded random weights.

Tests and demos call :func:`tiny_model_path` (or :func:`build_tiny_model`) to get a folder that
``DiffusionPipeline.from_pretrained`` loads like a real Wan2.2 checkpoint, without any hub access:

- ``tiny/wan2.2-t2v``: ``WanPipeline`` shaped like Wan2.2-T2V-A14B, two experts (``transformer``
  for high noise, ``transformer_2`` for low noise, switching at ``boundary_ratio`` 0.875) over the
  Wan2.1 VAE (16 latent channels, 8x spatial and 4x temporal compression).
- ``tiny/wan2.2-i2v``: ``WanImageToVideoPipeline`` shaped like Wan2.2-I2V-A14B: the same two experts
  (boundary 0.9) taking 36 input channels (16 noisy latents, 4 first-frame mask channels, 16 latents
  of the conditioning video), and no CLIP image encoder (``image_dim=None``), as Wan2.2.
- ``tiny/wan2.2-ti2v``: ``WanPipeline`` shaped like Wan2.2-TI2V-5B: one transformer, per-token
  timesteps (``expand_timesteps``) and the Wan2.2 VAE (48 latent channels, 2x2 pixel patches then
  8x downsampling: 16x spatial, 4x temporal compression).

Every component is the real class (``WanTransformer3DModel``, ``AutoencoderKLWan``,
``UMT5EncoderModel`` with a ``T5Tokenizer``, ``UniPCMultistepScheduler``) with small widths and
depths, while the geometry callers depend on is kept: the real VAE compression, 1x2x2 transformer
patches (so 832x480 x 81 frames gives 21x30x52 = 32760 video tokens for A14B, and 1280x704 x 121
frames 31x22x40 = 27280 for 5B), 6 attention heads (so Ulysses degrees 2 and 3 both divide) and
512 text tokens. The tokenizer is a small Unigram model trained offline on English video prompts.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
from collections import Counter

import torch

from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model
from vllm_omni.diffusion.models.wan22.spec import FAMILY

TINY_MODELS: dict[str, str] = FAMILY.tiny_models  # name -> diffusers pipeline, declared in spec.py

# Bump when the generated folders change so stale caches are not reused.
_CACHE_VERSION = "v1"

_TEXT_HIDDEN = 32  # UMT5 d_model: the transformer's text_dim
_TEXT_TOKENS = 512  # the pipelines pad prompts to max_sequence_length=512
_VOCAB_SIZE = 256  # Unigram pieces trained, the three specials included
_A14B_LATENT_CHANNELS = 16  # Wan2.1 VAE, used by the A14B models
_5B_LATENT_CHANNELS = 48  # Wan2.2 VAE, used by TI2V-5B
# Image-to-video input: noisy latents, the first-frame mask (one channel per frame of a 4-frame
# temporal group), and the VAE latents of the conditioning video (image, then zero frames).
_I2V_MASK_CHANNELS = 4
# Expert switch points (fraction of num_train_timesteps) of the released A14B pipelines.
_T2V_BOUNDARY_RATIO, _I2V_BOUNDARY_RATIO = 0.875, 0.9
_FLOW_SHIFT = 3.0

# Prompt-like English for the tokenizer, so user text tokenizes into sensible pieces.
ENGLISH_PROMPTS = """\
A cat walks on the grass, realistic style, soft morning light.
Two anthropomorphic cats in comfy boxing gear fight intensely on a spotlighted stage.
A drone shot flying over a snowy mountain range at sunrise, cinematic, slow camera pan.
Close-up of a young woman smiling in the rain, shallow depth of field, 4k, film grain.
A red sports car drives along a coastal road at sunset, the camera follows from behind.
Waves crash against black rocks while seagulls circle above the stormy ocean.
A golden retriever puppy runs through a field of yellow flowers in slow motion.
Time-lapse of clouds moving over a busy city skyline, lights turning on at dusk.
An astronaut in a white suit floats inside a space station, Earth visible through the window.
A chef slices fresh vegetables on a wooden board in a bright modern kitchen.
A little girl in a blue dress dances under cherry blossom trees as petals fall.
Aerial view of a dense green forest with a winding river, mist rising at dawn.
A panda eats bamboo while sitting in the snow, handheld camera, documentary style.
Neon signs glow on a wet street at night as people walk past with umbrellas.
An old man plays the violin on a bridge, the camera slowly zooms in on his hands.
A steam train crosses a stone viaduct in the mountains, smoke trailing behind it.
Fireworks explode over a lake, their colors reflected in the calm water.
A hummingbird hovers beside a red flower, wings blurred, macro shot, 60 fps.
A knight in shining armor rides a horse across a battlefield, epic wide shot.
Anime style: a boy with spiky hair jumps between rooftops under a full moon.
A cup of coffee on a table by the window, steam rising, rain on the glass.
Surfers ride a huge wave, the camera tracks them from the water, vivid colors.
A robot walks through an abandoned factory, dust floating in beams of light.
Children laugh and splash in a fountain on a hot summer day, static camera.
A campfire crackles in the dark woods, sparks drifting up toward the stars.
The ballerina spins on stage in a white tutu, spotlight, dramatic shadows.
A jellyfish pulses slowly through deep blue water, bioluminescent glow.
Horses gallop across an open plain, dust clouds behind them, golden hour.
A butterfly lands on a child's finger, then flies away, close-up, bokeh.
Snow falls gently on a quiet village street with warm lights in the windows.
A skateboarder performs a kickflip in an empty parking lot, fisheye lens.
Lava flows down the side of a volcano at night, glowing orange and red.
Bright, high quality, detailed, smooth motion; low quality, blurry, distorted, static, worst quality.
"""


def _pipeline_class(name: str) -> type:
    import diffusers

    return getattr(diffusers, TINY_MODELS[name])


def _build_tokenizer():
    """A ``T5Tokenizer`` over a Unigram vocabulary trained offline; ids 0/1/2 are <pad>, </s>, <unk>."""
    from tokenizers import Tokenizer, pre_tokenizers, trainers
    from tokenizers.models import Unigram
    from transformers import T5Tokenizer

    specials = ["<pad>", "</s>", "<unk>"]
    lines = ENGLISH_PROMPTS.splitlines()
    unigram = Tokenizer(Unigram())
    # The pre-tokenizer T5Tokenizer uses, so training sees the same word pieces.
    unigram.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.WhitespaceSplit(),
            pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always", split=True),
        ]
    )
    trainer = trainers.UnigramTrainer(
        vocab_size=_VOCAB_SIZE, special_tokens=specials, unk_token="<unk>", show_progress=False
    )
    unigram.train_from_iterator(lines, trainer=trainer)
    # The trainer picks the same pieces every run, but its scores (and so the piece order, i.e.
    # the ids) vary slightly from run to run. Score each piece by how often it occurs in the
    # corpus words instead, so that every build writes the same tokenizer (and the seeded text
    # encoder sees the same ids); this splits the corpus into about as many tokens as the trained scores.
    pieces = [piece for piece, _ in json.loads(unigram.to_str())["model"]["vocab"] if piece not in specials]
    words = Counter("▁" + word for line in lines for word in line.split())
    counts = {piece: max(1, sum(n * word.count(piece) for word, n in words.items())) for piece in pieces}
    total = sum(counts.values())
    vocab = [(piece, 0.0) for piece in specials]
    vocab += [(piece, math.log(counts[piece] / total)) for piece in sorted(pieces, key=lambda p: (-counts[p], p))]
    # T5Tokenizer builds its own Unigram from the (piece, score) list, in id order (unk_id 2, no
    # byte fallback: characters outside the corpus become <unk>).
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=_TEXT_TOKENS)


def _build_text_encoder(tokenizer):
    from transformers import UMT5Config, UMT5EncoderModel

    torch.manual_seed(0)
    config = UMT5Config(
        # Like the real model, the embedding table is padded past the tokenizer's length.
        vocab_size=-(-len(tokenizer) // 64) * 64,
        d_model=_TEXT_HIDDEN,
        d_kv=8,
        d_ff=64,
        num_layers=2,
        num_decoder_layers=0,
        num_heads=4,
        relative_attention_num_buckets=32,
        feed_forward_proj="gated-gelu",
        is_encoder_decoder=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    return UMT5EncoderModel(config).eval()


def _build_transformer(in_channels: int, out_channels: int, seed: int):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=6,
        attention_head_dim=16,  # rotary split: 8 frame, 4 height, 4 width dims
        in_channels=in_channels,
        out_channels=out_channels,
        text_dim=_TEXT_HIDDEN,
        freq_dim=256,
        ffn_dim=128,
        num_layers=2,
        cross_attn_norm=True,
        qk_norm="rms_norm_across_heads",
        eps=1e-6,
        image_dim=None,  # Wan2.2 has no CLIP image tokens
        rope_max_seq_len=1024,
    ).eval()


def _build_vae(wan22: bool):
    from diffusers import AutoencoderKLWan

    torch.manual_seed(0)
    # Four levels, three spatial downsamples (8x), the last two also temporal (4x).
    common = {"base_dim": 8, "dim_mult": [1, 1, 1, 1], "num_res_blocks": 1, "temperal_downsample": [False, True, True]}
    if not wan22:
        # The Wan2.1 VAE: the class defaults are its 16 real latents_mean / latents_std values.
        return AutoencoderKLWan(z_dim=_A14B_LATENT_CHANNELS, **common).eval()
    return AutoencoderKLWan(
        decoder_base_dim=8,
        z_dim=_5B_LATENT_CHANNELS,
        is_residual=True,
        # 2x2 pixel patches (3 x 4 = 12 channels) before the 8x downsampling: 16x in all.
        in_channels=12,
        out_channels=12,
        patch_size=2,
        scale_factor_spatial=16,
        scale_factor_temporal=4,
        latents_mean=[0.0] * _5B_LATENT_CHANNELS,
        latents_std=[1.0] * _5B_LATENT_CHANNELS,
        **common,
    ).eval()


def build_tiny_model(name: str, folder: str | os.PathLike) -> None:
    """Write the complete diffusers folder of tiny model ``name`` into ``folder``."""
    from diffusers import UniPCMultistepScheduler

    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    tokenizer = _build_tokenizer()
    components = {
        "tokenizer": tokenizer,
        "text_encoder": _build_text_encoder(tokenizer),
        "scheduler": UniPCMultistepScheduler(
            prediction_type="flow_prediction", use_flow_sigmas=True, flow_shift=_FLOW_SHIFT
        ),
    }
    if name == "tiny/wan2.2-ti2v":
        # TI2V-5B: one transformer over the Wan2.2 VAE, per-token timesteps.
        components |= {
            "vae": _build_vae(wan22=True),
            "transformer": _build_transformer(_5B_LATENT_CHANNELS, _5B_LATENT_CHANNELS, seed=0),
            "transformer_2": None,
            "boundary_ratio": None,
            "expand_timesteps": True,
        }
    else:
        # A14B: high-noise and low-noise experts of one shape, seeded apart so they differ.
        image_to_video = name == "tiny/wan2.2-i2v"
        in_channels = _A14B_LATENT_CHANNELS
        if image_to_video:
            in_channels += _I2V_MASK_CHANNELS + _A14B_LATENT_CHANNELS
        components |= {
            "vae": _build_vae(wan22=False),
            "transformer": _build_transformer(in_channels, _A14B_LATENT_CHANNELS, seed=0),
            "transformer_2": _build_transformer(in_channels, _A14B_LATENT_CHANNELS, seed=1),
            "boundary_ratio": _I2V_BOUNDARY_RATIO if image_to_video else _T2V_BOUNDARY_RATIO,
        }
        if image_to_video:
            components |= {"image_processor": None, "image_encoder": None}
    _pipeline_class(name)(**components).save_pretrained(folder, safe_serialization=True)


def tiny_model_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """Return the cached folder of tiny model ``name``, building it on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_model, cache_dir)
