"""LoRA adapter files for the tests, made with PEFT on a tiny model's reference transformer (no download).

`make_adapter` writes a random adapter (B non-zero, so it changes the image) in diffusers' format with the
pipeline's own `save_lora_weights`; `kohya_twin` writes the same factors under kohya's key names
(`lora_unet_..._to_q.lora_down.weight`, `.lora_up.weight`, `.alpha` = rank), which diffusers' Qwen-Image
converter reads back into the same adapter.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import diffusers
import torch
from safetensors.torch import save_file

ATTENTION = ("to_q", "to_k", "to_v", "to_out.0")


def pipeline_class(model_path: Path) -> type:
    return getattr(diffusers, json.loads((Path(model_path) / "model_index.json").read_text())["_class_name"])


def adapter_state(
    model_path: Path, rank: int = 4, seed: int = 0, targets: Sequence[str] = ATTENTION, gain: float = 4.0
) -> dict[str, torch.Tensor]:
    """A random adapter's diffusers-format state dict ('transformer.<module>.lora_A.weight' ...), with B scaled by
    `gain` so that its effect on a tiny model's image is far above float32 noise."""
    from peft import LoraConfig, get_peft_model_state_dict

    transformer = pipeline_class(model_path).from_pretrained(model_path, dtype=torch.float32).transformer
    torch.manual_seed(seed)
    config = LoraConfig(r=rank, lora_alpha=rank, target_modules=list(targets), init_lora_weights=False)
    transformer.add_adapter(config, adapter_name="made")
    state = get_peft_model_state_dict(transformer, adapter_name="made")
    return {f"transformer.{key}": value * gain if ".lora_B." in key else value.clone() for key, value in state.items()}


def make_adapter(model_path: Path, folder: Path, **kwargs) -> Path:
    """A random adapter (see `adapter_state`) saved in diffusers' format into `folder`; returns `folder`."""
    state = adapter_state(model_path, **kwargs)
    layers = {key.removeprefix("transformer."): value for key, value in state.items()}
    pipeline_class(model_path).save_lora_weights(folder, transformer_lora_layers=layers)
    return folder


def kohya_twin(model_path: Path, file: Path, **kwargs) -> Path:
    """The adapter `make_adapter(model_path, ..., **kwargs)` writes, under kohya's key names, as one file."""
    state = {}
    for key, value in adapter_state(model_path, **kwargs).items():
        module, _, kind = key.removeprefix("transformer.").partition(".lora_")
        flat = "lora_unet_" + module.replace(".", "_")
        state[f"{flat}.{'lora_down' if kind.startswith('A') else 'lora_up'}.weight"] = value.contiguous()
        if kind.startswith("A"):
            state[f"{flat}.alpha"] = torch.tensor(float(value.shape[0]))
    save_file(state, str(file))
    return file
