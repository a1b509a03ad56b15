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
import json
import os
import pathlib
import re

import torch

from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model

TINY_MODELS: dict[str, str] = {
    "tiny/qwen-image": "QwenImagePipeline",
    "tiny/qwen-image-edit": "QwenImageEditPipeline",
    "tiny/qwen-image-edit-plus": "QwenImageEditPlusPipeline",
}

# Bump when the generated folders change so stale caches are not reused.
_CACHE_VERSION = "v1"

# Text encoder hidden size; also the vision tower's output size and the transformer's joint_attention_dim.
_TEXT_HIDDEN = 64
# Latent channels of the real Qwen-Image VAE (the transformer packs 2x2 patches: 64 inputs).
_LATENT_CHANNELS = 16
_VAE_BASE_DIM = 16

# Minimal chat template in Qwen's ChatML layout, with image/video placeholders for the processor.
_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif part['type'] == 'video' %}<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif part['type'] == 'text' %}{{ part['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Special tokens in the order (and with the special flag) of the Qwen2.5-VL tokenizer.
_SPECIAL_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]

# Cap on the trained byte-level BPE vocabulary (before special tokens). The small corpus runs out
# of pairs first (~940 tokens), which leaves every corpus word a single token.
_BPE_VOCAB_SIZE = 2048
# The templates are repeated so their words win the early merges and stay whole even if the corpus
# grows past the cap: the pipelines' fixed offsets need the real model's one-token-per-word split.
_TEMPLATE_WEIGHT = 64

# Ordinary English (prompts and edit instructions) so user text tokenizes into sensible pieces.
_ENGLISH_TEXT = """\
A photograph of a small red fox sitting in fresh snow at sunrise, soft golden light.
An old wooden boat resting on a quiet lake, mountains and pine trees in the distance.
A cozy kitchen with a blue kettle on the stove and bread cooling on the table.
Close-up portrait of an elderly man with a grey beard, wearing a knitted wool hat.
A busy city street at night, neon signs reflected in puddles after the rain.
A watercolor painting of a lighthouse on a rocky cliff above stormy waves.
Two cats sleeping on a sunny windowsill next to a pot of green herbs.
A bowl of ramen with a soft boiled egg, spring onions and thin slices of pork.
A futuristic train crossing a bridge over a canyon, clouds below, wide angle.
A poster that says "Summer Festival 2025" in bold yellow letters on a purple background.
Children flying colorful kites on a windy beach in the late afternoon.
A still life of apples, pears and a glass bottle on a linen cloth, oil painting.
Make the sky orange and add a few birds flying over the hills.
Replace the dog with a white rabbit and keep the background unchanged.
Change the color of the car to dark green and remove the people on the left.
Add the word "OPEN" to the shop window in neon letters.
Turn the photo into a pencil sketch while keeping the faces recognizable.
Put a red scarf on the woman and make her smile.
Remove the text from the sign and fill the area with brick wall.
Combine the person in the first picture with the landscape in the second picture.
Let the man in picture 1 hold the cup from picture 2, studio lighting.
The girl wears the dress from the second image and stands in front of the house.
It is a bright morning; the market is full of fruit, vegetables, flowers and fish.
She's reading a book while it's raining outside, and they'll be home soon.
We've seen 3 boats, 12 birds and 100 stars over the harbor tonight.
Describe what you see: a tall glass tower, a round fountain, and four trees.
"""


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


def _split_special(text: str) -> list[str]:
    # Special tokens are matched before pre-tokenization, so train on the text between them.
    pattern = "|".join(re.escape(tok) for tok, _ in _SPECIAL_TOKENS)
    return [part for part in re.split(pattern, text) if part]


def _build_tokenizer():
    """Train a small byte-level BPE offline and wrap it as a ``Qwen2Tokenizer``."""
    from tokenizers import Regex, Tokenizer, normalizers, pre_tokenizers, trainers
    from tokenizers.models import BPE
    from transformers import AddedToken, Qwen2Tokenizer
    from transformers.models.qwen2.tokenization_qwen2 import PRETOKENIZE_REGEX

    # Same normalizer and pre-tokenizer as Qwen2Tokenizer, so training sees the real word pieces.
    bpe = Tokenizer(BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    corpus = []
    for template, _ in _prompt_templates().values():
        corpus += _split_special(template.format("")) * _TEMPLATE_WEIGHT
    corpus += _ENGLISH_TEXT.splitlines()
    trainer = trainers.BpeTrainer(
        vocab_size=_BPE_VOCAB_SIZE,
        min_frequency=1,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=[],
    )
    bpe.train_from_iterator(corpus, trainer=trainer)

    vocab = bpe.get_vocab()
    merges = [tuple(pair) for pair in json.loads(bpe.to_str())["model"]["merges"]]
    # Special tokens get the ids right after the BPE vocabulary, in Qwen's order.
    for token, _ in _SPECIAL_TOKENS:
        vocab[token] = len(vocab)
    tokenizer = Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        unk_token=None,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        errors="replace",
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        extra_special_tokens=[tok for tok, special in _SPECIAL_TOKENS[1:] if special],
    )
    # Registers all of them as unsplittable added tokens (the non-special ones as plain added tokens).
    tokenizer.add_tokens([AddedToken(tok, special=special, normalized=False) for tok, special in _SPECIAL_TOKENS])
    return tokenizer


def _check_template_offsets(tokenizer) -> None:
    """Fail the build unless each template's fixed drop index removes exactly the system/user prefix."""
    for class_name, (template, start_idx) in _prompt_templates().items():
        # The real offsets cut right after "<|im_start|>user\n"; everything after it is user content.
        head = template[: template.index("<|im_start|>user\n") + len("<|im_start|>user\n")]
        n_prefix = len(tokenizer(head)["input_ids"])
        if n_prefix != start_idx:
            raise RuntimeError(
                f"tiny tokenizer splits the {class_name} template prefix into {n_prefix} tokens, "
                f"but the pipeline drops {start_idx}"
            )


def _padded(n: int, multiple: int = 64) -> int:
    return -(-n // multiple) * multiple


def _build_text_encoder(tokenizer):
    """A two-layer Qwen2.5-VL whose hidden size feeds the transformer's ``joint_attention_dim``."""
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    ids = {tok: tokenizer.convert_tokens_to_ids(tok) for tok, _ in _SPECIAL_TOKENS}
    head_dim = _TEXT_HIDDEN // 4
    config = Qwen2_5_VLConfig(
        text_config={
            # Like the real model, the embedding table is padded past the tokenizer's length.
            "vocab_size": _padded(len(tokenizer)),
            "hidden_size": _TEXT_HIDDEN,
            "intermediate_size": 2 * _TEXT_HIDDEN,
            "num_hidden_layers": 2,
            "num_attention_heads": _TEXT_HIDDEN // head_dim,
            "num_key_value_heads": 2,
            "hidden_act": "silu",
            "max_position_embeddings": 128000,
            "max_window_layers": 2,
            "rms_norm_eps": 1e-6,
            # Multimodal RoPE: temporal/height/width sections cover head_dim / 2 frequencies.
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
            "bos_token_id": ids["<|endoftext|>"],
            "eos_token_id": ids["<|im_end|>"],
        },
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


def _build_scheduler():
    from diffusers import FlowMatchEulerDiscreteScheduler

    # The resolution-dependent shift schedule of the released Qwen-Image checkpoints.
    return FlowMatchEulerDiscreteScheduler(
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
        chat_template=_CHAT_TEMPLATE,
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
