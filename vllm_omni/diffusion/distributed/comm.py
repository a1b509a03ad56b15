"""The sequence<->head all-to-all of Ulysses attention.

A rank holds a slice of the sequence with all heads; after `all_to_all` it holds the
whole sequence for a slice of the heads, and the reverse call brings it back. The
tensors exchanged are laid out `[world, ...]`: chunk `i` goes to (or came from) rank `i`.
The attention layer (attention/layer.py) packs and unpacks that layout.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def all_to_all(send: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
    """Send `send[i]` to rank i of `group`; return `recv` with `recv[i]` from rank i."""
    if send.shape[0] != dist.get_world_size(group):
        raise ValueError(f"all_to_all: dim 0 must equal the group size, got {tuple(send.shape)}")
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


def pack_seq_to_head(dst: torch.Tensor, x: torch.Tensor) -> None:
    """Write `x` [B, S_local, H, D] into `dst` [P, B, S_local, H/P, D]: head group i -> chunk i."""
    world = dst.shape[0]
    dst.copy_(x.unflatten(2, (world, -1)).permute(2, 0, 1, 3, 4))


def unpack_head_to_seq(src: torch.Tensor) -> torch.Tensor:
    """After the reverse exchange: [P, B, S_local, H/P, D] -> [B, S_local, H, D] (inverse of the packing)."""
    return src.permute(1, 2, 0, 3, 4).flatten(2, 3)
