"""The attention layers every model calls, in the two kinds a model declares:

- `JointAttention`: self-attention over an image/video stream and an optional text stream joined
  to it ("front": [text, image]; "rear": [video, text]; no text: a video self-attention whose text
  comes through cross-attention; the text stream alone: a caption refiner),
  optionally after kv-only streams, which give keys and values only, Ulysses-parallel when a
  sequence-parallel context is active: one seq->head all-to-all for q, k, v of both streams,
  `attend_joint` (join, kernel, layout for the way back), one head->seq all-to-all. What attention
  may see of the SP padding comes from the context's `JointLayout` (distributed/sequence_parallel.py).
  A kv-only stream is exchanged (`kv_streams`: a cached condition image, each rank's
  sequence shard sent every step) or kept (`attend_reference`: a reference-image stream,
  computed with queries at the first step, attending only to itself, then held as each rank's
  heads after that all-to-all, `ReferenceKV`, and never exchanged again). With `text_blocks`
  (a block-causal text prefix) the text stream attends only to itself, in runs. Batch
  rows whose text ends at different lengths (the layout's `row_keys`) run the kernel per row,
  `attend_rows`; everything else of the batch runs once.
- `CrossAttention`: queries from the rank's own shard of the video stream, keys and values from a
  stream every rank holds whole (a padded prompt of a few hundred tokens, optionally with a key mask). No
  all-to-all and no padding policy: the padded query rows give rows that the gather drops like every padded row.
- `StreamCrossAttention`: queries from one sharded stream, keys and values from another sharded stream (two
  token streams of one model that attend to each other, each sharded and padded on its own). One seq->head
  all-to-all carries the query stream's q and the other stream's k and v, one head->seq brings the output back;
  what the queries see of the key stream's padding is the context's `JointLayout` for [keys, queries] with the
  key stream kv-only (trim: cut at its true length; mask: masked; none: seen), as in every joint attention.
  With ring attention (USP) too, the exchange is one all-to-all over the whole SP group, which must divide the heads.

Models compute q, k, v (after QK-norm and rotary) as [B, S, H, D] and get [B, S, H, D] back;
the kernel comes from backends.py.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from vllm_omni.diffusion.attention.backends import AttentionBackend, resolve_attention_backend
from vllm_omni.diffusion.distributed.comm import all_gather, all_to_all, ring_pass
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    REFERENCE,
    TEXT,
    JointLayout,
    RingLayout,
    SequenceParallelContext,
    get_sp_context,
)

QKV = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# Runs of the text stream, (start, end, causal) over its true tokens in order: queries [start, end)
# attend to text keys [0, end), causally within the run where `causal` (a block-causal prefix:
# text causal, each condition image a bidirectional block). The image stream still attends to all.
TextBlocks = tuple[tuple[int, int, bool], ...]


@dataclass
class ReferenceKV:
    """Keys and values of a reference-image stream, held by attention across denoising steps.

    The reference stream leads the joint sequence; its tokens attend only to each other, and every
    other token attends to them too. Under SP they are this rank's heads over the whole stream
    after the seq->head all-to-all, laid out as the joint layout placed them (trim: cut at the true
    length; mask and none: padded, the mask hiding the padding), so a later step joins them in as a
    kept kv-only stream without exchanging or recomputing anything, and the padding policy stays
    the layout's. With one rank they are diffusers' own format, [B, tokens, H, D]. Empty until the
    first step fills them.
    """

    key: torch.Tensor | None = None
    value: torch.Tensor | None = None

    @property
    def filled(self) -> bool:
        return self.key is not None


def pack_streams(layout: JointLayout, streams: dict[str, QKV]) -> torch.Tensor:
    """Lay out q, k, v of every stream for the seq->head all-to-all: [P, 3, B, S_local, H/P, D]
    (a kv-only stream gives (None, k, v): its query rows are sent unset and never read; a kept one
    is not sent)."""
    query = next(q for q, _, _ in streams.values() if q is not None)
    batch, _, heads, head_dim = query.shape
    world = layout.world_size
    send = query.new_empty(world, 3, batch, layout.local_len, heads // world, head_dim)
    for slot in layout.slots:
        if not slot.exchanged:
            continue
        n = slot.shard.local_seq_len
        dst = send[:, :, :, slot.local_start : slot.local_start + n]
        for i, tensor in enumerate(streams[slot.name]):
            if tensor is None:
                continue
            if tensor.shape[1] != n:
                raise ValueError(
                    f"{slot.name} stream has {tensor.shape[1]} local tokens, expected {n}: "
                    "shard it with shard_with_auto_pad"
                )
            # head group p goes to rank p
            dst[:, i].copy_(tensor.reshape(batch, n, world, heads // world, head_dim).permute(2, 0, 1, 3, 4))
    return send


def unpack_streams(layout: JointLayout, back: torch.Tensor) -> list[torch.Tensor]:
    """Each query stream's [B, S_local, H, D] output from the head->seq all-to-all's result, in layout order."""
    world, batch, _, heads, head_dim = back.shape
    return [
        back[:, :, slot.local_start : slot.local_start + slot.shard.local_seq_len]
        .permute(1, 2, 0, 3, 4)
        .reshape(batch, slot.shard.local_seq_len, world * heads, head_dim)
        for slot in layout.slots
        if not slot.kv_only
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


def attend_rows(
    backend: AttentionBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row_keys: Sequence[Sequence[tuple[int, int]]],
) -> torch.Tensor:
    """Dense attention per batch row, each row's queries over its own key spans ([B, L, H, D] each).

    Rows whose prompts differ in length share every other op of a forward; here each runs the dense
    kernel over exactly the keys it would have alone (a span is a view; several are joined in order).
    """
    if len(row_keys) != query.shape[0]:
        raise ValueError(f"{len(row_keys)} rows of key spans for a batch of {query.shape[0]}")
    outs = []
    for row, spans in enumerate(row_keys):
        k, v = key[row : row + 1], value[row : row + 1]
        if len(spans) == 1:
            ((start, end),) = spans
            k, v = k[:, start:end], v[:, start:end]
        else:
            k = torch.cat([k[:, start:end] for start, end in spans], dim=1)
            v = torch.cat([v[:, start:end] for start, end in spans], dim=1)
        outs.append(backend(query[row : row + 1], k, v))
    return torch.cat(outs)


def _joint_buffer(recv: torch.Tensor, layout: JointLayout, reference: ReferenceKV | None, rows: int) -> torch.Tensor:
    """q, k, v of the joint sequence, [3, B, rows, H/P, D]: each exchanged stream copied from `recv` to its joint
    offset, in order (a stream's padding and filler rows are copied too and overwritten by the next stream's
    rows), and a kept stream's keys and values from `reference`."""
    world, _, batch, _, heads, head_dim = recv.shape
    joint = recv.new_empty(3, batch, rows, heads, head_dim)
    for slot in layout.slots:
        if not slot.exchanged:
            continue
        n, start, offset = slot.shard.local_seq_len, slot.local_start, slot.joint_offset
        dst = joint[:, :, offset : offset + world * n].view(3, batch, world, n, heads, head_dim)
        dst.copy_(recv[:, :, :, start : start + n].permute(1, 2, 0, 3, 4, 5))
    for index, slot in enumerate(layout.slots):
        if slot.exchanged:
            continue
        if reference is None or not reference.filled:
            raise ValueError(f"the kept {slot.name} stream needs the filled ReferenceKV that holds its keys and values")
        start, end = layout.span(index)
        expected = (batch, end - start, heads, head_dim)
        if tuple(reference.key.shape) != expected:
            raise ValueError(
                f"kept reference keys have shape {tuple(reference.key.shape)}, this layout needs {expected}: "
                "they were kept under another sequence-parallel layout; extract them again"
            )
        joint[1, :, start:end] = reference.key
        joint[2, :, start:end] = reference.value
    return joint


def _send_back(out: torch.Tensor, layout: JointLayout, first: int) -> torch.Tensor:
    """The head->seq all-to-all's send buffer [P, B, S_local, H/P, D] from the output `out` of the joint rows
    from `first` on (query streams only; rows past the queries read whatever `out` holds there)."""
    batch, _, heads, head_dim = out.shape
    world = layout.world_size
    if first + out.shape[1] < layout.buffer_len:
        out = torch.nn.functional.pad(out, (0, 0, 0, 0, 0, layout.buffer_len - first - out.shape[1]))
    send = out.new_empty(world, batch, layout.query_local_len, heads, head_dim)
    for slot in layout.slots:
        if slot.kv_only:
            continue
        n, start, offset = slot.shard.local_seq_len, slot.local_start, slot.joint_offset - first
        src = out[:, offset : offset + world * n].view(batch, world, n, heads, head_dim)
        send[:, :, start : start + n].copy_(src.permute(1, 0, 2, 3, 4))
    return send


def attend_joint(
    recv: torch.Tensor,
    layout: JointLayout,
    backend: AttentionBackend,
    reference: ReferenceKV | None = None,
    text_blocks: TextBlocks | None = None,
) -> torch.Tensor:
    """A rank's work between the two all-to-alls.

    `recv` [P, 3, B, S_local, H/P, D] holds q, k, v from every rank (rank-local streams side
    by side). Each exchanged stream is copied to its joint offset (one copy per stream, as in
    every mode), the kernel runs for the query rows, and its output is written straight into
    the [P, B, S_local, H/P, D] buffer the reverse all-to-all sends (query streams only).

    `reference` (a kept reference stream): filled, it holds the keys and values of the layout's kept stream,
    copied to its joint rows. Empty, the layout's first stream is the reference stream with queries:
    its rows attend only to themselves, in a second kernel call, and their keys and values are kept
    in it for the later steps.

    `text_blocks` ([text, image] only): the image rows attend to every key as usual, the text rows
    to the text's own, block-causally.
    """
    if layout.row_keys is not None and (reference is not None or text_blocks is not None):
        raise ValueError("rows with text of different lengths share no forward with a reference stream or text_blocks")
    joint = _joint_buffer(recv, layout, reference, layout.buffer_len)
    first, reference_out = layout.query_start, None
    if reference is not None and not reference.filled:
        _, first = layout.span(0)  # the reference rows; every later row is a query over all keys
        mask = None if layout.key_mask is None else layout.key_mask[..., :first]
        reference.key, reference.value = joint[1:, :, :first].clone().unbind(0)
        reference_out = backend(joint[0, :, :first], reference.key, reference.value, mask)
    kv = joint[1:, :, : layout.kv_len]
    if layout.row_keys is not None:
        out = attend_rows(backend, joint[0, :, first : layout.query_len], kv[0], kv[1], layout.row_keys)
    elif text_blocks is None:
        out = backend(joint[0, :, first : layout.query_len], kv[0], kv[1], layout.key_mask)
    else:
        # The text's rows end where the image's begin: its true tokens (trim) or all with its padding.
        text_end = layout.slots[1].joint_offset
        image_out = backend(joint[0, :, text_end : layout.query_len], kv[0], kv[1], layout.key_mask)
        out = torch.cat([attend_text_blocks(*joint[:, :, :text_end], text_blocks), image_out], dim=1)
    if reference_out is not None:
        out, first = torch.cat([reference_out, out], dim=1), 0
    return _send_back(out, layout, first)


class PartialAttention:
    """Ring attention's running result for a set of query rows: the output so far, in fp32, and its log-sum-exp.

    Each key/value block's (output, lse) is merged in: out = sum_b out_b * exp(lse_b - lse), lse = log sum_b
    exp(lse_b). A row that a block gave no key (lse -inf, output 0) is left as it was."""

    def __init__(self) -> None:
        self.out: torch.Tensor | None = None  # [B, L, H, D] fp32
        self.lse: torch.Tensor | None = None  # [B, L, H, 1] fp32

    def add(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        lse = lse.transpose(1, 2).unsqueeze(-1)
        if self.out is None:
            self.out, self.lse = out.to(torch.float32, copy=True), lse
            return
        new = torch.logaddexp(self.lse, lse)
        base = new.masked_fill(torch.isneginf(new), 0)  # rows no block gave a key yet: weights stay 0
        self.out.mul_(torch.exp(self.lse - base)).addcmul_(out, torch.exp(lse - base))
        self.lse = new

    def result(self, like: torch.Tensor) -> torch.Tensor:
        """The merged output in `like`'s dtype and shape (zeros where no block ran: rows past every key)."""
        return torch.zeros_like(like) if self.out is None else self.out.to(like.dtype)


def attend_rows_lse(
    backend: AttentionBackend,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    row_keys: Sequence[Sequence[tuple[int, int]]],
) -> tuple[torch.Tensor, torch.Tensor]:
    """`attend_rows` with the log-sum-exp: each batch row's queries over its own key spans, a row without
    keys giving output 0 and lse -inf."""
    if len(row_keys) != query.shape[0]:
        raise ValueError(f"{len(row_keys)} rows of key spans for a batch of {query.shape[0]}")
    outs, lses = [], []
    for row, spans in enumerate(row_keys):
        q = query[row : row + 1]
        if not spans:
            outs.append(torch.zeros_like(q))
            lses.append(q.new_full((1, q.shape[2], q.shape[1]), float("-inf"), dtype=torch.float32))
            continue
        k, v = key[row : row + 1], value[row : row + 1]
        if len(spans) == 1:
            ((start, end),) = spans
            k, v = k[:, start:end], v[:, start:end]
        else:
            k = torch.cat([k[:, start:end] for start, end in spans], dim=1)
            v = torch.cat([v[:, start:end] for start, end in spans], dim=1)
        out, lse = backend.with_lse(q, k, v)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def _attend_block(
    backend: AttentionBackend, query: torch.Tensor, kv: torch.Tensor, block: JointLayout, end: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """`query` over one ring block's keys and values `kv` [2, B, rows, H, D], as the block's layout lets it see
    them: up to `kv_len` (trim: the valid rows only, a view), with its mask (mask mode), or per row (rows with
    text of different lengths). `end`: only the keys before that row (a reference stream's own)."""
    if end is not None:
        mask = None if block.key_mask is None else block.key_mask[..., :end]
        return backend.with_lse(query, kv[0, :, :end], kv[1, :, :end], mask)
    key, value = kv[0, :, : block.kv_len], kv[1, :, : block.kv_len]
    if block.row_keys is not None:
        return attend_rows_lse(backend, query, key, value, block.row_keys)
    return backend.with_lse(query, key, value, block.key_mask)


def attend_ring(
    recv: torch.Tensor,
    ring: RingLayout,
    backend: AttentionBackend,
    group: object,
    reference: ReferenceKV | None = None,
    text_blocks: TextBlocks | None = None,
) -> torch.Tensor:
    """`attend_joint` under ring attention: a rank's work between the two Ulysses all-to-alls (over its Ulysses
    group; `recv` as there, P = the Ulysses degree).

    The rank's joint buffer holds its ring block of every stream (`ring.own`): its queries stay; its keys and
    values go around the ring `group`, one block a step, each step's send/recv started before the block at hand
    is computed. Each block runs the dense kernel on the rows its layout lets queries see (trim: sliced to the
    valid rows, so no masked kernel runs), and the partial results merge in fp32 through their log-sum-exp.
    Every stream's rows, text included, are in exactly one block, so every key counts once.

    A reference stream's queries (first step) merge apart, over each block's reference rows only; a kept one's
    keys and values are this rank's block of it. `text_blocks`: the text rows attend block-causally to the text
    alone, which the ring group all-gathers (the text is short; every ring rank computes it whole and keeps its
    rows); the image rows go around the ring as usual.
    """
    layout = ring.own
    world, _, batch, _, heads, head_dim = recv.shape
    joint = _joint_buffer(recv, layout, reference, ring.buffer_len)
    first, ref_query, ref_partial, text_out = layout.query_start, None, None, None
    if reference is not None and not reference.filled:
        _, first = layout.span(0)
        reference.key, reference.value = joint[1:, :, :first].clone().unbind(0)
        ref_query, ref_partial = joint[0, :, :first], PartialAttention()
    if text_blocks is not None:
        text, first = layout.slots[0], layout.slots[1].joint_offset
        n, start = text.shard.local_seq_len, text.local_start
        mine = recv[:, :, :, start : start + n].permute(1, 2, 0, 3, 4, 5).reshape(3, batch, world * n, heads, head_dim)
        whole = torch.cat(all_gather(mine, group), dim=2)  # the text in order, padding at its tail
        offset = ring.rank * world * n
        text_out = attend_text_blocks(*whole, text_blocks)[:, offset : offset + first]
    query = joint[0, :, first : layout.query_len]
    partial = PartialAttention()
    kv = joint[1:]
    spare = torch.empty_like(kv) if len(ring.blocks) > 1 else None
    for step in range(len(ring.blocks)):
        source = (ring.rank - step) % len(ring.blocks)
        block = ring.blocks[source]
        # Start the next block's send/recv first: it travels while this one is computed.
        pending = ring_pass(kv, spare, group, ring.rank) if step + 1 < len(ring.blocks) else None
        if block.visible_keys:
            partial.add(*_attend_block(backend, query, kv, block))
        if ref_partial is not None:
            _, end = block.span(0)
            if block.slots[0].shard.original_seq_len if block.key_mask is not None else end:
                ref_partial.add(*_attend_block(backend, ref_query, kv, block, end))
        if pending is not None:
            pending.wait()
            kv, spare = spare, kv
    out = partial.result(query)
    if text_out is not None:  # the text's rows come first: the output starts at joint row 0
        out, first = torch.cat([text_out, out], dim=1), 0
    if ref_partial is not None:
        out, first = torch.cat([ref_partial.result(ref_query), out], dim=1), 0
    return _send_back(out, layout, first)


class JointAttention(nn.Module):
    """Joint attention over [image] or [text, image] ("front") / [image, text] ("rear").

    `stream`: the stream that `query`, `key` and `value` belong to: the image (default), or any other stream
    alone, with no `text_qkv` (`TEXT`: self-attention within the text stream; an audio stream's own).
    """

    kind = "joint"

    def __init__(self, text_position: Literal["front", "rear"] = "front", stream: str = IMAGE) -> None:
        super().__init__()
        if text_position not in ("front", "rear"):
            raise ValueError(f"text_position must be 'front' or 'rear', got {text_position!r}")
        if not stream:
            raise ValueError("stream must name the token stream the queries belong to")
        self.text_position = text_position
        self.stream = stream

    # Compiled transformer blocks (cuda_graphs.compile_repeated_blocks) run this layer eagerly:
    # the all-to-alls and the per-forward layout stay as written, and compiled code sees no collective.
    @torch.compiler.disable
    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        text_qkv: QKV | None = None,
        kv_streams: Sequence[tuple[str, torch.Tensor, torch.Tensor]] = (),
        text_blocks: TextBlocks | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Return the attention output of `stream` (the image's, by default) and of the text stream (None
        without `text_qkv`).

        `kv_streams`: (stream, key, value) of kv-only streams, joined in front of the others and exchanged
        (each recorded in the SP context, `record_sharded_stream`; rank-local sequence shards under SP).
        `text_blocks`: the text stream attends only to itself, in these runs (see `TextBlocks`)."""
        if text_blocks is not None and (text_qkv is None or self.text_position != "front" or kv_streams):
            raise ValueError("text_blocks needs a text stream joined in front of the image, and no kv-only streams")
        streams: dict[str, tuple] = {self.stream: (query, key, value)}
        if text_qkv is not None:
            if self.stream != IMAGE:
                raise ValueError(
                    f"text_qkv joins a text stream to the image stream; this layer attends within the "
                    f"{self.stream} stream"
                )
            streams[TEXT] = text_qkv
        if text_qkv is None:
            order = [self.stream]
        else:
            order = [TEXT, IMAGE] if self.text_position == "front" else [IMAGE, TEXT]
        for name, k, v in kv_streams:
            streams[name] = (None, k, v)
        order = [name for name, _, _ in kv_streams] + order
        by_name = self._attend(order, streams, text_blocks=text_blocks)
        return by_name[self.stream], by_name[TEXT] if text_qkv is not None else None

    @torch.compiler.disable
    def attend_reference(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        text_qkv: QKV | None,
        reference: ReferenceKV,
        reference_qkv: QKV | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """The reference KV mode: joint attention over [reference, text, image], the reference tokens
        attending only to each other. With `reference_qkv` (the first step, `reference` empty) their
        keys and values are kept in `reference`; without (later steps) `reference`'s are used, a kept
        kv-only stream, and the reference tokens are not computed at all. Returns the image, text and
        reference outputs (reference: None on later steps)."""
        if self.text_position != "front" or self.stream != IMAGE:
            raise ValueError("the reference stream joins in front of the text and image: text_position must be 'front'")
        if reference.filled == (reference_qkv is not None):
            raise ValueError("give reference_qkv with an empty ReferenceKV (first step), or a filled one alone")
        streams: dict[str, tuple] = {IMAGE: (query, key, value)}
        if text_qkv is not None:
            streams[TEXT] = text_qkv
        streams[REFERENCE] = reference_qkv if reference_qkv is not None else (None, reference.key, reference.value)
        order = [REFERENCE, *([TEXT] if text_qkv is not None else []), IMAGE]
        by_name = self._attend(order, streams, reference)
        return by_name[IMAGE], by_name.get(TEXT), by_name.get(REFERENCE)

    def _attend(
        self,
        order: list[str],
        streams: dict[str, tuple],
        reference: ReferenceKV | None = None,
        text_blocks: TextBlocks | None = None,
    ) -> dict[str, torch.Tensor]:
        """Outputs of the streams in `order` that have queries, by name (`streams`: name -> (q or None, k, v))."""
        queried = [name for name in order if streams[name][0] is not None]
        ctx = get_sp_context()
        if ctx is None or not ctx.enabled:
            outs = self._attend_single_process(ctx, order, streams, reference, text_blocks)
        else:
            outs = self._attend_sequence_parallel(ctx, order, streams, reference, text_blocks)
        return dict(zip(queried, outs))

    @staticmethod
    def _attend_single_process(
        ctx: SequenceParallelContext | None,
        order: list[str],
        streams: dict[str, tuple],
        reference: ReferenceKV | None = None,
        text_blocks: TextBlocks | None = None,
    ) -> list[torch.Tensor]:
        backend = resolve_attention_backend(needs_mask=False)
        reference_out = None
        if reference is not None and not reference.filled:
            # The first step: the reference rows attend to themselves alone; for every later query
            # the reference stream is kv-only, its keys and values kept for the next steps.
            ref_query, ref_key, ref_value = streams[REFERENCE]
            reference.key, reference.value = ref_key.clone(), ref_value.clone()
            reference_out = backend(ref_query, reference.key, reference.value)
            streams = {**streams, REFERENCE: (None, reference.key, reference.value)}
        ordered = [streams[name] for name in order]
        queries = [q for q, _, _ in ordered if q is not None]
        if text_blocks is not None:  # the text's rows attend to its own keys alone, below
            queries = [streams[IMAGE][0]]
        query = torch.cat(queries, dim=1)
        # A stream's filler (shard_with_auto_pad's valid_len) is cut from keys and values: exact, dense.
        # Only a tensor of the stream's recorded length carries it (fused single-stream
        # blocks pass [text, image] as one stream, which has no filler). Rows with their own true
        # lengths see each their own: the kernel runs per row.
        kept, row_lens = [], {}
        for name, (_, k, _) in zip(order, ordered):
            shard = ctx.streams.get(name) if ctx is not None else None
            recorded = shard is not None and k.shape[1] == shard.seq_len
            if recorded and shard.row_lens is not None:
                row_lens[len(kept)] = shard.row_lens
            kept.append(shard.original_seq_len if recorded and shard.filler_len > 0 else k.shape[1])
        if row_lens:
            if reference_out is not None or text_blocks is not None:
                raise ValueError("rows with text of different lengths share no forward with a reference or text_blocks")
            lens = [row_lens.get(i, (n,) * query.shape[0]) for i, n in enumerate(kept)]
            starts = itertools.accumulate((k.shape[1] for _, k, _ in ordered[:-1]), initial=0)
            spans = [(start, n) for start, n in zip(starts, lens)]
            row_keys = [[(start, start + n[row]) for start, n in spans] for row in range(query.shape[0])]
            key, value = (torch.cat([stream[i] for stream in ordered], dim=1) for i in (1, 2))
            out = attend_rows(backend, query, key, value, row_keys)
        else:
            key = torch.cat([k[:, :n] for (_, k, _), n in zip(ordered, kept)], dim=1)
            value = torch.cat([v[:, :n] for (_, _, v), n in zip(ordered, kept)], dim=1)
            out = backend(query, key, value)
        if text_blocks is not None:  # block-causal over the text alone (its filler: the causal tail)
            return [attend_text_blocks(*streams[TEXT], text_blocks), out]
        outs = list(out.split([q.shape[1] for q in queries], dim=1))
        return outs if reference_out is None else [reference_out, *outs]

    @staticmethod
    def _attend_sequence_parallel(
        ctx: SequenceParallelContext,
        order: list[str],
        streams: dict[str, tuple],
        reference: ReferenceKV | None = None,
        text_blocks: TextBlocks | None = None,
    ) -> list[torch.Tensor]:
        """Ulysses (`ring_degree` 1): all-to-all over the SP group, `attend_joint`, all-to-all back. USP: the
        all-to-alls over the Ulysses group (none at Ulysses 1) and `attend_ring` between them."""
        query = next(streams[name][0] for name in order if streams[name][0] is not None)
        if query.shape[2] % ctx.ulysses_degree:
            raise ValueError(
                f"ulysses_degree={ctx.ulysses_degree} must divide the number of attention heads ({query.shape[2]})"
            )
        # A filled reference is kept: each rank already holds its heads' keys and values; other kv-only
        # streams are this rank's sequence shards, exchanged like the query streams.
        kept = (REFERENCE,) if reference is not None and reference.filled else ()
        kv_only = [name for name in order if streams[name][0] is None and name not in kept]
        if ctx.ring_degree == 1:
            layout = ctx.joint_layout(order, query.device, query.dtype, kv_only, kept)
            recv = all_to_all(pack_streams(layout, streams), ctx.group)
            backend = resolve_attention_backend(needs_mask=layout.key_mask is not None)
            back = all_to_all(attend_joint(recv, layout, backend, reference, text_blocks), ctx.group)
            return unpack_streams(layout, back)
        ring = ctx.ring_layout(order, query.device, query.dtype, kv_only, kept)
        layout = ring.own
        send = pack_streams(layout, streams)
        recv = send if ctx.ulysses_group is None else all_to_all(send, ctx.ulysses_group)
        backend = resolve_attention_backend(needs_mask=ring.needs_mask)
        back = attend_ring(recv, ring, backend, ctx.ring_group, reference, text_blocks)
        if ctx.ulysses_group is not None:
            back = all_to_all(back, ctx.ulysses_group)
        return unpack_streams(layout, back)


class CrossAttention(nn.Module):
    """Attention of a rank's query shard to keys and values every rank holds in full (see the module doc)."""

    kind = "cross"

    @torch.compiler.disable  # like JointAttention: the kernel choice stays outside compiled blocks
    def forward(
        self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`key_mask`: an additive [B or 1, 1, 1, keys] bias the model gives for its own masked keys (a prompt's
        padding), None: every key counts."""
        # Every query row attends to the same whole keys, so a rank's rows need nothing from its peers;
        # there is no SP padding to hide (the keys are not sharded), hence the dense kernel in every mode.
        # Exact even under a lossy backend: a rank's query shard would give FP8 scales unlike U1's, and the
        # few keys (a padded prompt's few hundred tokens) make it a small share of the attention time.
        backend = resolve_attention_backend(needs_mask=key_mask is not None, allow_low_precision=False)
        return backend(query, key, value, key_mask)


class StreamCrossAttention(nn.Module):
    """Queries of one sharded stream over the keys and values of another sharded stream (see the module doc).

    `query_stream` and `kv_stream` name the streams as `shard_with_auto_pad` recorded them; `query` is the rank's
    shard of the first, `key` and `value` of the second ([B, S_local, H, D] each, the same heads).
    """

    kind = "stream_cross"

    def __init__(self, query_stream: str, kv_stream: str) -> None:
        super().__init__()
        if query_stream == kv_stream:
            raise ValueError("a stream attending to itself is a JointAttention")
        self.query_stream, self.kv_stream = query_stream, kv_stream

    @torch.compiler.disable  # like JointAttention: the all-to-alls and the layout stay outside compiled blocks
    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
        ctx = get_sp_context()
        if ctx is None or not ctx.enabled:
            # One process: the key stream's filler, if it has any, is cut as in a joint attention.
            shard = ctx.streams.get(self.kv_stream) if ctx is not None else None
            if shard is not None and shard.filler_len and key.shape[1] == shard.seq_len:
                key, value = key[:, : shard.original_seq_len], value[:, : shard.original_seq_len]
            return resolve_attention_backend(needs_mask=False)(query, key, value)
        return self._attend_ulysses(ctx, query, key, value)

    def _attend_ulysses(
        self, ctx: SequenceParallelContext, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
    ) -> torch.Tensor:
        world = ctx.world_size
        batch, n_q, heads, head_dim = query.shape
        n_kv = key.shape[1]
        if heads % world or key.shape[2] != heads:
            # Under ring attention too the heads are exchanged over the whole SP group (ulysses x ring ranks).
            raise ValueError(
                f"cross-stream attention exchanges heads over all {world} sequence-parallel ranks (ulysses_degree x "
                f"ring_degree): it must divide the number of attention heads ({heads}), the same for keys "
                f"({key.shape[2]})"
            )
        # The layout of [keys, queries], the key stream kv-only: its span is what the queries may see.
        layout = ctx.joint_layout([self.kv_stream, self.query_stream], query.device, query.dtype, [self.kv_stream])
        if any(slot.shard.row_lens is not None for slot in layout.slots):
            raise ValueError("rows of different true lengths share no cross-stream attention")
        kv_slot, q_slot = layout.slots
        if (kv_slot.shard.local_seq_len, q_slot.shard.local_seq_len) != (n_kv, n_q):
            raise ValueError(
                f"{self.query_stream} / {self.kv_stream} streams have {n_q} / {n_kv} local tokens, expected "
                f"{q_slot.shard.local_seq_len} / {kv_slot.shard.local_seq_len}: shard them with shard_with_auto_pad"
            )
        local_heads = heads // world
        # One exchange: [q rows, k rows, v rows] of this rank, head group p to rank p.
        send = query.new_empty(world, batch, n_q + 2 * n_kv, local_heads, head_dim)
        for start, tensor in ((0, query), (n_q, key), (n_q + n_kv, value)):
            rows = tensor.shape[1]
            send[:, :, start : start + rows].copy_(
                tensor.reshape(batch, rows, world, local_heads, head_dim).permute(2, 0, 1, 3, 4)
            )
        recv = all_to_all(send, ctx.group)

        def whole(start: int, rows: int) -> torch.Tensor:  # every rank's rows in order: the padded stream
            return recv[:, :, start : start + rows].transpose(0, 1).reshape(batch, world * rows, local_heads, head_dim)

        kv_end = layout.slots[1].joint_offset  # the key stream's true length (trim), else its padded length
        q_all, k_all, v_all = whole(0, n_q), whole(n_q, n_kv)[:, :kv_end], whole(n_q + n_kv, n_kv)[:, :kv_end]
        mask = None
        if layout.key_mask is not None and kv_slot.shard.pad_size:  # mask mode, keys with padding
            mask = layout.key_mask[..., :kv_end]
        out = resolve_attention_backend(needs_mask=mask is not None)(q_all, k_all, v_all, mask)
        back = all_to_all(out.view(batch, world, n_q, local_heads, head_dim).transpose(0, 1).contiguous(), ctx.group)
        return back.permute(1, 2, 0, 3, 4).reshape(batch, n_q, heads, head_dim)
