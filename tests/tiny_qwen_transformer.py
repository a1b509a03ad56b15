"""A tiny Qwen-Image transformer's config and one set of inputs (a 5x7 latent grid, 7 text tokens), shared by
the tests that need a small real denoiser."""

from __future__ import annotations

import torch

QWEN_CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=6,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)


def qwen_inputs() -> dict:
    gen = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 35, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=gen),
        timestep=torch.rand(1, generator=gen),
        img_shapes=[[(1, 5, 7)]],
        return_dict=False,
    )
