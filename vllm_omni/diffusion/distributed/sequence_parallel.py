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
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from vllm_omni.diffusion.data import DiffusionParallelConfig, PaddingMode
from vllm_omni.diffusion.distributed.comm import all_gather
from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

IMAGE = "image"  # the image or video tokens
TEXT = "text"


@dataclass(frozen=True)
class StreamShard:
    """How one token stream is split: its true length, padding and per-rank length."""

    original_seq_len: int
    pad_size: int
    world_size: int

    @property
    def padded_seq_len(self) -> int:
        return self.original_seq_len + self.pad_size

    @property
    def local_seq_len(self) -> int:
        return self.padded_seq_len // self.world_size


@dataclass(frozen=True)
class StreamSlot:
    """Where one stream sits: in a rank's local joint sequence, and in the joint buffer after the all-to-all."""

    name: str
    shard: StreamShard
    local_start: int  # offset in the rank-local [stream, stream] sequence that is exchanged
    joint_offset: int  # offset of the stream's first token in the joint attention buffer


@dataclass(frozen=True)
class JointLayout:
    """The joint sequence attention runs over after the seq->head all-to-all.

    Each stream is copied, padding included, to `joint_offset`; in trim mode a stream's
    offset is the previous stream's true end, so the next stream's copy overwrites the
    previous padding and only the last stream's padding remains, past `kv_len`. Queries
    span `query_len`; keys and values span `kv_len`.
    """

    slots: tuple[StreamSlot, ...]
    world_size: int
    query_len: int
    kv_len: int
    key_mask: torch.Tensor | None  # additive [1, 1, 1, query_len] bias, mask mode only

    @property
    def local_len(self) -> int:
        return sum(slot.shard.local_seq_len for slot in self.slots)


@dataclass
class SequenceParallelContext:
    """Per-forward SP state: group, policy, and the streams sharded so far."""

    group: Any  # a torch ProcessGroup, a SimulatedGroup, or None for one rank
    world_size: int
    rank: int
    ulysses_degree: int
    ring_degree: int
    padding_mode: PaddingMode
    streams: dict[str, StreamShard] = field(default_factory=dict)
    _layouts: dict[tuple, JointLayout] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    def record_stream(self, stream: str, seq_len: int) -> StreamShard:
        shard = self.streams.get(stream)
        if shard is None:
            padded = math.ceil(seq_len / self.world_size) * self.world_size
            shard = StreamShard(original_seq_len=seq_len, pad_size=padded - seq_len, world_size=self.world_size)
            if shard.pad_size and self.ring_degree > 1:
                raise ValueError(
                    f"Ring attention cannot be exact with SP padding: the {stream} sequence of {seq_len} tokens "
                    f"is not divisible by sequence_parallel_size={self.world_size}. Use Ulysses only "
                    f"(ring_degree=1) or a size whose token count the degree divides."
                )
            self.streams[stream] = shard
            self._layouts.clear()
        elif shard.original_seq_len != seq_len:
            raise ValueError(
                f"{stream} stream was sharded with {shard.original_seq_len} tokens, now with {seq_len}: "
                "tensors that travel with a stream must have its length"
            )
        return shard

    def joint_layout(self, order: Sequence[str], device: torch.device, dtype: torch.dtype) -> JointLayout:
        """The layout for streams joined in `order`; computed once per forward and reused by every layer."""
        key = (tuple(order), device, dtype)
        layout = self._layouts.get(key)
        if layout is None:
            layout = self._build_layout(order, device, dtype)
            self._layouts[key] = layout
        return layout

    def _build_layout(self, order: Sequence[str], device: torch.device, dtype: torch.dtype) -> JointLayout:
        slots, local_start, joint_offset = [], 0, 0
        trim = self.padding_mode == "trim"
        for name in order:
            if name not in self.streams:
                raise RuntimeError(f"stream {name!r} reached attention without shard_with_auto_pad")
            shard = self.streams[name]
            slots.append(StreamSlot(name, shard, local_start, joint_offset))
            local_start += shard.local_seq_len
            joint_offset += shard.original_seq_len if trim else shard.padded_seq_len
        last = slots[-1]
        query_len = last.joint_offset + last.shard.padded_seq_len
        kv_len = last.joint_offset + last.shard.original_seq_len if trim else query_len
        total_pad = sum(slot.shard.pad_size for slot in slots)

        key_mask = None
        if self.padding_mode == "mask" and total_pad:
            # Built on the device (no host copy), so a CUDA graph can capture it too.
            bias = torch.full((query_len,), float("-inf"), dtype=dtype, device=device)
            for slot in slots:
                bias[slot.joint_offset : slot.joint_offset + slot.shard.original_seq_len] = 0
            key_mask = bias.view(1, 1, 1, query_len)
        elif self.padding_mode == "none" and total_pad:
            true_len = sum(slot.shard.original_seq_len for slot in slots)
            logger.warning_once(
                "Attention sees unmasked SP padding: %d pad tokens on a sequence of %d real tokens "
                "(ulysses_degree=%d). Padding is not masked, which may change numerics slightly; set "
                "mask_sp_padding=True or trim_sp_padding=True for exact results.",
                total_pad,
                true_len,
                self.ulysses_degree,
            )
        return JointLayout(tuple(slots), self.world_size, query_len, kv_len, key_mask)


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
        )
    with use_sp_context(ctx):
        yield ctx


def _pad_tail(x: torch.Tensor, dim: int, pad_size: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = pad_size
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def shard_with_auto_pad(x: torch.Tensor, dim: int, stream: str = IMAGE) -> torch.Tensor:
    """This rank's chunk of `x` along `dim`, padding zeros at the global tail when needed.

    The first tensor sharded for a stream records its length; tensors that travel with
    the stream (rotary tables, modulation indices) are sharded by the same rule.
    Outside an SP context, or with one rank, `x` is returned as is.
    """
    ctx = get_sp_context()
    if ctx is None or not ctx.enabled:
        return x
    dim = dim % x.dim()
    seq_len = x.shape[dim]
    shard = ctx.record_stream(stream, seq_len)
    if shard.pad_size:
        logger.debug(
            "Auto-padded sequence from %d to %d (pad_size=%d, world_size=%d, dim=%d)",
            seq_len,
            shard.padded_seq_len,
            shard.pad_size,
            ctx.world_size,
            dim,
        )
        x = _pad_tail(x, dim, shard.pad_size)
    return x.narrow(dim, ctx.rank * shard.local_seq_len, shard.local_seq_len).contiguous()


def gather_sequence(x: torch.Tensor, dim: int, stream: str = IMAGE) -> torch.Tensor:
    """All-gather a sharded stream along `dim` and strip its padding (inverse of `shard_with_auto_pad`)."""
    ctx = get_sp_context()
    if ctx is None or not ctx.enabled:
        return x
    dim = dim % x.dim()
    return torch.cat(all_gather(x, ctx.group), dim=dim).narrow(dim, 0, ctx.streams[stream].original_seq_len)
