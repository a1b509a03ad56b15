"""Tiny embedded FLUX.2 models: complete diffusers folders with seeded random weights.

Tests and demos call :func:`tiny_model_path` (or :func:`build_tiny_model`) to get a folder that
``Flux2Pipeline.from_pretrained`` loads exactly like FLUX.2-dev, without any hub access. Every
component is the real class (``Flux2Transformer2DModel``, ``AutoencoderKLFlux2``,
``Mistral3ForConditionalGeneration``, ``PixtralProcessor`` around a byte-level BPE tokenizer
trained here, ``FlowMatchEulerDiscreteScheduler``) with shrunken widths, depths and vocabulary,
while the geometry that callers depend on is kept: 8x VAE compression and 2x2 latent patches
(one token per 16x16 pixels, so 1328x1328 gives 6889 image tokens), 512 text tokens, and
prompt embeddings stacked from the text encoder's layers 10, 20 and 30.

``tiny/flux2-klein`` (``Flux2KleinPipeline``, step-distilled like FLUX.2-klein-4B: ``is_distilled``)
and ``tiny/flux2-klein-kv`` (``Flux2KleinKVPipeline``, the same weights) are FLUX.2 klein: the same
transformer class without guidance embedding, a ``Qwen3ForCausalLM`` text encoder whose layers 9,
18 and 27 are stacked, and a Qwen2 tokenizer with Qwen3's chat template (thinking switched off).
"""

from __future__ import annotations

import os
import pathlib

import torch

from vllm_omni.diffusion.models.flux2.spec import FAMILY
from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model

TINY_MODELS: dict[str, str] = FAMILY.tiny_models  # name -> diffusers pipeline, declared in spec.py

# Bump when the generated folder changes so stale caches are not reused.
_CACHE_VERSION = "v1"

# Text encoder width; the pipeline stacks three of its layers, so the transformer reads 3x this.
_TEXT_HIDDEN = 16
# The pipeline reads hidden states 10, 20 and 30 (`text_encoder_out_layers`): 30 layers at least.
_TEXT_LAYERS = 30
_LATENT_CHANNELS = 8
_VAE_PATCH = (2, 2)
# klein's Qwen3 text encoder: the pipeline stacks hidden states 9, 18 and 27 (28 layers at least).
_KLEIN_TEXT_HIDDEN = 16
_KLEIN_TEXT_LAYERS = 28

# Qwen3's chat layout as the klein pipelines render it (add_generation_prompt, enable_thinking=False).
_QWEN3_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
    "{% endif %}"
)

# Mistral's control tokens, with the ids they have in the real (tekken) vocabulary; Mistral3's
# default image_token_index (10) is [IMG]'s id. The trained BPE vocabulary follows them.
_SPECIAL_TOKENS = [
    "<unk>",
    "<s>",
    "</s>",
    "[INST]",
    "[/INST]",
    "[AVAILABLE_TOOLS]",
    "[/AVAILABLE_TOOLS]",
    "[TOOL_RESULTS]",
    "[/TOOL_RESULTS]",
    "[TOOL_CALLS]",
    "[IMG]",
    "<pad>",
    "[IMG_BREAK]",
    "[IMG_END]",
    "[PREFIX]",
    "[MIDDLE]",
    "[SUFFIX]",
    "[SYSTEM_PROMPT]",
    "[/SYSTEM_PROMPT]",
    "[TOOL_CONTENT]",
]

# Mistral's instruct layout: system prompt, then user turns in [INST] blocks; images are [IMG]
# placeholders that the processor expands to the image's patch grid.
_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% if message['role'] == 'system' %}[SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[INST]{% endif %}"
    "{% for part in parts %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}{% elif part['type'] == 'image' %}[IMG]{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'system' %}[/SYSTEM_PROMPT]"
    "{% elif message['role'] == 'user' %}[/INST]"
    "{% else %}{{ eos_token }}{% endif %}"
    "{% endfor %}"
)

_BPE_VOCAB_SIZE = 2048

# Ordinary English (prompts) so user text tokenizes into sensible pieces.
_ENGLISH_TEXT = """\
A photograph of a small red fox sitting in fresh snow at sunrise, soft golden light.
An old wooden boat resting on a quiet lake, mountains and pine trees in the distance.
A cozy kitchen with a blue kettle on the stove and bread cooling on the table.
Close-up portrait of an elderly man with a grey beard, wearing a knitted wool hat.
A busy city street at night, neon signs reflected in puddles after the rain.
A watercolor painting of a lighthouse on a rocky cliff above stormy waves.
A poster that says "Summer Festival 2025" in bold yellow letters on a purple background.
Put the cat from the first image on the sofa in the second image, keep the lighting.
Replace the dog with a white rabbit and keep the background unchanged.
She's reading a book while it's raining outside, and they'll be home soon.
We've seen 3 boats, 12 birds and 100 stars over the harbor tonight.
"""


def _build_tokenizer():
    """Train a small byte-level BPE offline, with Mistral's control tokens, as a fast tokenizer."""
    from diffusers.pipelines.flux2.system_messages import SYSTEM_MESSAGE
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import PreTrainedTokenizerFast

    # A tiktoken-style split (letters, digits, punctuation runs, whitespace) then bytes, like tekken.
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    bpe = Tokenizer(BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=_SPECIAL_TOKENS,  # ids 0.. in this order
    )
    bpe.train_from_iterator([SYSTEM_MESSAGE, *_ENGLISH_TEXT.splitlines()], trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=bpe,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
    )


def _build_processor(tokenizer):
    from transformers import PixtralImageProcessor, PixtralProcessor

    # Mistral Small 3.1's vision preprocessing: 14px patches merged 2x2, longest edge 1540.
    image_processor = PixtralImageProcessor(
        size={"longest_edge": 1540},
        patch_size={"height": 14, "width": 14},
        image_mean=[0.48145466, 0.4578275, 0.40821073],
        image_std=[0.26862954, 0.26130258, 0.27577711],
    )
    return PixtralProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=14,
        spatial_merge_size=2,
        chat_template=_CHAT_TEMPLATE,
    )


def _padded(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def _build_text_encoder(tokenizer):
    """A narrow 30-layer Mistral 3 (text) with a one-layer Pixtral vision tower."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    head_dim = 8
    config = Mistral3Config(
        text_config={
            "model_type": "mistral",
            # Like the real model, the embedding table is padded past the tokenizer's length.
            "vocab_size": _padded(len(tokenizer)),
            "hidden_size": _TEXT_HIDDEN,
            "intermediate_size": 2 * _TEXT_HIDDEN,
            "num_hidden_layers": _TEXT_LAYERS,
            "num_attention_heads": _TEXT_HIDDEN // head_dim,
            "num_key_value_heads": 1,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-5,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000000.0},
            "sliding_window": None,
            "bos_token_id": tokenizer.bos_token_id,
            "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id,
        },
        vision_config={
            "model_type": "pixtral",
            "hidden_size": 16,
            "intermediate_size": 32,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "head_dim": 8,
            "patch_size": 14,
            "image_size": 1540,
            "hidden_act": "gelu",
        },
        image_token_index=tokenizer.convert_tokens_to_ids("[IMG]"),
        spatial_merge_size=2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(0)
    return Mistral3ForConditionalGeneration(config).to(torch.float32).eval()


def _build_klein_tokenizer():
    """The shared tiny Qwen2 BPE, trained on the rendered klein template, with Qwen3's chat template."""
    from transformers import AddedToken

    from vllm_omni.diffusion.models.tiny_qwen_tokenizer import build_qwen2_tokenizer

    rendered = "<|im_start|>user\n<|im_end|>\n<|im_start|>assistant\n\n\n\n\n"
    tokenizer = build_qwen2_tokenizer([rendered])
    # Qwen3's thinking markers are single added tokens in the real vocabulary.
    tokenizer.add_tokens([AddedToken(tok, special=False, normalized=False) for tok in ("<think>", "</think>")])
    tokenizer.chat_template = _QWEN3_CHAT_TEMPLATE
    return tokenizer


def _build_klein_text_encoder(tokenizer):
    """A narrow 28-layer Qwen3 causal LM (the pipeline reads its hidden states 9, 18 and 27)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=_padded(len(tokenizer)),  # padded past the tokenizer's length, like the real model
        hidden_size=_KLEIN_TEXT_HIDDEN,
        intermediate_size=2 * _KLEIN_TEXT_HIDDEN,
        num_hidden_layers=_KLEIN_TEXT_LAYERS,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        tie_word_embeddings=True,
        bos_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return Qwen3ForCausalLM(config).to(torch.float32).eval()


def _build_transformer(text_hidden: int = _TEXT_HIDDEN, guidance_embeds: bool = True):
    from diffusers import Flux2Transformer2DModel

    torch.manual_seed(0)
    return Flux2Transformer2DModel(
        patch_size=1,
        in_channels=_VAE_PATCH[0] * _VAE_PATCH[1] * _LATENT_CHANNELS,  # the VAE's 2x2-patchified latents
        num_layers=2,
        num_single_layers=2,
        attention_head_dim=16,
        num_attention_heads=6,
        joint_attention_dim=3 * text_hidden,  # three text encoder layers stacked per token
        timestep_guidance_channels=32,
        mlp_ratio=3.0,
        axes_dims_rope=(4, 4, 4, 4),  # (T, H, W, L) rotary dims, summing to attention_head_dim
        rope_theta=2000,
        guidance_embeds=guidance_embeds,  # FLUX.2-dev embeds its distilled guidance; klein has none
    ).eval()


def _build_vae():
    from diffusers import AutoencoderKLFlux2

    torch.manual_seed(0)
    vae = AutoencoderKLFlux2(
        block_out_channels=(8, 16, 16, 16),  # four blocks: three downsamples, 8x like the real VAE
        layers_per_block=1,
        latent_channels=_LATENT_CHANNELS,
        norm_num_groups=4,
        patch_size=_VAE_PATCH,
    ).eval()
    # Latent statistics the pipeline normalises with (the real checkpoint stores measured ones).
    with torch.no_grad():
        vae.bn.running_mean.normal_(0.0, 0.1)
        vae.bn.running_var.uniform_(0.5, 2.0)
    return vae


def _build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # FLUX.2-dev's scheduler: the pipeline passes a resolution-dependent `mu`.
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
        invert_sigmas=False,
        shift_terminal=None,
        use_karras_sigmas=False,
        use_exponential_sigmas=False,
        use_beta_sigmas=False,
        time_shift_type="exponential",
        stochastic_sampling=False,
    )


def build_tiny_model(name: str, folder: str | os.PathLike) -> None:
    """Write the complete diffusers folder of tiny model ``name`` into ``folder``."""
    import diffusers

    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    pipeline_class = getattr(diffusers, TINY_MODELS[name])
    if name == "tiny/flux2":
        tokenizer = _build_tokenizer()
        text = dict(text_encoder=_build_text_encoder(tokenizer), tokenizer=_build_processor(tokenizer))
        transformer = _build_transformer()
    else:
        tokenizer = _build_klein_tokenizer()
        text = dict(text_encoder=_build_klein_text_encoder(tokenizer), tokenizer=tokenizer)
        transformer = _build_transformer(_KLEIN_TEXT_HIDDEN, guidance_embeds=False)
    # FLUX.2-klein-4B's model_index says is_distilled (4 steps, no CFG); the KV pipeline has no such flag.
    extra = {"is_distilled": True} if name == "tiny/flux2-klein" else {}
    pipe = pipeline_class(scheduler=_build_scheduler(), vae=_build_vae(), transformer=transformer, **text, **extra)
    pipe.save_pretrained(folder, safe_serialization=True)


def tiny_model_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """Return the cached folder of tiny model ``name``, building it on first use."""
    if name not in TINY_MODELS:
        raise ValueError(f"unknown tiny model {name!r}; known: {', '.join(sorted(TINY_MODELS))}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_model, cache_dir)
