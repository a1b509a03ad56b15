"""The FP8 attention backend on the CPU: its selection and refusals, and the per-step precision rule under
Ulysses SP (gloo, 2 and 3 ranks), with a test double for cuDNN's kernel that rounds through E4M3 like it."""

from __future__ import annotations

import importlib.util
import math
from dataclasses import dataclass

import pytest
import torch

from vllm_omni.diffusion.attention import backends, cudnn_fp8
from vllm_omni.diffusion.attention.backends import (
    AttentionBackend,
    configure_attention_backend,
    fp8_attention_step,
    resolve_attention_backend,
    set_denoising_step,
)
from vllm_omni.diffusion.attention.layer import JointAttention
from vllm_omni.diffusion.config import DiffusionParallelConfig, OmniDiffusionConfig
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    gather_sequence,
    sequence_parallel_context,
    shard_with_auto_pad,
)

HEADS, HEAD_DIM = 6, 8
DOUBLE_CALLS: list[int] = []  # the double's calls in this process (a rank's, in a pool worker)


@dataclass(frozen=True)
class EmulatedFP8(AttentionBackend):
    """Stands in for cuDNN's kernel: cudnn_fp8's own scales (agreed over the SP group), q, k, v, the
    probabilities and O rounded through E4M3, the rest in float64."""

    def __call__(self, q, k, v, key_mask=None, causal=False):
        if key_mask is not None or causal:
            return super().__call__(q, k, v, key_mask, causal)
        DOUBLE_CALLS.append(q.shape[1])
        x = cudnn_fp8.quantize_inputs(q, k, v)
        dq, dk, dv, do = (d.double().view(-1, 1, 1, 1) for d in x.descale)
        scores = torch.einsum("bqhd,bkhd->bhqk", x.q.double() * dq, x.k.double() * dk) / math.sqrt(q.shape[-1])
        p = torch.exp(scores - scores.amax(-1, keepdim=True))
        p8 = (p * cudnn_fp8.S_SCALE).to(torch.float8_e4m3fn).double() / cudnn_fp8.S_SCALE
        out = torch.einsum("bhqk,bkhd->bqhd", p8, x.v.double() * dv) / p.sum(-1).transpose(1, 2)[..., None]
        out8 = (out * x.scale_o.double().view(-1, 1, 1, 1)).to(torch.float8_e4m3fn)
        return (out8.double() * do).to(q.dtype)


@pytest.fixture(autouse=True)
def _reset(monkeypatch):
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    yield
    monkeypatch.delenv(backends.ENV_VAR, raising=False)
    set_denoising_step(None)
    configure_attention_backend(None)


@pytest.fixture
def cudnn_installed(monkeypatch):
    """As if nvidia-cudnn-frontend were installed (CI has not got it)."""
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "cudnn" else real(name, *a))


def test_cudnn_fp8_is_chosen_by_name_and_env_and_masked_or_causal_calls_stay_exact(monkeypatch):
    monkeypatch.setenv(backends.ENV_VAR, "cudnn_fp8")
    assert resolve_attention_backend(needs_mask=False).name == "cudnn_fp8"
    assert resolve_attention_backend(needs_mask=True).name == "cudnn_fp8"  # it takes a mask, to the masked kernel
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 5, 2, 16, generator=gen) for _ in range(3))
    bias = torch.zeros(1, 1, 1, 5).masked_fill_(torch.tensor([False] * 3 + [True] * 2), float("-inf"))
    fp8 = backends.BACKENDS["cudnn_fp8"]
    torch.testing.assert_close(fp8(q, k, v, bias), backends.BACKENDS["sdpa_masked"](q, k, v, bias), rtol=0, atol=0)
    torch.testing.assert_close(fp8(q, k, v, causal=True), backends.BACKENDS["sdpa"](q, k, v, causal=True))


def test_a_missing_package_is_an_error_at_engine_start_naming_it(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "cudnn" else real(name, *a))
    words = r"needs the nvidia-cudnn-frontend package .*pip install -e '\.\[fp8\]'"
    with pytest.raises(ValueError, match=words):
        configure_attention_backend("cudnn_fp8")
    from vllm_omni.diffusion.engine.core import DiffusionEngine

    with pytest.raises(ValueError, match=words):  # before anything loads or starts
        DiffusionEngine(OmniDiffusionConfig("tiny/qwen-image", device="cpu", attention_backend="cudnn_fp8"))
    monkeypatch.setenv(backends.ENV_VAR, "cudnn_fp8")
    with pytest.raises(ValueError, match=words):
        configure_attention_backend(None)


def test_a_rank_without_a_hopper_gpu_is_refused_naming_the_capability(cudnn_installed):
    configure_attention_backend("cudnn_fp8", mask_sp_padding=True)  # installed: accepted, with masking too
    with pytest.raises(ValueError, match=r"'cudnn_fp8' needs a CUDA GPU of compute capability 9\.0 .*runs on cpu"):
        configure_attention_backend("cudnn_fp8", device=torch.device("cpu"))
    configure_attention_backend("sdpa", device=torch.device("cpu"))


def test_unknown_names_and_a_mask_with_a_dense_backend_stay_refused():
    with pytest.raises(
        ValueError,
        match="unknown attention_backend 'fp8'; choose one of: sdpa, sdpa_masked, cudnn_fp8, triton_int8, "
        "triton_int8_fp8pv, triton_int8_int8pv, flash_attn_4$",
    ):
        configure_attention_backend("fp8")
    with pytest.raises(ValueError, match="mask_sp_padding=True needs an attention backend that can mask"):
        configure_attention_backend("sdpa", mask_sp_padding=True)


def test_the_rule_keeps_the_first_and_last_steps_exact_and_the_graph_key_follows_it(monkeypatch, cudnn_installed):
    assert [fp8_attention_step(s, 6, 2) for s in range(6)] == [False, False, True, True, False, False]
    assert [fp8_attention_step(s, 3, 0) for s in range(3)] == [True] * 3
    assert not any(fp8_attention_step(s, 4, 2) for s in range(4))
    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward

    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    kwargs = dict(hidden_states=torch.ones(1, 6, 4))
    exact = CUDAGraphForward._key(kwargs)
    configure_attention_backend("cudnn_fp8", full_steps=1)
    keys = []
    for step in range(3):
        set_denoising_step(step, 3)
        keys.append(CUDAGraphForward._key(kwargs))
        backend = resolve_attention_backend(needs_mask=False)
        assert backend.name == ("cudnn_fp8" if step == 1 else "sdpa")
        # cross-attention asks for the exact kernel on every step
        assert resolve_attention_backend(needs_mask=False, allow_low_precision=False).name == "sdpa"
    assert keys[0] == keys[2] == exact != keys[1]


def test_full_steps_is_one_engine_option():
    from vllm_omni.diffusion.engine.args import EngineArgs

    args = EngineArgs.from_kwargs("tiny/qwen-image", attention_backend="cudnn_fp8", fp8_attention_full_steps=3)
    assert args.engine_config().fp8_attention_full_steps == 3
    assert EngineArgs("tiny/qwen-image").engine_config().fp8_attention_full_steps == 2
    with pytest.raises(ValueError, match="fp8_attention_full_steps must be an integer >= 0, got -1"):
        EngineArgs.from_kwargs("tiny/qwen-image", fp8_attention_full_steps=-1)


def _step_inputs(step: int, batch: int, image_len: int, text_len: int):
    gen = torch.Generator().manual_seed(100 + step)

    def qkv(length, scale):
        return tuple(torch.randn(batch, length, HEADS, HEAD_DIM, generator=gen) * scale for _ in range(3))

    return qkv(image_len, 1.0), qkv(text_len, 3.0)  # the text louder: its scale alone would differ


def denoise_with_the_double(steps: int, full_steps: int, batch: int, image_len: int, text_len: int, sp: bool):
    """One rank's denoising loop over a joint attention layer: per step, the gathered (image, text) outputs and
    whether the double ran."""
    backends.BACKENDS["fp8_double"] = EmulatedFP8("fp8_double", supports_mask=True, low_precision=True)
    configure_attention_backend("fp8_double", full_steps=full_steps)
    layer = JointAttention(text_position="front")
    outputs, fp8_steps = [], []
    try:
        for step in range(steps):
            set_denoising_step(step, steps)
            image, text = _step_inputs(step, batch, image_len, text_len)
            calls = len(DOUBLE_CALLS)
            if sp:
                with sequence_parallel_context(DiffusionParallelConfig()):
                    img_out, txt_out = layer(
                        *(shard_with_auto_pad(t, 1, IMAGE) for t in image),
                        text_qkv=tuple(shard_with_auto_pad(t, 1, TEXT) for t in text),
                    )
                    img_out, txt_out = gather_sequence(img_out, 1, IMAGE), gather_sequence(txt_out, 1, TEXT)
            else:
                img_out, txt_out = layer(*image, text_qkv=text)
            outputs.append((img_out, txt_out))
            fp8_steps.append(len(DOUBLE_CALLS) > calls)
    finally:
        set_denoising_step(None)
        configure_attention_backend(None)
        del backends.BACKENDS["fp8_double"]
    return outputs, fp8_steps


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
def test_every_rank_runs_fp8_on_the_same_steps_and_trim_equals_one_process(sp_pool):
    steps, full_steps, shape = 5, 1, (2, 13, 5)  # 13 image and 5 text tokens pad at U2 and U3
    single, single_steps = denoise_with_the_double(steps, full_steps, *shape, sp=False)
    assert single_steps == [False, True, True, True, False]
    for rank, (outputs, fp8_steps) in enumerate(sp_pool.run(denoise_with_the_double, steps, full_steps, *shape, True)):
        assert fp8_steps == single_steps, f"rank {rank}"
        for step, (got, expected) in enumerate(zip(outputs, single)):
            for out, ref in zip(got, expected):
                error = (out - ref).abs().max().item()
                assert error <= 1e-6, f"rank {rank} step {step}: largest difference {error}"
    # The double is told apart from exact attention on its steps, and absent from the others.
    for step, (img, _) in enumerate(single):
        image, text = _step_inputs(step, *shape)
        exact, _ = JointAttention("front")(*image, text_qkv=text)
        error = ((img - exact).norm() / exact.norm()).item()
        assert (error > 1e-3) if single_steps[step] else (error < 1e-6), f"step {step}: relative L2 {error}"
