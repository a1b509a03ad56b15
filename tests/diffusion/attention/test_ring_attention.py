"""Ring attention (USP) in the attention layer, under real processes over gloo: the ring pools (ring 2, ring 3,
Ulysses 2 x ring 2; tests/conftest.py's `ring_pool`).

At the lengths of the Ulysses tests the padding lands inside a ring block (13 image tokens at ring 2: blocks of
7 rows, the second holding one pad row) or fills whole blocks (one image token at ring 3: two blocks of padding
only). Trim and mask equal single-process SDPA over the unpadded sequence; what the padding holds never reaches a
real token; none mode is close, warns once and names the ring degree. The streams a model may add (a stream's
filler, rows of different text lengths, kv-only streams, a kept reference stream, a block-causal text prefix)
equal the single-process layer too.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from test_attention_layer import (
    LENGTHS,
    MODES,
    _check_equal_to_reference,
    _check_filler_dropped,
    _check_rows_see_their_own_text,
    _reference,
    _streams,
    reset_warnings,
    run_attention,
)

from vllm_omni.diffusion.attention.layer import JointAttention, ReferenceKV
from vllm_omni.diffusion.distributed.parallel_state import use_parallel_state
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    REFERENCE,
    TEXT,
    gather_sequence,
    record_sharded_stream,
    sequence_parallel_context,
    shard_with_auto_pad,
)

ATOL = 1e-5


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_exact_modes_match_single_process(ring_pool, mode):
    ring_pool.run(reset_warnings)
    for text_position in ("front", "rear"):
        for batch in (1, 2):
            for image_len, text_len in [*LENGTHS, (13, 11)]:
                results = ring_pool.run(run_attention, mode, batch, image_len, text_len, text_position)
                _check_equal_to_reference(results, batch, image_len, text_len, text_position, atol=ATOL)
                assert all(warnings == [] for _, _, warnings in results), "exact modes must not warn"


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_padding_content_does_not_change_real_tokens(ring_pool, mode):
    for text_position in ("front", "rear"):
        clean = ring_pool.run(run_attention, mode, 2, 13, 5, text_position)
        noisy = ring_pool.run(run_attention, mode, 2, 13, 5, text_position, pad_noise_seed=99)
        for (img_a, txt_a, _), (img_b, txt_b, _) in zip(clean, noisy):
            assert torch.equal(img_a, img_b) and torch.equal(txt_a, txt_b)


def test_unmasked_padding_is_close_not_equal_and_warns_once_per_process(ring_pool):
    ring_pool.run(reset_warnings)
    results = ring_pool.run(run_attention, "none", 1, 13, 5, "front", calls=3)
    image, text = _streams(1234, 1, 13, 5)
    ref_img, _ = _reference(image, text, "front")
    for img_out, _, warnings in results:
        assert 0 < (img_out - ref_img).abs().max().item() < 1.0
        assert len(warnings) == 1
        assert f"ulysses_degree={ring_pool.ulysses_degree}, ring_degree={ring_pool.ring_degree}" in warnings[0]
        assert "mask_sp_padding=True" in warnings[0] and "trim_sp_padding=True" in warnings[0]
    assert all(warnings == [] for _, _, warnings in ring_pool.run(run_attention, "none", 2, 17, 7, "rear"))
    # Where nothing pads, none mode is exact and silent.
    world = ring_pool.world_size
    results = ring_pool.run(run_attention, "none", 1, 6 * world, 2 * world, "front")
    _check_equal_to_reference(results, 1, 6 * world, 2 * world, "front", atol=ATOL)


@pytest.mark.parametrize("text_position", ["front", "rear"])
def test_filler_and_rows_of_different_text_lengths(ring_pool, text_position):
    """A text of 11 tokens of which 4 are real (filler after them) behaves like 4 tokens; rows with 4 and 9 real
    tokens each see their own: the filler and a row's tail fall in other ring blocks than the SP padding."""
    world = ring_pool.world_size
    for mode in ("mask", "trim", "none"):
        results = ring_pool.run(run_attention, mode, 2, 4 * world, 11, text_position, text_valid=4)
        _check_filler_dropped(results, 2, 4 * world, 11, 4, text_position)
        results = ring_pool.run(run_attention, mode, 2, 4 * world, 11, text_position, text_valid=(4, 9))
        _check_rows_see_their_own_text(results, 4 * world, 11, (4, 9), text_position)
    for mode in ("mask", "trim"):  # with SP padding in both streams as well
        results = ring_pool.run(run_attention, mode, 1, 13, 11, text_position, text_valid=4)
        _check_filler_dropped(results, 1, 13, 11, 4, text_position)
        results = ring_pool.run(run_attention, mode, 2, 13, 11, text_position, text_valid=(4, 9))
        _check_rows_see_their_own_text(results, 13, 11, (4, 9), text_position)


def _qkv(gen: torch.Generator, length: int, batch: int = 2) -> tuple[torch.Tensor, ...]:
    return tuple(torch.randn(batch, length, 6, 8, generator=gen) for _ in range(3))


def run_other_streams(mode: str, distributed: bool) -> dict[str, torch.Tensor]:
    """Worker side: the layer's other kinds of streams, gathered (`distributed`) or in this process alone.

    kv-only streams (two cached conditions, 5 and 9 tokens, in front of [text, image]); a reference stream of
    7 tokens over two steps (its keys kept at the first, a kept kv-only stream at the second); a block-causal
    text prefix of 9 real tokens (a causal run, a bidirectional block, a causal run) and 3 of filler."""
    gen = torch.Generator().manual_seed(7)
    image, text, cond0, cond1, ref = (_qkv(gen, n) for n in (13, 5, 5, 9, 7))
    prefix, image2 = _qkv(gen, 12), _qkv(gen, 13)
    layer, out = JointAttention("front"), {}

    def shard(qkv, stream, **kwargs):
        return tuple(shard_with_auto_pad(t, 1, stream, **kwargs) for t in qkv)

    def gather(x, stream):
        return gather_sequence(x, 1, stream)

    with use_parallel_state(None) if not distributed else contextlib.nullcontext(), torch.no_grad():
        with sequence_parallel_context(MODES[mode]):
            kv = [(f"cond{i}", *shard((k, v), f"cond{i}")) for i, (_, k, v) in enumerate((cond0, cond1))]
            img, txt = layer(*shard(image, IMAGE), text_qkv=shard(text, TEXT), kv_streams=kv)
            out["kv_image"], out["kv_text"] = gather(img, IMAGE), gather(txt, TEXT)
        kept = ReferenceKV()
        with sequence_parallel_context(MODES[mode]):
            img, txt, ref_out = layer.attend_reference(
                *shard(image, IMAGE), shard(text, TEXT), kept, reference_qkv=shard(ref, REFERENCE)
            )
            out["ref1_image"], out["ref1_text"] = gather(img, IMAGE), gather(txt, TEXT)
            out["ref1_ref"] = gather(ref_out, REFERENCE)
        with sequence_parallel_context(MODES[mode]):
            record_sharded_stream(REFERENCE, 7)
            img, txt, _ = layer.attend_reference(*shard(image2, IMAGE), shard(text, TEXT), kept)
            out["ref2_image"], out["ref2_text"] = gather(img, IMAGE), gather(txt, TEXT)
        with sequence_parallel_context(MODES[mode]):
            blocks = ((0, 3, True), (3, 6, False), (6, 9, True))
            img, txt = layer(*shard(image, IMAGE), text_qkv=shard(prefix, TEXT, valid_len=9), text_blocks=blocks)
            out["blocks_image"], out["blocks_text"] = gather(img, IMAGE), gather(txt, TEXT)[:, :9]
    return out


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_kv_only_streams_a_kept_reference_and_text_blocks(ring_pool, mode):
    expected = run_other_streams(mode, distributed=False)
    for out in ring_pool.run(run_other_streams, mode, True):
        assert set(out) == set(expected)
        for name, value in out.items():
            torch.testing.assert_close(value, expected[name], rtol=0, atol=ATOL, msg=name)
