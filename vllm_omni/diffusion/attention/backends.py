"""Attention kernels, chosen by name. The parallel strategy (layer.py) never calls torch directly.

A backend takes q [B, Lq, H, D] and k, v [B, Lk, H, D] and returns [B, Lq, H, D].
Names: ``sdpa`` (dense, cannot mask) and ``sdpa_masked`` (takes an additive key mask).
Selection: an explicit name (config / ``--attention-backend``), else the
``VLLM_OMNI_ATTENTION_BACKEND`` environment variable, else ``sdpa_masked`` when a
mask is needed and ``sdpa`` otherwise. A varlen backend is left out on purpose: on an
H200, torch's unpad -> varlen -> re-pad measured slower than masked SDPA.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ENV_VAR = "VLLM_OMNI_ATTENTION_BACKEND"


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    supports_mask: bool

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """`causal`: query i sees keys [0, i] (no mask tensor: every dense kernel has it)."""
        if key_mask is not None and not self.supports_mask:
            raise ValueError(f"attention backend {self.name!r} cannot apply a mask")
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask, is_causal=causal
        )
        return out.transpose(1, 2)


BACKENDS: dict[str, AttentionBackend] = {
    "sdpa": AttentionBackend("sdpa", supports_mask=False),
    "sdpa_masked": AttentionBackend("sdpa_masked", supports_mask=True),
}

_configured_name: str | None = None


def check_attention_backend(name: str | None, mask_sp_padding: bool = False) -> None:
    """Raise ValueError for an unknown backend name, or one that cannot mask when masking is asked for."""
    if name is not None:
        _validate(name, needs_mask=mask_sp_padding, source="attention_backend")
    else:
        resolve_attention_backend(needs_mask=mask_sp_padding)  # checks the env var


def configure_attention_backend(name: str | None, mask_sp_padding: bool = False) -> None:
    """Set the process-wide backend name (None: env var or automatic); errors early on bad settings."""
    global _configured_name
    check_attention_backend(name, mask_sp_padding)
    _configured_name = name


def _validate(name: str, needs_mask: bool, source: str) -> AttentionBackend:
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown {source} {name!r}; choose one of: {', '.join(BACKENDS)}")
    if needs_mask and not backend.supports_mask:
        masking = [n for n, b in BACKENDS.items() if b.supports_mask]
        raise ValueError(
            f"mask_sp_padding=True needs an attention backend that can mask, but {source}={name!r} cannot. "
            f"Use {' or '.join(masking)} (or leave the backend unset), or set mask_sp_padding=False."
        )
    return backend


def resolve_attention_backend(needs_mask: bool) -> AttentionBackend:
    """The backend for one attention call: configured name, else env var, else by need."""
    if _configured_name is not None:
        return _validate(_configured_name, needs_mask, "attention_backend")
    env_name = os.environ.get(ENV_VAR)
    if env_name:
        return _validate(env_name, needs_mask, ENV_VAR)
    return BACKENDS["sdpa_masked" if needs_mask else "sdpa"]
