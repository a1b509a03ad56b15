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


# ---- the kernels that return the log-sum-exp (ring attention's merge) -----------------------------------------

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _qkv(device, dtype, lq=37, lk=53, batch=2, heads=4, head_dim=64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = [(batch, lq, heads, head_dim), (batch, lk, heads, head_dim), (batch, lk, heads, head_dim)]
    return [torch.randn(*s, generator=gen).to(device, dtype) for s in shapes]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_with_lse_gives_sdpa_and_the_scores_log_sum_exp(device, dtype, masked):
    q, k, v = _qkv(device, dtype)
    mask = None
    if masked:  # row 1 of the batch sees its first 20 keys only
        mask = torch.zeros(2, 1, 1, 53, device=device, dtype=dtype)
        mask[1, ..., 20:] = float("-inf")
    backend = resolve_attention_backend(needs_mask=masked)
    out, lse = backend.with_lse(q, k, v, mask)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (2, 4, 37)
    qf, kf, vf = (t.float().transpose(1, 2) for t in (q, k, v))
    scores = qf @ kf.transpose(-1, -2) / 8 + (0 if mask is None else mask.float())
    bias = None if mask is None else mask.float()
    expected = torch.nn.functional.scaled_dot_product_attention(qf, kf, vf, attn_mask=bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), expected.transpose(1, 2), rtol=0, atol=tol)
    torch.testing.assert_close(lse, torch.logsumexp(scores, -1), rtol=0, atol=tol)


@pytest.mark.parametrize("device", DEVICES)
def test_a_row_that_sees_no_key_gives_zero_and_minus_infinity(device):
    q, k, v = _qkv(device, torch.float32)
    mask = torch.zeros(2, 1, 1, 53, device=device)
    mask[0] = float("-inf")
    out, lse = resolve_attention_backend(needs_mask=True).with_lse(q, k, v, mask)
    assert torch.isneginf(lse[0]).all() and torch.equal(out[0], torch.zeros_like(out[0]))
    assert torch.isfinite(lse[1]).all()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_blocks_merged_through_their_log_sum_exp_equal_one_kernel(device, dtype):
    """Ring attention's merge (attention/layer.py's PartialAttention) over key blocks of unequal lengths, in any
    order, equals one dense kernel over all keys; an empty block (all padding, trimmed away) is skipped."""
    from vllm_omni.diffusion.attention.layer import PartialAttention

    q, k, v = _qkv(device, dtype, lq=41, lk=70)
    backend = resolve_attention_backend(needs_mask=False)
    expected = backend(q, k, v).float()
    for bounds in ([(0, 35), (35, 70)], [(50, 70), (0, 17), (17, 50)], [(0, 70)]):
        partial = PartialAttention()
        for start, end in bounds:
            partial.add(*backend.with_lse(q, k[:, start:end], v[:, start:end]))
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        torch.testing.assert_close(partial.result(q).float(), expected, rtol=0, atol=tol)
