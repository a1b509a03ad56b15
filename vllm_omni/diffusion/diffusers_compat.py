"""Every private name of diffusers (and transformers) that vllm_omni touches, in one place, each with why.

diffusers==0.42.1 is pinned, and these names are not its API: an upgrade may rename or drop any of them. Code
elsewhere goes through the functions here; `PRIVATE_NAMES` lists each (the owner and the name), and
tests/diffusion/test_diffusers_compat.py asserts that each exists on the installed diffusers, so an upgrade that
renames one fails that test rather than serving a wrong image. Nothing else in the package spells a diffusers
underscore name (the same test greps for them).

It sits under every layer that needs it (the worker's hooks and interleaving, the families' adapters and
transformers) and imports only diffusers and transformers, lazily where a family's module is involved.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

# (module, owner in it or "" for the module itself, name): what `PRIVATE_NAMES` promises exists.
PRIVATE_NAMES: tuple[tuple[str, str, str], ...] = (
    ("diffusers.hooks.hooks", "StateManager", "_state_cache"),
    ("diffusers.hooks.hooks", "StateManager", "_context"),
    ("diffusers.hooks.hooks", "ModelHook", "_is_stateful"),
    ("diffusers.hooks.hooks", "HookRegistry", "_diffusers_hook"),  # the attribute a registry is kept under
    ("diffusers", "ModelMixin", "_repeated_blocks"),
    ("diffusers", "ModelMixin", "_keep_in_fp32_modules"),
    ("diffusers.hooks._helpers", "", "TransformerBlockRegistry"),
    ("diffusers.hooks._helpers", "", "TransformerBlockMetadata"),
    ("diffusers.guiders.guider_utils", "BaseGuidance", "_enabled"),
    ("diffusers.models.transformers.transformer_flux2", "", "_get_qkv_projections"),
    ("diffusers.models.transformers.transformer_flux2", "", "_blend_double_block_mods"),
    ("diffusers.models.transformers.transformer_flux2", "", "_blend_single_block_mods"),
    ("diffusers.models.transformers.transformer_wan", "", "_get_qkv_projections"),
    ("diffusers", "GlmImagePipeline", "_compute_generation_params"),
    ("diffusers", "GlmImagePipeline", "_extract_large_image_tokens"),
    ("diffusers", "GlmImagePipeline", "_upsample_token_ids"),
    ("diffusers", "HunyuanVideo15Pipeline", "_get_mllm_prompt_embeds"),
    ("transformers", "PreTrainedModel", "_from_config"),
)


def keep_in_fp32_modules(model_class: type) -> set[str]:
    """Names of the modules diffusers keeps in float32 when it loads `model_class` in another dtype (benchmarks
    that build a model without loading one keep them so too)."""
    return set(model_class._keep_in_fp32_modules or ())


def hook_registry(module: Any) -> Any:
    """The module's diffusers HookRegistry, or None where it has none (diffusers' public lookup,
    `HookRegistry.check_if_exists_or_initialize`, creates one)."""
    return getattr(module, "_diffusers_hook", None)


def is_stateful(hook: Any) -> bool:
    """A hook that keeps per-context state in a StateManager (diffusers' cache hooks)."""
    return bool(getattr(hook, "_is_stateful", False))


def manager_state(manager: Any) -> tuple[dict, Any]:
    """A StateManager's per-context states and its current context (None: unset; its public `get_state` raises
    then): what a request suspended between two steps puts aside (worker/interleave.py)."""
    return manager._state_cache, manager._context


def set_manager_state(manager: Any, cache: dict, context: Any) -> None:
    manager._state_cache, manager._context = cache, context


def repeated_block_names(model: Any) -> set[str]:
    """The class names of a model's repeated blocks, as diffusers' `compile_repeated_blocks` reads them."""
    return set(getattr(model, "_repeated_blocks", None) or ())


def register_block_outputs(
    block_class: type, hidden_states_index: int, encoder_hidden_states_index: int | None
) -> None:
    """Tell diffusers' cache hooks which of a block's outputs are its hidden states and encoder hidden states
    (its block registry is a private module: hooks/_helpers.py)."""
    from diffusers.hooks._helpers import TransformerBlockMetadata, TransformerBlockRegistry

    metadata = TransformerBlockMetadata(
        return_hidden_states_index=hidden_states_index, return_encoder_hidden_states_index=encoder_hidden_states_index
    )
    TransformerBlockRegistry.register(block_class, metadata)


def guider_enabled(guider: Any) -> bool:
    """Whether a diffusers guider runs guidance at all (its `__call__` decides CFG on this, not public)."""
    return bool(guider._enabled)


def reference_function(module: str, name: str) -> Callable[..., Any]:
    """A module-level private helper of a diffusers model (the projections and modulation blends the families'
    SP transformers reuse so that their blocks compute what the reference computes)."""
    return getattr(importlib.import_module(f"diffusers.models.transformers.{module}"), f"_{name}")


def pipeline_method(pipe: Any, name: str) -> Callable[..., Any]:
    """A private method of a pipeline that a family's encode stage calls as the pipeline's `__call__` does
    (GLM-Image's AR token bookkeeping)."""
    return getattr(pipe, f"_{name}")


def unbound_method(cls: type, name: str) -> Callable[..., Any]:
    """A private method of a pipeline class, read for its defaults (a tiny model renders the prompt template)."""
    return getattr(cls, f"_{name}")


def model_on_meta(model_class: Any, config: Any) -> Any:
    """A transformers model built from its config alone (`from_config` takes the model's auto class; this the
    concrete one, as `from_pretrained` does), under whatever device context the caller set."""
    return model_class._from_config(config)
