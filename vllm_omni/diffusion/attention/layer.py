"""The attention layers every model calls, in the two kinds a model declares:

- `JointAttention`: self-attention over an image/video stream and an optional text stream joined
  to it ("front": [text, image], Qwen-Image, FLUX.2; "rear": [video, text], HunyuanVideo 1.5; no
  text: Wan2.2's video self-attention), Ulysses-parallel when a sequence-parallel context is
  active: one seq->head all-to-all for q, k, v of both streams, `attend_joint` (join, kernel,
  layout for the way back), one head->seq all-to-all. What attention may see of the SP padding
  comes from the context's `JointLayout` (distributed/sequence_parallel.py). With `text_blocks`
  (Qwen-Image 2.1's block-causal prefix) the text stream attends only to itself, in runs.
- `CrossAttention`: queries from the rank's own shard of the video stream, keys and values from a
  stream every rank holds whole (Wan2.2's 512 text tokens). No all-to-all and no padding policy:
  the padded query rows give rows that the gather drops like every padded row.

Models compute q, k, v (after QK-norm and rotary) as [B, S, H, D] and get [B, S, H, D] back;
the kernel comes from backends.py.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn

from vllm_omni.diffusion.attention.backends import AttentionBackend, resolve_attention_backend
from vllm_omni.diffusion.distributed.comm import all_to_all
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    JointLayout,
    SequenceParallelContext,
    get_sp_context,
)

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Runs of the text stream, (start, end, causal) over its true tokens in order: queries [start, end)
# attend to text keys [0, end), causally within the run where `causal` (Qwen-Image 2.1's prefix:
# text causal, each condition image a bidirectional block). The image stream still attends to all.
TextBlocks = tuple[tuple[int, int, bool], ...]


def pack_streams(layout: JointLayout, streams: dict[str, QKV]) -> torch.Tensor:
    """Lay out q, k, v of every stream for the seq->head all-to-all: [P, 3, B, S_local, H/P, D]."""
    query = streams[IMAGE][0]
    batch, _, heads, head_dim = query.shape
    world = layout.world_size
    send = query.new_empty(world, 3, batch, layout.local_len, heads // world, head_dim)
    for slot in layout.slots:
        n = slot.shard.local_seq_len
        dst = send[:, :, :, slot.local_start : slot.local_start + n]
        for i, tensor in enumerate(streams[slot.name]):
            if tensor.shape[1] != n:
                raise ValueError(
                    f"{slot.name} stream has {tensor.shape[1]} local tokens, expected {n}: "
                    "shard it with shard_with_auto_pad"
                )
            # head group p goes to rank p
            dst[:, i].copy_(tensor.reshape(batch, n, world, heads // world, head_dim).permute(2, 0, 1, 3, 4))
    return send


def unpack_streams(layout: JointLayout, back: torch.Tensor) -> list[torch.Tensor]:
    """Each stream's [B, S_local, H, D] output from the head->seq all-to-all's result, in layout order."""
    world, batch, _, heads, head_dim = back.shape
    return [
        back[:, :, slot.local_start : slot.local_start + slot.shard.local_seq_len]
        .permute(1, 2, 0, 3, 4)
        .reshape(batch, slot.shard.local_seq_len, world * heads, head_dim)
        for slot in layout.slots
    ]


def attend_text_blocks(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, blocks: TextBlocks) -> torch.Tensor:
    """The text stream's block-causal attention over its own keys ([B, L, H, D] each, true tokens first).

    Rows past the last run (SP padding, filler) join it causally when it is causal, else form a
    causal run of their own: either way no true row ever sees them, in every padding mode.
    """
    length = query.shape[1]
    runs = [list(run) for run in blocks]
    if runs and runs[-1][2]:
        runs[-1][1] = length
    elif not runs or runs[-1][1] < length:
        runs.append([runs[-1][1] if runs else 0, length, True])
    outs = []
    for start, end, causal in runs:
        if causal and start == 0:
            dense = resolve_attention_backend(needs_mask=False)
            outs.append(dense(query[:, :end], key[:, :end], value[:, :end], causal=True))
            continue
        mask = None
        if causal:  # row i (position start + i) sees keys [0, start + i]
            rows = torch.arange(start, end, device=query.device)
            mask = (torch.arange(end, device=query.device) <= rows[:, None])[None, None]
        backend = resolve_attention_backend(needs_mask=mask is not None)
        outs.append(backend(query[:, start:end], key[:, :end], value[:, :end], mask))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)


def attend_joint(
    recv: torch.Tensor, layout: JointLayout, backend: AttentionBackend, text_blocks: TextBlocks | None = None
) -> torch.Tensor:
    """A rank's work between the two all-to-alls.

    `recv` [P, 3, B, S_local, H/P, D] holds q, k, v from every rank (rank-local streams side
    by side). Each stream is copied to its joint offset (one copy per stream, as in every
    mode), the kernel runs, and its output is written straight into the [P, B, S_local,
    H/P, D] buffer the reverse all-to-all sends. With `text_blocks` ([text, image] only) the
    image rows attend to every key as usual and the text rows to the text's own, block-causally.
    """
    world, _, batch, local_len, heads, head_dim = recv.shape
    # A stream's padding and filler rows are copied too and overwritten by the next stream's rows;
    # where they reach past every real row (text filler longer than a tiny image) the buffer grows.
    joint_len = max(layout.query_len, *(s.joint_offset + world * s.shard.local_seq_len for s in layout.slots))
    joint = recv.new_empty(3, batch, joint_len, heads, head_dim)
    for slot in layout.slots:
        n, start, offset = slot.shard.local_seq_len, slot.local_start, slot.joint_offset
        dst = joint[:, :, offset : offset + world * n].view(3, batch, world, n, heads, head_dim)
        dst.copy_(recv[:, :, :, start : start + n].permute(1, 2, 0, 3, 4, 5))
    kv = joint[1:, :, : layout.kv_len]
    if text_blocks is None:
        out = backend(joint[0, :, : layout.query_len], kv[0], kv[1], layout.key_mask)
        if joint_len > layout.query_len:  # rows read back for the dropped tail: any values do
            out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, joint_len - layout.query_len))
        outs = [(out, slot.joint_offset) for slot in layout.slots]
    else:
        text, image = layout.slots
        text_end = image.joint_offset  # the text's rows: its true tokens (trim), or all of them with its padding
        image_out = backend(joint[0, :, text_end : layout.query_len], kv[0], kv[1], layout.key_mask)
        text_out = attend_text_blocks(*joint[:, :, :text_end], text_blocks)
        text_rows = world * text.shard.local_seq_len
        if text_rows > text_end:  # trim mode: the padding's rows, read back and dropped: zeros do
            text_out = torch.nn.functional.pad(text_out, (0, 0, 0, 0, 0, text_rows - text_end))
        outs = [(text_out, 0), (image_out, 0)]

    send = recv.new_empty(world, batch, local_len, heads, head_dim)
    for slot, (out, offset) in zip(layout.slots, outs):
        n, start = slot.shard.local_seq_len, slot.local_start
        src = out[:, offset : offset + world * n].view(batch, world, n, heads, head_dim)
        send[:, :, start : start + n].copy_(src.permute(1, 0, 2, 3, 4))
    return send


class JointAttention(nn.Module):
    """Joint attention over [image] or [text, image] ("front") / [image, text] ("rear")."""

    kind = "joint"

    def __init__(self, text_position: Literal["front", "rear"] = "front") -> None:
        super().__init__()
        if text_position not in ("front", "rear"):
            raise ValueError(f"text_position must be 'front' or 'rear', got {text_position!r}")
        self.text_position = text_position

    # Compiled transformer blocks (cuda_graphs.compile_repeated_blocks) run this layer eagerly:
    # the all-to-alls and the per-forward layout stay as written, and compiled code sees no collective.
    @torch.compiler.disable
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        text_qkv: QKV | None = None,
        text_blocks: TextBlocks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return the attention output of the image stream and of the text stream (None without text).

        `text_blocks`: the text stream attends only to itself, in these runs (see `TextBlocks`)."""
        if text_blocks is not None and (text_qkv is None or self.text_position != "front"):
            raise ValueError("text_blocks needs a text stream joined in front of the image")
        streams: dict[str, QKV] = {IMAGE: (query, key, value)}
        if text_qkv is not None:
            streams[TEXT] = text_qkv
        order = [IMAGE] if text_qkv is None else ([TEXT, IMAGE] if self.text_position == "front" else [IMAGE, TEXT])

        ctx = get_sp_context()
        if ctx is None or not ctx.enabled:
            outs = self._attend_single_process(ctx, order, streams, text_blocks)
        else:
            outs = self._attend_ulysses(ctx, order, streams, text_blocks)
        by_name = dict(zip(order, outs))
        return by_name[IMAGE], by_name.get(TEXT)

    @staticmethod
    def _attend_single_process(
        ctx: SequenceParallelContext | None,
        order: list[str],
        streams: dict[str, QKV],
        text_blocks: TextBlocks | None = None,
    ) -> list[torch.Tensor]:
        ordered = [streams[name] for name in order]
        query = torch.cat([q for q, _, _ in ordered], dim=1) if text_blocks is None else streams[IMAGE][0]
        # A stream's filler (shard_with_auto_pad's valid_len) is cut from keys and values: exact, dense.
        # Only a tensor of the stream's recorded length carries it (FLUX.2's fused single-stream
        # blocks pass [text, image] as one stream, which has no filler).
        kept = []
        for name, (_, k, _) in zip(order, ordered):
            shard = ctx.streams.get(name) if ctx is not None else None
            has_filler = shard is not None and shard.filler_len > 0 and k.shape[1] == shard.seq_len
            kept.append(shard.original_seq_len if has_filler else k.shape[1])
        key = torch.cat([k[:, :n] for (_, k, _), n in zip(ordered, kept)], dim=1)
        value = torch.cat([v[:, :n] for (_, _, v), n in zip(ordered, kept)], dim=1)
        out = resolve_attention_backend(needs_mask=False)(query, key, value)
        if text_blocks is not None:  # the image's rows above; the text's own, block-causal (filler: its tail)
            return [attend_text_blocks(*streams[TEXT], text_blocks), out]
        return list(out.split([q.shape[1] for q, _, _ in ordered], dim=1))

    @staticmethod
    def _attend_ulysses(
        ctx: SequenceParallelContext, order: list[str], streams: dict[str, QKV], text_blocks: TextBlocks | None = None
    ) -> list[torch.Tensor]:
        query = streams[IMAGE][0]
        if query.shape[2] % ctx.world_size:
            raise ValueError(
                f"ulysses_degree={ctx.world_size} must divide the number of attention heads ({query.shape[2]})"
            )
        layout = ctx.joint_layout(order, query.device, query.dtype)
        recv = all_to_all(pack_streams(layout, streams), ctx.group)
        backend = resolve_attention_backend(needs_mask=layout.key_mask is not None)
        back = all_to_all(attend_joint(recv, layout, backend, text_blocks), ctx.group)
        return unpack_streams(layout, back)


class CrossAttention(nn.Module):
    """Attention of a rank's query shard to keys and values every rank holds in full (see the module doc)."""

    kind = "cross"

    @torch.compiler.disable  # like JointAttention: the kernel choice stays outside compiled blocks
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        # Every query row attends to the same whole keys, so a rank's rows need nothing from its peers;
        # there is no key padding to hide (the keys are not sharded), hence the dense kernel in every mode.
        return resolve_attention_backend(needs_mask=False)(query, key, value)
