"""The `flash_attn_4` backend on a Hopper-or-newer GPU with flash-attn-4 installed (skipped elsewhere): as exact as
cuDNN's SDPA against an fp32 reference at our shapes, its log-sum-exp what ring attention merges, a CUDA graph
replay equal to eager, and a Ulysses rank's joint attention equal to U1's.

    pytest -v -rA tests/diffusion/attention/test_attention_fa4_cuda.py
"""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from tests.diffusion.attention.test_attention_fp8_cuda import _qkv, _relative_l2, _sdpa
from vllm_omni.diffusion.attention import backends
from vllm_omni.diffusion.attention.backends import BACKENDS, attention_with_lse
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphs

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(
        torch.cuda.is_available() and torch.cuda.get_device_capability() < (9, 0), reason="needs Hopper or newer"
    ),
    pytest.mark.skipif(not backends._installed("flash_attn.cute"), reason="needs flash-attn-4 (.[fa4])"),
]

# (tokens, heads): Qwen-Image 1024x1024 (image + text), one Ulysses-8 rank of HunyuanVideo 1.5 848x480x121 and
# Wan2.2 832x480x81, and an odd length (a padded-then-trimmed shard); head_dim 128.
SHAPES = {
    "qwen_image_1024": (4096 + 30, 24), "hunyuan_video_15_u8": (49650, 2), "wan22_u8": (32760, 5), "odd": (777, 3),
}  # fmt: skip
TOLERANCE = 1.25  # exact: an error within this factor of cuDNN's (both round the output to bf16 once)


@pytest.mark.parametrize("shape", SHAPES)
def test_as_exact_as_cudnn_against_an_fp32_reference(shape):
    q, k, v = _qkv(*SHAPES[shape])
    heads = slice(0, min(2, q.shape[2]))  # fp32 on two heads: the reference of every head would not fit
    ref = _sdpa(*(t[:, :, heads].float() for t in (q, k, v)))
    out = BACKENDS["flash_attn_4"](q, k, v)
    assert out.dtype == q.dtype and out.shape == q.shape
    with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
        cudnn = _sdpa(q, k, v)
    error, cudnn_error = _relative_l2(out[:, :, heads], ref), _relative_l2(cudnn[:, :, heads], ref)
    assert error <= TOLERANCE * cudnn_error, f"{shape}: relative L2 {error:.5f}, cuDNN's {cudnn_error:.5f}"


def test_log_sum_exp_is_what_ring_attention_merges():
    q, k, v = _qkv(1000, 4, batch=2)
    out, lse = BACKENDS["flash_attn_4"].with_lse(q, k, v)
    ref_out, ref_lse = attention_with_lse(q, k, v)
    assert lse.shape == ref_lse.shape == (2, 4, 1000) and lse.dtype == torch.float32
    torch.testing.assert_close(lse, ref_lse, rtol=0, atol=1e-4)
    torch.testing.assert_close(out.float(), ref_out.float(), rtol=0, atol=2e-2)
    assert torch.equal(out, BACKENDS["flash_attn_4"](q, k, v))


def test_a_cuda_graph_replays_the_eager_call():
    """Captured as the engine captures a forward (worker/cuda_graphs.py), new inputs in the same buffers replay."""
    q, k, v = _qkv(*SHAPES["odd"])
    fa4 = BACKENDS["flash_attn_4"]
    eager = fa4(q, k, v)
    graph, captured = CUDAGraphs().capture(fa4, dict(q=q, k=k, v=v), 1, None)
    for seed in (1, 0):  # new inputs in the same buffers, then the first ones again
        for t, new in zip((q, k, v), _qkv(*SHAPES["odd"], seed=seed)):
            t.copy_(new)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, fa4(q, k, v))
    assert torch.equal(captured, eager)


def test_a_batch_of_rows_equals_each_row_alone():
    """CFG in one pass puts two rows in one call: each row's output is the one it gets alone."""
    q, k, v = _qkv(*SHAPES["odd"], batch=2)
    fa4 = BACKENDS["flash_attn_4"]
    both = fa4(q, k, v)
    for row in range(2):
        torch.testing.assert_close(both[row : row + 1], fa4(q[row : row + 1], k[row : row + 1], v[row : row + 1]))


def test_a_ulysses_ranks_heads_equal_those_heads_at_u1():
    """After the all-to-all a rank attends over its heads only: the same bits as those heads of the whole call."""
    q, k, v = _qkv(*SHAPES["qwen_image_1024"])
    fa4 = BACKENDS["flash_attn_4"]
    whole = fa4(q, k, v)
    for rank in range(3):  # U8: three heads a rank
        heads = slice(3 * rank, 3 * rank + 3)
        assert torch.equal(fa4(q[:, :, heads], k[:, :, heads], v[:, :, heads]), whole[:, :, heads])


def test_the_engine_picks_it_by_itself_and_its_image_is_cudnns(capfd):
    """With no backend named, a Hopper rank that replays CUDA graphs runs FA4 (backends.automatic_dense_backend); its
    start says so, and its image is cuDNN's (`--attention-backend sdpa`) within bf16 rounding: the two kernels sum in
    different orders, a wrong or stale kernel is off by far more."""
    import numpy as np

    from vllm_omni import Omni

    args = dict(height=208, width=272, num_inference_steps=3, seed=11, output_type="np", negative_prompt=" ")
    with Omni("tiny/qwen-image", attention_backend="sdpa") as omni:
        cudnn = np.stack(omni.generate("a red fox in the snow", **args))
    assert "flash_attn_4 for dense calls" not in capfd.readouterr().err
    with Omni("tiny/qwen-image") as omni:
        assert omni.engine.config.dtype == "bfloat16" and not omni.engine.config.enforce_eager
        fa4 = np.stack(omni.generate("a red fox in the snow", **args))
    assert "attention: flash_attn_4 for dense calls" in capfd.readouterr().err
    difference = np.abs(fa4.astype(np.float64) - cudnn)
    print(f"FA4 against cuDNN: max {difference.max():.4f}, mean {difference.mean():.5f}")
    assert difference.mean() < 5e-3 and difference.max() < 0.1
