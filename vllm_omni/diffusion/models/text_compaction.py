"""Text compaction: keep the text tokens a reference model attends to, drop the ones it masks.

Pipelines pad prompts to a fixed length and pass a mask (a video model: 1000 vision-language
tokens of which about 30 are real, plus glyph and image tokens; an image model when the prompts of
a batch differ in length). A masked key has no influence on any other token, so gathering the
valid tokens (and whatever travels with them, such as text rotary rows) reproduces the
reference without a mask, and joint attention keeps its dense kernel. Transformers call
`compact_tokens` / `compact_text_mask` in their forward and shard the gathered text with
`shard_with_auto_pad(x, dim, TEXT, valid_len=c.valid_len)`.
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import torch

BUCKET_MULTIPLE = 64

T = TypeVar("T")


def bucket_length(valid_len: int, max_len: int, multiple: int = BUCKET_MULTIPLE) -> int:
    """`valid_len` rounded up to a multiple of `multiple`, but never more than `max_len` tokens.

    Bucketing: the gathered length is the valid length rounded up to a multiple of
    `BUCKET_MULTIPLE` (never past the original length), its tail filled with the first masked
    tokens, so GEMMs, all-to-alls and compiled code see a few shapes instead of one per prompt.
    The SP padding policy drops that filler exactly as it drops SP padding. (Attention's key
    length is still the exact valid length in trim mode: a CUDA graph replays only for the
    valid length it was captured with.)
    """
    if multiple < 1:
        raise ValueError(f"multiple must be a positive integer, got {multiple}")
    return min(-(-valid_len // multiple) * multiple, max_len)


@dataclass(frozen=True)
class TextCompaction:
    """The valid tokens of one masked sequence, in order, followed by bucket filler.

    `index` [bucket_len] holds positions in the uncompacted sequence: the `valid_len` valid
    ones first, then the first masked ones as filler (finite values the padding policy drops).
    """

    index: torch.Tensor
    valid_len: int
    valid_mask: torch.Tensor  # [bucket_len] bool, True for the valid tokens: for modules that take a mask

    @property
    def bucket_len(self) -> int:
        return self.index.shape[0]

    @property
    def has_filler(self) -> bool:
        return self.bucket_len > self.valid_len

    def gather(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """`x`'s valid tokens (then filler) along `dim`."""
        return x.index_select(dim, self.index)


def compact_tokens(mask: torch.Tensor, multiple: int = BUCKET_MULTIPLE) -> TextCompaction:
    """The compaction of one row's mask ([L], nonzero = valid). Syncs with the device: cache the result."""
    if mask.dim() != 1:
        raise ValueError(f"expected a 1-D mask, got shape {tuple(mask.shape)}")
    mask = mask.bool()
    valid = mask.nonzero().squeeze(1)
    valid_len = valid.shape[0]
    bucket = bucket_length(valid_len, mask.shape[0], multiple)
    # The reference's own order: valid tokens, then the masked ones; keep a bucket's worth.
    index = torch.cat([valid, (~mask).nonzero().squeeze(1)])[:bucket]
    valid_mask = torch.arange(bucket, device=mask.device) < valid_len
    return TextCompaction(index, valid_len, valid_mask)


@dataclass(frozen=True)
class RowsCompaction:
    """Rows of one batch whose masks differ, compacted to one common length so they share a forward.

    Row b's `index` [B, bucket_len] holds its own valid tokens in order, then its masked ones as
    filler, up to the bucket of the longest row; `valid_lens` tells attention each row's true
    length (`shard_with_auto_pad(x, dim, TEXT, valid_len=valid_lens)`).
    """

    index: torch.Tensor
    valid_lens: tuple[int, ...]
    # The index every row shares ([bucket_len]) where each row's valid tokens lead its mask (prompts
    # padded at their end): one gather serves every row, and per-position tables (rotary) too. Else None.
    shared_index: torch.Tensor | None = None

    @property
    def bucket_len(self) -> int:
        return self.index.shape[1]

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """Each row's compacted tokens of `x` [B, L, ...] along dim 1."""
        if self.shared_index is not None:
            return x.index_select(1, self.shared_index)
        index = self.index.view(*self.index.shape, *([1] * (x.dim() - 2))).expand(-1, -1, *x.shape[2:])
        return x.gather(1, index)


def compact_text_rows(mask: torch.Tensor, multiple: int = BUCKET_MULTIPLE) -> RowsCompaction:
    """The compaction of a [B, L] mask (nonzero = valid) whose rows differ, cached on the mask tensor."""

    def plan() -> RowsCompaction:
        valid = mask.bool()
        valid_lens = tuple(int(n) for n in valid.sum(dim=1).tolist())
        bucket = bucket_length(max(valid_lens), valid.shape[1], multiple)
        # Stable: valid positions first in order, then the masked ones, as `compact_tokens` orders one row.
        index = torch.argsort((~valid).int(), dim=1, stable=True)[:, :bucket]
        prefix = torch.arange(bucket, device=mask.device)
        shared = prefix if bool((index == prefix).all()) else None
        return RowsCompaction(index, valid_lens, shared)

    return cached_on_tensors((mask,), ("compact_text_rows", multiple), plan)


def compact_text_mask(
    mask: torch.Tensor, multiple: int = BUCKET_MULTIPLE
) -> TextCompaction | list[TextCompaction] | None:
    """Plan the compaction of a [B, L] text mask (nonzero = valid), cached on the mask tensor.

    None: every token of every row is valid, nothing to drop. One `TextCompaction`: every
    row has the same mask and they are compacted together. A list (one per row): the rows
    differ, so they cannot share one gather (`compact_text_rows` compacts them to one length).
    """

    def plan() -> TextCompaction | list[TextCompaction] | None:
        valid = mask.bool()
        if valid.all():
            return None
        if (valid == valid[:1]).all():
            return compact_tokens(valid[0], multiple)
        return [compact_tokens(row, multiple) for row in valid]

    return cached_on_tensors((mask,), ("compact_text_mask", multiple), plan)


def _version(tensor: torch.Tensor) -> int | None:
    # Inference tensors (a pipeline run under torch.inference_mode) keep no version counter;
    # pipelines never write into their masks, so identity alone identifies them.
    return None if tensor.is_inference() else tensor._version


class TensorKeyedCache:
    """A few results keyed on tensor objects (identity and version), for host facts derived from them.

    Keys are the tensors' ids; entries hold weak references and check them on lookup, so a
    new tensor that reuses a freed tensor's id or memory (data_ptr) never hits a stale result,
    and an in-place write (a new version) misses. Least recently used entries go first.
    """

    def __init__(self, size: int = 16) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tuple[list, list, object]] = OrderedDict()

    def get(self, tensors: Sequence[torch.Tensor | None], key: Hashable, compute: Callable[[], T]) -> T:
        ids = (tuple(id(t) for t in tensors), key)
        entry = self._entries.get(ids)
        if entry is not None:
            refs, versions, value = entry
            alive = all((t is None and r is None) or (r is not None and r() is t) for t, r in zip(tensors, refs))
            if alive and versions == [None if t is None else _version(t) for t in tensors]:
                self._entries.move_to_end(ids)
                return value  # type: ignore[return-value]
        value = compute()
        refs = [None if t is None else weakref.ref(t) for t in tensors]
        self._entries[ids] = (refs, [None if t is None else _version(t) for t in tensors], value)
        self._entries.move_to_end(ids)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)
        return value

    def clear(self) -> None:
        self._entries.clear()


_CACHE = TensorKeyedCache()


def cached_on_tensors(tensors: Sequence[torch.Tensor | None], key: Hashable, compute: Callable[[], T]) -> T:
    """`compute()`, cached on `tensors` (by identity and version) and `key` in one process-wide cache.

    Caching: finding the valid tokens needs their count on the host, a device sync. A pipeline
    passes the same mask tensor at every denoising step of a request, so the result is cached on
    that tensor object (`cached_on_tensors`) and the per-step forward neither syncs nor copies
    from the host after the first step.
    """
    return _CACHE.get(tensors, key, compute)
