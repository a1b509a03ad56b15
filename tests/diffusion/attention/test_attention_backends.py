"""Backend selection by name, env var and padding need."""

from __future__ import annotations

import sys

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


def test_a_named_dense_kernel_gives_a_models_own_masked_calls_to_the_masked_kernel(monkeypatch):
    """`sdpa` cannot mask: named with mask_sp_padding it is refused at start, but a call that brings its own mask
    (block-causal text, a padded prompt) runs SDPA's masked kernel instead of failing mid-request."""
    configure_attention_backend("sdpa")
    assert resolve_attention_backend(needs_mask=False).name == "sdpa"
    assert resolve_attention_backend(needs_mask=True).name == "sdpa_masked"
    monkeypatch.setenv(backends.ENV_VAR, "sdpa")
    configure_attention_backend(None)
    assert resolve_attention_backend(needs_mask=True).name == "sdpa_masked"
    with pytest.raises(ValueError, match="mask_sp_padding=True needs an attention backend that can mask"):
        configure_attention_backend(None, mask_sp_padding=True)


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


# ---- flash_attn_4: FlashAttention 4's kernels for dense calls (the CUDA test: test_attention_fa4_cuda.py) ---------


def test_flash_attn_4_without_its_package_is_refused_naming_the_install(monkeypatch):
    real = backends._installed
    monkeypatch.setattr(backends, "_installed", lambda module: False if module == "flash_attn.cute" else real(module))
    with pytest.raises(ValueError, match=r"needs the flash-attn-4 package .*pip install -e '\.\[fa4\]'"):
        configure_attention_backend("flash_attn_4")
    assert not real("no_such_package.cute")  # a dotted name whose parent is missing is "not installed", no raise


def test_flash_attn_4_on_a_rank_without_a_hopper_gpu_is_refused(monkeypatch):
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    configure_attention_backend("flash_attn_4", mask_sp_padding=True)  # it takes a mask (to SDPA's masked kernel)
    with pytest.raises(ValueError, match=r"'flash_attn_4' needs a CUDA GPU of compute capability 9\.0 .*runs on cpu"):
        configure_attention_backend("flash_attn_4", device=torch.device("cpu"))


def test_flash_attn_4_gives_masked_causal_and_unsupported_calls_to_sdpa(monkeypatch):
    """Only a dense, non-causal half-precision CUDA call reaches FA4's kernel; the rest is SDPA's, bit for bit."""
    calls = []

    def kernel(q, k, v, return_lse=False):  # stands in for flash_attn.cute.flash_attn_func: [B, L, H, D] in and out
        calls.append(return_lse)
        return backends.attention_with_lse(q, k, v) if return_lse else (backends.BACKENDS["sdpa"](q, k, v), None)

    module = type(sys)("flash_attn.cute")
    module.flash_attn_func = kernel
    monkeypatch.setitem(sys.modules, "flash_attn.cute", module)
    fa4, sdpa, masked = (backends.BACKENDS[n] for n in ("flash_attn_4", "sdpa", "sdpa_masked"))
    q, k, v = _qkv("cpu", torch.bfloat16)
    bias = torch.zeros(2, 1, 1, 53, dtype=torch.bfloat16)
    bias[1, ..., 20:] = float("-inf")
    assert not backends.flash_attn_4_runs(q, k, v)  # a CPU tensor
    assert torch.equal(fa4(q, k, v), sdpa(q, k, v)) and not calls
    monkeypatch.setattr(backends, "flash_attn_4_runs", lambda q, k, v: True)
    assert torch.equal(fa4(q, k, v, bias), masked(q, k, v, bias))
    assert torch.equal(fa4(q, k[:, :37], v[:, :37], causal=True), sdpa(q, k[:, :37], v[:, :37], causal=True))
    assert torch.equal(fa4.with_lse(q, k, v, bias)[1], backends.attention_with_lse(q, k, v, bias)[1])
    assert not calls  # none of those reached the kernel
    assert torch.equal(fa4(q, k, v), sdpa(q, k, v)) and calls == [False]
    fa4.with_lse(q, k, v)
    assert calls == [False, True]


def _fake_flash_attn_4(monkeypatch):
    """flash_attn.cute as if installed (CI has not got it): the automatic choice imports it, no call runs it."""
    monkeypatch.setitem(sys.modules, "flash_attn", type(sys)("flash_attn"))
    monkeypatch.setitem(sys.modules, "flash_attn.cute", type(sys)("flash_attn.cute"))


def test_the_automatic_dense_kernel_is_flash_attn_4_only_on_hopper_with_graphs_and_the_package(monkeypatch, caplog):
    """Unnamed, a dense call gets FA4 where it measured faster (a Hopper GPU, forwards replayed from CUDA graphs)
    and flash-attn-4 imports; a masked call, a name, the env var, another GPU, an eager rank or a broken install
    keep SDPA."""
    gpu = torch.device("cuda", 0)
    capability = [(9, 0)]
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability[0])
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    _fake_flash_attn_4(monkeypatch)

    def automatic(name=None, **kwargs):
        configure_attention_backend(name, **{"device": gpu, "graphs": True, **kwargs})
        return resolve_attention_backend(needs_mask=False).name, resolve_attention_backend(needs_mask=True).name

    with caplog.at_level("INFO", logger=backends.logger.name):
        assert automatic() == ("flash_attn_4", "sdpa_masked")
    assert "attention: flash_attn_4 for dense calls" in caplog.text
    assert automatic("sdpa") == ("sdpa", "sdpa_masked")  # a name wins
    assert automatic(graphs=False) == ("sdpa", "sdpa_masked")
    assert automatic(device=torch.device("cpu")) == ("sdpa", "sdpa_masked")
    monkeypatch.setenv(backends.ENV_VAR, "sdpa_masked")
    assert automatic() == ("sdpa_masked", "sdpa_masked")  # the env var names one kernel for every call
    monkeypatch.delenv(backends.ENV_VAR)
    for other in ((8, 0), (10, 0)):  # measured on Hopper only
        capability[0] = other
        assert automatic() == ("sdpa", "sdpa_masked")
    capability[0] = (9, 0)
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # installed, but its import fails
    with caplog.at_level("WARNING", logger=backends.logger.name):
        assert automatic() == ("sdpa", "sdpa_masked")
    assert "flash-attn-4 is installed but does not import" in caplog.text


def test_a_lossy_backends_exact_steps_take_the_automatic_dense_kernel(monkeypatch):
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(backends, "_installed", lambda module: True)
    _fake_flash_attn_4(monkeypatch)
    configure_attention_backend("triton_int8", full_steps=1, device=torch.device("cuda", 0), graphs=True)
    try:
        backends.set_denoising_step(0, 3)
        assert resolve_attention_backend(needs_mask=False).name == "flash_attn_4"
        assert resolve_attention_backend(needs_mask=True).name == "sdpa_masked"
        backends.set_denoising_step(1, 3)
        assert resolve_attention_backend(needs_mask=False).name == "triton_int8"
        assert resolve_attention_backend(needs_mask=False, allow_low_precision=False).name == "flash_attn_4"
    finally:
        backends.set_denoising_step(None)
