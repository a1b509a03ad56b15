"""The shared text-compaction helper: which tokens are kept, bucketing, and the per-tensor cache."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from vllm_omni.diffusion.models.text_compaction import (
    TensorKeyedCache,
    bucket_length,
    compact_text_mask,
    compact_text_rows,
    compact_tokens,
)


def test_bucket_length_rounds_up_but_never_past_the_sequence():
    assert [bucket_length(n, 1000) for n in (0, 1, 30, 64, 65)] == [0, 64, 64, 64, 128]
    assert bucket_length(990, 1000) == 1000
    assert bucket_length(30, 1000, multiple=1) == 30
    with pytest.raises(ValueError):
        bucket_length(3, 10, multiple=0)


def test_valid_tokens_come_first_in_order_then_masked_ones_as_filler():
    mask = torch.tensor([0, 1, 1, 0, 1, 0, 0, 0, 0, 0])
    c = compact_tokens(mask, multiple=4)
    assert c.index.tolist() == [1, 2, 4, 0]  # three valid, then the first masked token up to the bucket of 4
    assert (c.valid_len, c.bucket_len, c.has_filler) == (3, 4, True)
    assert c.valid_mask.tolist() == [True, True, True, False]
    x = torch.arange(20.0).view(1, 10, 2)
    assert torch.equal(c.gather(x, 1), x[:, [1, 2, 4, 0]])
    exact = compact_tokens(mask, multiple=1)
    assert exact.index.tolist() == [1, 2, 4] and not exact.has_filler


def test_mask_plans_none_shared_or_per_row():
    assert compact_text_mask(torch.ones(2, 5)) is None
    shared = compact_text_mask(torch.tensor([[1, 1, 0, 0, 0]] * 2), multiple=1)
    assert shared.index.tolist() == [0, 1]
    rows = compact_text_mask(torch.tensor([[1, 1, 0, 0, 0], [1, 1, 1, 0, 0]]), multiple=1)
    assert [r.index.tolist() for r in rows] == [[0, 1], [0, 1, 2]]


def test_rows_that_differ_compact_to_the_longest_rows_bucket():
    prefix = compact_text_rows(torch.tensor([[1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0]]), multiple=2)
    assert prefix.valid_lens == (2, 3) and prefix.bucket_len == 4
    assert prefix.shared_index.tolist() == [0, 1, 2, 3]  # valid tokens lead each row: one gather for all
    holes = compact_text_rows(torch.tensor([[0, 1, 0, 1, 0, 0], [1, 1, 1, 0, 0, 0]]), multiple=2)
    assert holes.shared_index is None and holes.valid_lens == (2, 3)
    assert holes.index.tolist() == [[1, 3, 0, 2], [0, 1, 2, 3]]  # each row: its valid tokens, then its masked
    x = torch.arange(12.0).view(2, 6, 1)
    assert holes.gather(x)[:, :, 0].tolist() == [[1, 3, 0, 2], [6, 7, 8, 9]]


def test_plans_are_cached_on_the_tensor_object_and_its_version():
    mask = torch.tensor([[1, 1, 0, 0]])
    first = compact_text_mask(mask)
    assert compact_text_mask(mask) is first
    assert compact_text_mask(mask.clone()) is not first  # equal values, other tensor: planned again
    mask[0, 2] = 1  # an in-place write bumps the version
    assert compact_text_mask(mask).valid_len == 3
    with torch.inference_mode():  # pipelines run like this; inference tensors have no version counter
        frozen = torch.tensor([[1, 0, 0]])
        assert compact_text_mask(frozen) is compact_text_mask(frozen)


def test_cache_does_not_keep_tensors_alive_and_evicts_the_oldest():
    cache = TensorKeyedCache(size=2)
    tensors = [torch.zeros(3) for _ in range(3)]
    for i, t in enumerate(tensors):
        assert cache.get((t,), "k", lambda i=i: i) == i
    assert cache.get((tensors[0],), "k", lambda: "recomputed") == "recomputed"  # evicted
    assert cache.get((tensors[2], None), "k", lambda: "with None") == "with None"
    ref = weakref.ref(tensors[1])
    del tensors
    gc.collect()
    assert ref() is None
