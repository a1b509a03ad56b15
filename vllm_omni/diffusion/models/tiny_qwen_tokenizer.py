"""A small Qwen2 byte-level BPE tokenizer, trained offline, for the tiny models of every family.

Qwen-Image and HunyuanVideo 1.5 encode prompts with Qwen2.5-VL and drop a fixed number of
template tokens (`prompt_template_encode_start_idx`, `crop_start`). The tokenizer built here
is trained on the pipelines' own templates so that it splits them into exactly as many tokens
as the real Qwen vocabulary does (`check_prefix_tokens` fails the build otherwise), and on
ordinary English so that prompts tokenize into sensible pieces. `qwen2_5_vl_text_config`
gives the matching small text-model config.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

# Minimal chat template in Qwen's ChatML layout, with image/video placeholders for the processor.
CHAT_TEMPLATE = (
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
SPECIAL_TOKENS: list[tuple[str, bool]] = [
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
TEMPLATE_WEIGHT = 64

# Ordinary English (prompts and edit instructions) so user text tokenizes into sensible pieces.
ENGLISH_TEXT = """\
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


def split_special(text: str) -> list[str]:
    # Special tokens are matched before pre-tokenization, so train on the text between them.
    pattern = "|".join(re.escape(tok) for tok, _ in SPECIAL_TOKENS)
    return [part for part in re.split(pattern, text) if part]


def build_qwen2_tokenizer(templates: Iterable[str]):
    """Train a small byte-level BPE offline on `templates` (prompt templates as the pipeline
    renders them, special tokens included) and English text, and wrap it as a ``Qwen2Tokenizer``."""
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
    for template in templates:
        corpus += split_special(template) * TEMPLATE_WEIGHT
    corpus += ENGLISH_TEXT.splitlines()
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
    for token, _ in SPECIAL_TOKENS:
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
        extra_special_tokens=[tok for tok, special in SPECIAL_TOKENS[1:] if special],
    )
    # Registers all of them as unsplittable added tokens (the non-special ones as plain added tokens).
    tokenizer.add_tokens([AddedToken(tok, special=special, normalized=False) for tok, special in SPECIAL_TOKENS])
    return tokenizer


def check_prefix_tokens(tokenizer, prefix: str, expected: int, what: str) -> None:
    """Fail the build unless `prefix` (a template up to the user's text) is `expected` tokens long."""
    n_prefix = len(tokenizer(prefix)["input_ids"])
    if n_prefix != expected:
        raise RuntimeError(
            f"tiny tokenizer splits the {what} template prefix into {n_prefix} tokens, "
            f"but the pipeline drops {expected}"
        )


def special_token_ids(tokenizer) -> dict[str, int]:
    return {tok: tokenizer.convert_tokens_to_ids(tok) for tok, _ in SPECIAL_TOKENS}


def qwen2_5_vl_text_config(tokenizer, hidden_size: int) -> dict[str, Any]:
    """A two-layer Qwen2.5-VL language model config (pipelines read hidden_states[-3]: at least two layers)."""
    ids = special_token_ids(tokenizer)
    head_dim = hidden_size // 4
    return {
        # Like the real model, the embedding table is padded past the tokenizer's length.
        "vocab_size": -(-len(tokenizer) // 64) * 64,
        "hidden_size": hidden_size,
        "intermediate_size": 2 * hidden_size,
        "num_hidden_layers": 2,
        "num_attention_heads": hidden_size // head_dim,
        "num_key_value_heads": 2,
        "hidden_act": "silu",
        "max_position_embeddings": 128000,
        "max_window_layers": 2,
        "rms_norm_eps": 1e-6,
        # Multimodal RoPE: temporal/height/width sections cover head_dim / 2 frequencies.
        "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]},
        "bos_token_id": ids["<|endoftext|>"],
        "eos_token_id": ids["<|im_end|>"],
    }
