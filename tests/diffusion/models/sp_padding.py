"""Test hook for pad-content invariance: SP padding filled with random values instead of zeros.

Inside `random_sp_padding()`, `shard_with_auto_pad` pads every stream (and the tensors that
travel with it: rotary tables, position ids, modulation indices) with random values. In the exact modes
the real tokens' output must not change at all; the model tests of every family use it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from vllm_omni.diffusion.distributed import sequence_parallel


def _random_pad_tail(x: torch.Tensor, dim: int, pad_size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = pad_size
    if x.dtype.is_floating_point or x.dtype.is_complex:
        noise = torch.randn(shape, dtype=x.dtype) * 5
    else:
        # Integer tensors may be indices (Qwen-Image's modulation index picks one of two rows).
        noise = torch.randint(0, 2, shape, dtype=x.dtype)
    return torch.cat([x, noise.to(x.device)], dim=dim)


@contextlib.contextmanager
def random_sp_padding(enabled: bool = True) -> Iterator[None]:
    """Pad with random values while the context is open (zeros, as always, when `enabled` is False)."""
    original = sequence_parallel._pad_tail
    if enabled:
        sequence_parallel._pad_tail = _random_pad_tail
    try:
        yield
    finally:
        sequence_parallel._pad_tail = original
