"""cuDNN's FP8 attention on a Hopper-or-newer GPU (skipped elsewhere): error against an fp32 reference at our
shapes, a Ulysses rank's heads equal to U1's, a CUDA graph replay equal to eager."""

from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from vllm_omni.diffusion.attention import cudnn_fp8
from vllm_omni.diffusion.attention.backends import BACKENDS
from vllm_omni.diffusion.distributed.sequence_parallel import SequenceParallelContext, use_sp_context

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0), reason="needs Hopper or newer"
    ),
    pytest.mark.skipif(importlib.util.find_spec("cudnn") is None, reason="needs nvidia-cudnn-frontend (.[fp8])"),
]

# (tokens, heads) of one Ulysses-8 rank: Qwen-Image 1328x1328 (image + text), HunyuanVideo 1.5 848x480x121
# (video + text), Wan2.2 1280x720x81; head_dim 128.
SHAPES = {"qwen_image_u8": (6889 + 30, 3), "hunyuan_video_15_u8": (49290 + 360, 2), "wan22_720p_u8": (75600, 5)}
BOUND = 0.08  # E4M3's rounding of q, k, v, the probabilities and O: about 0.027 each on Gaussian inputs


def _qkv(tokens: int, heads: int, batch: int = 1, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(seed)
    return [
        torch.randn(batch, tokens, heads, 128, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3)
    ]


def _sdpa(q, k, v):
    return F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2)


def _relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


@pytest.mark.parametrize("shape", SHAPES)
def test_fp8_attention_against_an_fp32_reference(shape):
    q, k, v = _qkv(*SHAPES[shape])
    ref = _sdpa(*(t.float() for t in (q, k, v)))
    fp8 = BACKENDS["cudnn_fp8"](q, k, v)
    assert fp8.dtype == torch.bfloat16 and fp8.shape == q.shape
    error, bf16_error = _relative_l2(fp8, ref), _relative_l2(_sdpa(q, k, v), ref)
    assert error < BOUND, f"{shape}: relative L2 {error:.4f} (bf16 SDPA: {bf16_error:.4f}), bound {BOUND}"


def test_a_ulysses_rank_in_trim_mode_gets_exactly_its_heads_of_u1(monkeypatch):
    # A rank holds the true-length sequence (6919 tokens, no multiple of 2) for half the heads; its FP8
    # scales are U1's once the amax all-reduce has run, here stood in for by U1's amax.
    q, k, v = _qkv(6889 + 30, 24)
    u1 = cudnn_fp8.attention(q, k, v)
    u1_amax = torch.stack([t.abs().amax(dim=(1, 2, 3)) for t in (q, k, v)]).float()
    monkeypatch.setattr(cudnn_fp8, "all_reduce_max", lambda amax, group: amax.copy_(torch.maximum(amax, u1_amax)))
    for rank in range(2):
        heads = slice(rank * 12, (rank + 1) * 12)
        with use_sp_context(SequenceParallelContext(object(), 2, rank, 2, 1, "trim")):
            out = cudnn_fp8.attention(q[:, :, heads], k[:, :, heads], v[:, :, heads])
        assert torch.equal(out, u1[:, :, heads]), f"rank {rank}"
    # A batch's rows are scaled and run one by one: a row's result does not depend on its neighbours.
    pair = [torch.cat([a, b]) for a, b in zip((q, k, v), _qkv(6889 + 30, 24, seed=1))]
    assert torch.equal(cudnn_fp8.attention(*pair)[:1], u1)


def test_a_cuda_graph_replay_equals_eager():
    static = _qkv(6889 + 30, 3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        cudnn_fp8.attention(*static)  # builds the cuDNN graph outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = cudnn_fp8.attention(*static)
    for seed in (1, 2):
        fresh = _qkv(6889 + 30, 3, seed=seed)
        for dst, src in zip(static, fresh):
            dst.copy_(src)
        graph.replay()
        assert torch.equal(out, cudnn_fp8.attention(*fresh)), f"seed {seed}"
