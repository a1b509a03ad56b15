"""Rotary embeddings in real arithmetic (models/rotary.py) give the references' complex products bit for bit."""

from __future__ import annotations

import pytest
import torch
from diffusers.models.transformers.transformer_qwenimage import apply_rotary_emb_qwen


def _freqs(*shape: int) -> torch.Tensor:
    angles = torch.rand(*shape, generator=torch.Generator().manual_seed(1)) * 1000
    return torch.polar(torch.ones_like(angles), angles)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotate_pairs_is_the_complex_product_of_qwen_image_and_z_image(dtype):
    from vllm_omni.diffusion.models.rotary import rotate_pairs

    x = torch.randn(2, 77, 6, 128, generator=torch.Generator().manual_seed(0)).to(dtype)
    freqs = _freqs(77, 64)  # Qwen-Image's [S, D/2], one table for every row
    expected = apply_rotary_emb_qwen(x, freqs, use_real=False)
    assert torch.equal(rotate_pairs(x, freqs.unsqueeze(1)), expected)
    batched = _freqs(2, 77, 64)  # Z-Image's [B, S, D/2]: a table per row
    expected = torch.view_as_real(torch.view_as_complex(x.float().unflatten(-1, (-1, 2))) * batched.unsqueeze(2))
    assert torch.equal(rotate_pairs(x, batched.unsqueeze(2)), expected.flatten(3).to(dtype))
