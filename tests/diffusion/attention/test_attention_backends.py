"""Backend selection by name, env var and padding need."""

from __future__ import annotations

import pytest
import torch

from vllm_omni.diffusion.attention import backends
from vllm_omni.diffusion.attention.backends import (
    configure_attention_backend,
    resolve_attention_backend,
)


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    yield
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    configure_attention_backend(None)


def test_automatic_choice_follows_the_mask_need():
    assert resolve_attention_backend(needs_mask=False).name == "sdpa"
    assert resolve_attention_backend(needs_mask=True).name == "sdpa_masked"


def test_env_var_and_config_choose_by_name(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "sdpa_masked")
    assert resolve_attention_backend(needs_mask=False).name == "sdpa_masked"
    configure_attention_backend("sdpa")
    assert resolve_attention_backend(needs_mask=False).name == "sdpa"


def test_unknown_name_is_a_clear_error(monkeypatch):
    with pytest.raises(ValueError, match="unknown attention_backend 'flash'; choose one of: sdpa, sdpa_masked"):
        configure_attention_backend("flash")
    monkeypatch.setenv(backends.ENV_VAR, "nope")
    with pytest.raises(ValueError, match="unknown VLLM_OMNI_ATTENTION_BACKEND 'nope'"):
        resolve_attention_backend(needs_mask=False)


def test_mask_sp_padding_with_a_backend_that_cannot_mask_is_refused():
    with pytest.raises(ValueError, match="mask_sp_padding=True needs an attention backend that can mask"):
        configure_attention_backend("sdpa", mask_sp_padding=True)
    configure_attention_backend("sdpa_masked", mask_sp_padding=True)


def test_masked_backend_masks_keys():
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 4, generator=gen) for _ in range(3))
    bias = torch.zeros(1, 1, 1, 5).masked_fill_(torch.tensor([False] * 3 + [True] * 2), float("-inf"))
    masked = backends.BACKENDS["sdpa_masked"](q, k, v, bias)
    dense = backends.BACKENDS["sdpa"](q, k[:, :3], v[:, :3])
    torch.testing.assert_close(masked, dense)
    with pytest.raises(ValueError, match="cannot apply a mask"):
        backends.BACKENDS["sdpa"](q, k, v, bias)
