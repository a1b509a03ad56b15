"""Sequence-parallel sharding and the SP padding policy: the one place that decides it.

A model opens `sequence_parallel_context()` once per forward, shards each token stream
with `shard_with_auto_pad(x, dim, stream)` and gathers its output with
`gather_sequence`. When the SP degree does not divide a stream's length, the stream is
padded with zeros at its global tail and the pad size and original length are recorded
in the context. The attention layer asks the context for a `JointLayout`, which says
where each stream sits in the joint sequence and what attention may see of it:

- ``mask``: padded sequence plus a key-padding mask (exact; masked kernel). The mask is
  built only in this mode, once per forward.
- ``trim``: keys and values stop at the true lengths, so padding never reaches a real
  token (exact; dense kernel). Queries keep the padded layout, so the output lands in the
  layout the reverse all-to-all needs with no extra copy.
- ``none``: dense attention over the padding, unmasked; approximate, warns once.

A stream may also end in tokens the model itself wants dropped (a text-length bucket's
filler, text_compaction.py): `shard_with_auto_pad(x, dim, TEXT, valid_len=n)` records n as
the stream's true length, and the filler is treated like its SP padding, except that it is
cut from keys and values in ``none`` mode too (and in a single process, in every mode).
Rows of a batch may end their true tokens at different lengths (`valid_len=(n0, n1, ...)`,
prompts of different lengths in one forward): the layout then says what each row's queries
may see, its own true tokens only: `row_keys` (the kernel runs per row; trim and none) or a
per-row key mask (mask mode).

A stream may give keys and values only (*kv-only*: no queries, no output), cached by an earlier
forward that sharded it; `record_sharded_stream` records its length, and the layout puts it in
front of the query streams, under the same policy. Its keys and values reach attention one of two
ways: *exchanged* every forward through the seq->head all-to-all from each rank's sequence shard
(a condition image, `kv_only=`), or *kept*: held by attention since an earlier forward's
all-to-all, as each rank's heads over the whole stream, and not exchanged again (a reference stream's
reference tokens, `kept=`). Either way the stream sits at the joint offset it had when exchanged.

Ring attention (``ring_degree`` > 1, beside Ulysses: USP) applies the same policy per key/value
block. A Ulysses group's all-to-all leaves each of its ranks one contiguous block of every stream
(ring rank r holds rows [r * U * n, (r + 1) * U * n) of a stream whose rank-local length is n, for
its U-th of the heads); the blocks circulate around the ring. `ring_layout` describes each ring
rank's block as a `JointLayout` of the streams' rows in that block (its `StreamShard`s clamped to
the block), built by the same code as the Ulysses layout: in trim mode a block that holds padding
or filler is cut at its true rows (the padding lands in the last blocks, so most blocks are whole),
mask mode masks them, none mode keeps the SP padding unmasked and warns once. Every rank knows every
block's valid rows from host ints, so no lengths travel with the blocks.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.diffusion.config import DiffusionParallelConfig, PaddingMode
from vllm_omni.diffusion.distributed.comm import SimulatedGroup, all_gather
from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

IMAGE = "image"  # the image or video tokens
TEXT = "text"
REFERENCE = "reference"  # the reference images' tokens (reference KV mode), a kept kv-only stream after the first step


@dataclass(frozen=True)
class StreamShard:
    """How one token stream is split: its true length, padding and per-rank length."""

    original_seq_len: int  # the tokens attention keeps and gather returns
    pad_size: int  # everything after them: the tensor's own filler, then SP zeros
    world_size: int
    filler_len: int = 0  # of pad_size, tokens the sharded tensor already carries (valid_len < its length)
    # Each row's true length where the rows of the batch differ (original_seq_len is their longest); None: alike.
    row_lens: tuple[int, ...] | None = None

    @property
    def seq_len(self) -> int:
        """Length of the tensors sharded for this stream (true length plus filler)."""
        return self.original_seq_len + self.filler_len

    @property
    def padded_seq_len(self) -> int:
        return self.original_seq_len + self.pad_size

    @property
    def local_seq_len(self) -> int:
        return self.padded_seq_len // self.world_size

    def row_len(self, row: int) -> int:
        """The true length of batch row `row`."""
        return self.original_seq_len if self.row_lens is None else self.row_lens[row]


@dataclass(frozen=True)
class StreamSlot:
    """Where one stream sits: in a rank's local joint sequence, and in the joint buffer after the all-to-all."""

    name: str
    shard: StreamShard
    local_start: int  # offset in the rank-local [stream, stream] sequence that is exchanged
    joint_offset: int  # offset of the stream's first token in the joint attention buffer
    kv_only: bool = False  # gives keys and values, no queries (a cached condition or reference)
    exchanged: bool = True  # False: a kept kv-only stream, whose keys and values attention already holds


@dataclass(frozen=True)
class JointLayout:
    """The joint sequence attention runs over after the seq->head all-to-all.

    Each stream is copied, padding included, to `joint_offset`. A stream cut at its true
    length (every stream in trim mode; in none mode, one that carries filler) is followed
    at its true end, so the next stream's copy overwrites its padding and only the last
    stream's padding remains, past `kv_len`. Queries span [`query_start`, `query_len`) (the
    kv-only streams come first, locally after the query streams, so the way back
    carries only rows with queries); keys and values span `kv_len`. A kept stream sits at its
    offset like an exchanged one but takes no local rows.
    """

    slots: tuple[StreamSlot, ...]  # in joint order
    world_size: int
    query_len: int
    kv_len: int
    key_mask: torch.Tensor | None  # additive [1 or B, 1, 1, query_len] bias, mask mode only
    query_start: int = 0
    # Where rows differ in a stream's true length (trim, none): per row, the joint [start, end) spans its
    # queries may see as keys, adjacent spans merged. None: every row sees keys [0, kv_len).
    row_keys: tuple[tuple[tuple[int, int], ...], ...] | None = None

    @property
    def buffer_len(self) -> int:
        """Rows of the joint buffer: the queries' rows, or more where a cut stream's padding copy reaches past
        them (text filler longer than a tiny image)."""
        exchanged = (s.joint_offset + self.world_size * s.shard.local_seq_len for s in self.slots if s.exchanged)
        return max(self.query_len, *exchanged)

    @property
    def visible_keys(self) -> int:
        """Key rows that a query may see (0: none; the kernel need not run): `kv_len`, less what the mask hides."""
        if self.key_mask is None:
            return self.kv_len
        return sum(slot.shard.original_seq_len for slot in self.slots)

    @property
    def local_len(self) -> int:
        """Rank-local rows the seq->head all-to-all sends: every stream's shard but the kept ones'."""
        return sum(slot.shard.local_seq_len for slot in self.slots if slot.exchanged)

    @property
    def query_local_len(self) -> int:
        """Rank-local rows of the streams with queries: what the head->seq all-to-all sends back."""
        return sum(slot.shard.local_seq_len for slot in self.slots if not slot.kv_only)

    def span(self, index: int) -> tuple[int, int]:
        """Joint rows [start, end) of stream `index` up to the next stream's (a stream cut at its true
        length ends there; one that is not carries its padding, which the mask, if any, hides)."""
        slot = self.slots[index]
        if index + 1 < len(self.slots):
            return slot.joint_offset, self.slots[index + 1].joint_offset
        return slot.joint_offset, self.kv_len


@dataclass(frozen=True)
class RingLayout:
    """Ring attention's layout: each ring rank's key/value block as a `JointLayout` over the rows of every stream
    that block holds (world size: the Ulysses degree), and which block is this rank's.

    A block's layout is what the Ulysses layout would be if the block were the whole sequence: a stream cut at
    its true rows in the block (trim; and a stream's own filler in none mode), masked there (mask), or kept whole
    (none). The blocks differ only where padding or filler lands, in the last ring ranks' blocks.
    """

    blocks: tuple[JointLayout, ...]  # by ring rank
    rank: int  # this rank's place in the ring

    @property
    def own(self) -> JointLayout:
        return self.blocks[self.rank]

    @property
    def buffer_len(self) -> int:
        """Rows of every block's key/value buffer: the same on every ring rank, so the send/recv shape is fixed."""
        return max(block.buffer_len for block in self.blocks)

    @property
    def needs_mask(self) -> bool:
        return any(block.key_mask is not None for block in self.blocks)


@dataclass
class SequenceParallelContext:
    """Per-forward SP state: group, policy, and the streams sharded so far.

    `group` is the whole SP group (ulysses_degree x ring_degree ranks: sharding, gathers, sums); attention
    exchanges heads over `ulysses_group` and passes key/value blocks around `ring_group` (None where that
    degree is 1; with ring_degree 1 the all-to-all uses `group`)."""

    group: Any  # a torch ProcessGroup, a SimulatedGroup, or None for one rank
    world_size: int
    rank: int
    ulysses_degree: int
    ring_degree: int
    padding_mode: PaddingMode
    ulysses_group: Any = None
    ring_group: Any = None
    streams: dict[str, StreamShard] = field(default_factory=dict)
    _layouts: dict[tuple, JointLayout | RingLayout] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def ring_rank(self) -> int:
        return self.rank // self.ulysses_degree

    @property
    def ulysses_rank(self) -> int:
        return self.rank % self.ulysses_degree

    def record_stream(self, stream: str, seq_len: int, valid_len: int | Sequence[int] | None = None) -> StreamShard:
        """Record a stream of `seq_len` tokens of which the first `valid_len` (default all) are real; a sequence
        gives each batch row's own."""
        row_lens = None
        if valid_len is not None and not isinstance(valid_len, int):
            row_lens = tuple(int(n) for n in valid_len)
            valid_len = max(row_lens) if row_lens else seq_len
            if len(set(row_lens)) == 1:
                row_lens = None
        true_len = seq_len if valid_len is None else valid_len
        if not 0 <= true_len <= seq_len or (row_lens and min(row_lens) < 0):
            raise ValueError(f"valid_len must be in [0, {seq_len}] for the {stream} stream, got {valid_len}")
        shard = self.streams.get(stream)
        if shard is None:
            padded = math.ceil(seq_len / self.world_size) * self.world_size
            shard = StreamShard(true_len, padded - true_len, self.world_size, seq_len - true_len, row_lens)
            self.streams[stream] = shard
            self._layouts.clear()
        elif (
            shard.seq_len != seq_len
            or (valid_len is not None and valid_len != shard.original_seq_len)
            or (row_lens is not None and row_lens != shard.row_lens)
        ):
            raise ValueError(
                f"{stream} stream was sharded with {shard.seq_len} tokens ({shard.original_seq_len} real), now "
                f"with {seq_len} ({true_len} real): tensors that travel with a stream must have its length"
            )
        return shard

    def joint_layout(
        self,
        order: Sequence[str],
        device: torch.device,
        dtype: torch.dtype,
        kv_only: Sequence[str] = (),
        kept: Sequence[str] = (),
    ) -> JointLayout:
        """The layout for streams joined in `order`, the kv-only ones first: `kv_only` exchanged, `kept`
        (kv-only too) not; computed once per forward and reused by every layer."""
        key = (tuple(order), tuple(kv_only), tuple(kept), device, dtype)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._build_layout(order, device, dtype, frozenset(kv_only) | frozenset(kept), frozenset(kept))
            self._layouts[key] = layout
        return layout

    def ring_layout(
        self,
        order: Sequence[str],
        device: torch.device,
        dtype: torch.dtype,
        kv_only: Sequence[str] = (),
        kept: Sequence[str] = (),
    ) -> RingLayout:
        """`joint_layout`'s counterpart under ring attention: every ring rank's block (see `RingLayout`); once
        per forward."""
        key = ("ring", tuple(order), tuple(kv_only), tuple(kept), device, dtype)
        layout = self._layouts.get(key)
        if layout is None:
            kv_only_set, kept_set = frozenset(kv_only) | frozenset(kept), frozenset(kept)
            blocks = tuple(
                self._build_layout(
                    order, device, dtype, kv_only_set, kept_set, self._block_streams(order, block), self.ulysses_degree
                )
                for block in range(self.ring_degree)
            )
            self._warn_unmasked(order)
            layout = self._layouts[key] = RingLayout(blocks, self.ring_rank)
        return layout

    def _block_streams(self, order: Sequence[str], block: int) -> dict[str, StreamShard]:
        """The streams' rows in ring rank `block`'s block: each stream's shard clamped to them."""
        streams = {}
        for name in order:
            shard = self.streams[name]
            rows = self.ulysses_degree * shard.local_seq_len
            start = block * rows
            true_len = _rows_in(shard.original_seq_len, start, rows)
            row_lens = None if shard.row_lens is None else tuple(_rows_in(n, start, rows) for n in shard.row_lens)
            filler = _rows_in(shard.seq_len, start, rows) - true_len
            streams[name] = StreamShard(true_len, rows - true_len, self.ulysses_degree, filler, row_lens)
        return streams

    def _cut_at_true_length(self, name: str) -> bool:
        # Trim cuts every stream; "none" still cuts a stream's own filler (a row's too), which is not SP padding.
        # Decided on the whole stream (a ring block past a stream's filler holds its SP padding alone: cut too).
        shard = self.streams[name]
        has_filler = shard.filler_len > 0 or shard.row_lens is not None
        return self.padding_mode == "trim" or (self.padding_mode == "none" and has_filler)

    def _warn_unmasked(self, order: Sequence[str]) -> None:
        """The one-time warning when SP padding reaches attention unmasked (none mode)."""
        if self.padding_mode != "none":
            return
        total_pad = sum(self.streams[name].pad_size for name in order if not self._cut_at_true_length(name))
        if not total_pad:
            return
        ring = f", ring_degree={self.ring_degree}" if self.ring_degree > 1 else ""
        logger.warning_once(
            "Attention sees unmasked SP padding: %d pad tokens on a sequence of %d real tokens "
            "(ulysses_degree=%d%s). Padding is not masked, which may change numerics slightly; set "
            "mask_sp_padding=True or trim_sp_padding=True for exact results.",
            total_pad,
            sum(self.streams[name].original_seq_len for name in order),
            self.ulysses_degree,
            ring,
        )

    def _build_layout(
        self,
        order: Sequence[str],
        device: torch.device,
        dtype: torch.dtype,
        kv_only: frozenset[str] = frozenset(),
        kept: frozenset[str] = frozenset(),
        streams: dict[str, StreamShard] | None = None,
        world_size: int | None = None,
    ) -> JointLayout:
        """The layout of `streams` (default: the recorded ones; a ring block's, `_block_streams`) joined in `order`
        after an all-to-all over `world_size` ranks (default: the SP group)."""
        block = streams is not None
        streams = self.streams if streams is None else streams
        world_size = self.world_size if world_size is None else world_size
        flags = [name in kv_only for name in order]
        if flags != sorted(flags, reverse=True) or all(flags):
            raise ValueError(f"streams without queries ({sorted(kv_only)}) must come first, before one with queries")
        for name in order:
            if name not in streams:
                raise RuntimeError(f"stream {name!r} reached attention without shard_with_auto_pad")
        # Locally the query streams come first, so the way back is a prefix of the way out; a kept
        # stream takes no local rows (its local_start is where it would be, unused).
        local_starts, local_start = {}, 0
        for name in sorted(order, key=lambda name: name in kv_only):
            local_starts[name] = local_start
            local_start += 0 if name in kept else streams[name].local_seq_len
        slots, joint_offset = [], 0
        for name in order:
            shard = streams[name]
            slot = StreamSlot(name, shard, local_starts[name], joint_offset, name in kv_only, name not in kept)
            slots.append(slot)
            joint_offset += shard.original_seq_len if self._cut_at_true_length(name) else shard.padded_seq_len
        query_start = next(slot.joint_offset for slot in slots if not slot.kv_only)
        last = slots[-1]
        query_len = last.joint_offset + last.shard.padded_seq_len
        kv_len = last.joint_offset + (
            last.shard.original_seq_len if self._cut_at_true_length(last.name) else last.shard.padded_seq_len
        )
        total_pad = sum(slot.shard.pad_size for slot in slots if not self._cut_at_true_length(slot.name))
        ragged = [slot.shard.row_lens for slot in slots if slot.shard.row_lens is not None]
        batch = len(ragged[0]) if ragged else 1
        if any(len(row_lens) != batch for row_lens in ragged):
            raise ValueError(f"streams give true lengths for different numbers of rows: {ragged}")

        key_mask, row_keys = None, None
        if self.padding_mode == "mask" and (total_pad or ragged):
            # Built on the device (no host copy), so a CUDA graph can capture it too; one row per batch row
            # where rows differ in a stream's true length.
            bias = torch.full((batch, query_len), float("-inf"), dtype=dtype, device=device)
            for row in range(batch):
                for slot in slots:
                    bias[row, slot.joint_offset : slot.joint_offset + slot.shard.row_len(row)] = 0
            key_mask = bias.view(batch, 1, 1, query_len)
        elif ragged:
            # Trim and none: each row's queries see its own true tokens of a ragged stream, densely.
            row_keys = tuple(self._row_key_spans(slots, row, kv_len) for row in range(batch))
        if not block:
            self._warn_unmasked(order)
        return JointLayout(tuple(slots), world_size, query_len, kv_len, key_mask, query_start, row_keys)

    def _row_key_spans(self, slots: Sequence[StreamSlot], row: int, kv_len: int) -> tuple[tuple[int, int], ...]:
        """The joint key spans batch row `row` sees in a cut mode: each stream to its (row's) true end."""
        spans = []
        for index, slot in enumerate(slots):
            if slot.shard.row_lens is not None:
                end = slot.joint_offset + slot.shard.row_lens[row]
            else:
                end = slots[index + 1].joint_offset if index + 1 < len(slots) else kv_len
            spans.append((slot.joint_offset, end))
        return merge_spans(spans)


def _rows_in(length: int, start: int, rows: int) -> int:
    """How many of a stream's first `length` rows fall in the block of `rows` rows from `start`."""
    return min(max(length - start, 0), rows)


def merge_spans(spans: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """`spans` ([start, end) in order) without empty ones, adjacent ones joined: one span is a view, no copy."""
    merged: list[tuple[int, int]] = []
    for start, end in spans:
        if end <= start:
            continue
        if merged and merged[-1][1] == start:
            merged[-1] = (merged[-1][0], end)
        else:
            merged.append((start, end))
    return tuple(merged)


_CONTEXT: contextvars.ContextVar[SequenceParallelContext | None] = contextvars.ContextVar(
    "vllm_omni_sp_context", default=None
)


def get_sp_context() -> SequenceParallelContext | None:
    """The context of the forward being run, or None outside `sequence_parallel_context`."""
    return _CONTEXT.get()


@contextlib.contextmanager
def use_sp_context(ctx: SequenceParallelContext) -> Iterator[SequenceParallelContext]:
    """Make `ctx` the current SP context (benchmarks use it to act as any rank of a simulated group)."""
    token = _CONTEXT.set(ctx)
    try:
        yield ctx
    finally:
        _CONTEXT.reset(token)


@contextlib.contextmanager
def sequence_parallel_context(
    config: DiffusionParallelConfig | None = None,
) -> Iterator[SequenceParallelContext]:
    """Open a fresh SP context for one forward; `config` overrides the worker's padding policy."""
    state = get_parallel_state()
    if state is None or state.sp_group is None:
        ctx = SequenceParallelContext(None, 1, 0, 1, 1, "trim")
    else:
        config = config or state.config
        ctx = SequenceParallelContext(
            group=state.sp_group,
            world_size=state.sp_world_size,
            rank=state.sp_rank,
            ulysses_degree=state.config.ulysses_degree,
            ring_degree=state.config.ring_degree,
            padding_mode=config.padding_mode,
            ulysses_group=state.ulysses_group,
            ring_group=state.ring_group,
        )
    with use_sp_context(ctx):
        yield ctx


@contextlib.contextmanager
def fresh_sp_context() -> Iterator[SequenceParallelContext | None]:
    """Run as a copy of the current context with nothing recorded yet (same group and policy).

    A CUDA graph's capture runs in one, so the layouts and the mask it reads are built inside
    the capture, in the graph's memory, not reused from an earlier run's context. Outside any
    context it does nothing.
    """
    ctx = get_sp_context()
    if ctx is None:
        yield None
        return
    with use_sp_context(dataclasses.replace(ctx, streams={}, _layouts={})) as fresh:
        yield fresh


def _pad_tail(x: torch.Tensor, dim: int, pad_size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = pad_size
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def shard_with_auto_pad(
    x: torch.Tensor, dim: int, stream: str = IMAGE, valid_len: int | Sequence[int] | None = None
) -> torch.Tensor:
    """This rank's chunk of `x` along `dim`, padding zeros at the global tail when needed.

    The first tensor sharded for a stream records its length; tensors that travel with
    the stream (rotary tables, modulation indices) are sharded by the same rule.
    `valid_len` < the length marks the tail as filler that attention must not see; a sequence of
    them, one per batch row, marks each row's own (prompts of different lengths in one batch).
    Outside an SP context `x` is returned as is; with one rank it is returned as is after
    recording the stream (the single-process attention cuts the filler).
    """
    ctx = get_sp_context()
    if ctx is None:
        return x
    dim = dim % x.dim()
    seq_len = x.shape[dim]
    shard = ctx.record_stream(stream, seq_len, valid_len)
    if not ctx.enabled:
        return x
    sp_pad = shard.padded_seq_len - seq_len
    if sp_pad:
        logger.debug(
            "Auto-padded sequence from %d to %d (pad_size=%d, world_size=%d, dim=%d)",
            seq_len,
            shard.padded_seq_len,
            sp_pad,
            ctx.world_size,
            dim,
        )
        x = _pad_tail(x, dim, sp_pad)
    return x.narrow(dim, ctx.rank * shard.local_seq_len, shard.local_seq_len).contiguous()


def record_sharded_stream(stream: str, seq_len: int) -> int:
    """Record a kv-only stream of `seq_len` tokens that an earlier forward sharded under the same group and
    this one does not shard again (a K/V cache, padded by this module's rule: a condition image's, each
    rank holding its sequence shard; a reference stream, each rank holding its heads); its rank-local
    length."""
    ctx = get_sp_context()
    if ctx is None:
        return seq_len
    return ctx.record_stream(stream, seq_len).local_seq_len


def gather_sequence(x: torch.Tensor, dim: int, stream: str = IMAGE) -> torch.Tensor:
    """All-gather a sharded stream along `dim` and strip its padding (inverse of `shard_with_auto_pad`)."""
    ctx = get_sp_context()
    if ctx is None or not ctx.enabled:
        return x
    dim = dim % x.dim()
    return torch.cat(all_gather(x, ctx.group), dim=dim).narrow(dim, 0, ctx.streams[stream].original_seq_len)


def real_rows(x: torch.Tensor, dim: int, stream: str = IMAGE) -> torch.Tensor:
    """This rank's rows of a sharded `stream` without its SP padding (a statistic over the real tokens).

    `x` may hold the stream's rows first and other rows after them ([target, prefix] rows):
    only the stream's are returned, with one rank too."""
    ctx = get_sp_context()
    if ctx is None or (not ctx.enabled and stream not in ctx.streams):
        return x
    shard = ctx.streams[stream]
    if not ctx.enabled:
        return x.narrow(dim, 0, min(x.shape[dim], shard.original_seq_len))
    start = ctx.rank * shard.local_seq_len
    return x.narrow(dim, 0, max(0, min(shard.local_seq_len, shard.original_seq_len - start)))


def group_sum(x: torch.Tensor) -> torch.Tensor:
    """`x` summed over the ranks of the current SP group (as is with one rank): every rank gets the same."""
    ctx = get_sp_context()
    if ctx is None or not ctx.enabled or isinstance(ctx.group, SimulatedGroup):
        return x
    x = x.clone()
    torch.distributed.all_reduce(x, group=ctx.group)
    return x
