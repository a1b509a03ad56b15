"""Tiny LoRA adapters for the tiny models (`tiny/qwen-image-lora`), built once into the tiny-model cache.

`--lora-modules style=tiny/qwen-image-lora` serves one on a fresh machine, as `tiny/qwen-image` serves a model:
engine/adapters.py resolves the name here. An adapter is made with PEFT on its tiny model's denoiser (seeded
random A and B, B scaled so the image visibly changes) and written in diffusers' format by the pipeline's own
`save_lora_weights` (`pytorch_lora_weights.safetensors`). Each family declares its adapters (`Family.tiny_adapters`).
"""

from __future__ import annotations

import json
import os
import pathlib

from vllm_omni.diffusion.models.tiny_cache import cached_tiny_model

# Bump when the written adapters change so stale caches are not reused.
_CACHE_VERSION = "v1"
WEIGHTS_NAME = "pytorch_lora_weights.safetensors"  # what diffusers' save_lora_weights writes
TARGETS = ("to_q", "to_k", "to_v", "to_out.0")  # the attention projections every family's denoiser has
RANK = 4
GAIN = 4.0  # B's scale: the adapter's effect on a tiny model's image stays far above float32 noise


def tiny_adapters() -> dict[str, str]:
    """Every tiny adapter's name -> the tiny model it adapts."""
    from vllm_omni.diffusion.models.registry import FAMILIES

    return {name: base for family in FAMILIES for name, base in family.tiny_adapters.items()}


def build_tiny_adapter(name: str, folder: str | os.PathLike) -> None:
    """Write tiny adapter `name` (its `pytorch_lora_weights.safetensors`) into `folder`."""
    import diffusers
    import torch
    from peft import LoraConfig, get_peft_model_state_dict

    from vllm_omni.diffusion.models.registry import TINY_MODELS

    model = tiny_adapters()[name]
    base = TINY_MODELS[model].family_module("tiny").tiny_model_path(model)  # built once, as the loader builds it
    index = json.loads((base / "model_index.json").read_text())
    _, transformer_class = index["transformer"]
    transformer = getattr(diffusers, transformer_class).from_pretrained(base, subfolder="transformer")
    torch.manual_seed(0)
    config = LoraConfig(r=RANK, lora_alpha=RANK, target_modules=list(TARGETS), init_lora_weights=False)
    transformer.add_adapter(config, adapter_name="tiny")
    state = get_peft_model_state_dict(transformer, adapter_name="tiny")
    layers = {key: value * GAIN if ".lora_B." in key else value.clone() for key, value in state.items()}
    getattr(diffusers, index["_class_name"]).save_lora_weights(folder, transformer_lora_layers=layers)


def tiny_adapter_path(name: str, cache_dir: str | None = None) -> pathlib.Path:
    """The cached folder of tiny adapter `name`, built on first use; ValueError naming the known ones otherwise."""
    known = tiny_adapters()
    if name not in known:
        raise ValueError(f"unknown tiny adapter {name!r}; tiny adapters: {', '.join(known)}")
    return cached_tiny_model(name, _CACHE_VERSION, build_tiny_adapter, cache_dir, marker=WEIGHTS_NAME)
