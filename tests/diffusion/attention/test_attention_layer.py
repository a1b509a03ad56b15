"""The attention layer under real multi-process Ulysses SP (gloo, 2 and 3 ranks).

Each rank builds the same global q, k, v, shards them with `shard_with_auto_pad`, runs
the layer and gathers; the result is compared with plain single-process SDPA over the
full, unpadded sequence.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from vllm_omni.diffusion.attention.layer import JointAttention, StreamCrossAttention
from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    gather_sequence,
    get_sp_context,
    sequence_parallel_context,
    shard_with_auto_pad,
)
from vllm_omni.logger import reset_warning_once

HEADS, HEAD_DIM = 6, 8
MODES = {
    "mask": DiffusionParallelConfig(mask_sp_padding=True),
    "trim": DiffusionParallelConfig(),
    "none": DiffusionParallelConfig(trim_sp_padding=False),
}


def _streams(seed: int, batch: int, image_len: int, text_len: int):
    gen = torch.Generator().manual_seed(seed)

    def qkv(length):
        return tuple(torch.randn(batch, length, HEADS, HEAD_DIM, generator=gen) for _ in range(3))

    return qkv(image_len), qkv(text_len)


def _reference(image, text, text_position):
    parts = [text, image] if text_position == "front" else [image, text]
    q, k, v = (torch.cat(p, dim=1).transpose(1, 2) for p in zip(*parts))
    out = F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    first, second = out.split([parts[0][0].shape[1], parts[1][0].shape[1]], dim=1)
    return (second, first) if text_position == "front" else (first, second)


def _fill_padding_with_noise(local: torch.Tensor, stream: str, seed: int) -> torch.Tensor:
    """Replace this rank's padded positions (zeros from auto-padding) by random values."""
    ctx = get_sp_context()
    shard = ctx.streams[stream]
    start = ctx.rank * shard.local_seq_len
    n_real = max(0, min(shard.local_seq_len, shard.original_seq_len - start))
    noisy = local.clone()
    gen = torch.Generator().manual_seed(seed + ctx.rank)
    noisy[:, n_real:] = torch.randn(noisy[:, n_real:].shape, generator=gen) * 10
    return noisy


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[tuple[int, str]] = []

    def emit(self, record):
        self.messages.append((record.levelno, record.getMessage()))


def run_attention(mode, batch, image_len, text_len, text_position, calls=1, pad_noise_seed=None, text_valid=None):
    """Worker side: SP attention on this rank; returns gathered outputs and the warnings logged.

    `text_valid` < `text_len` marks the text's tail as filler (shard_with_auto_pad's valid_len).
    """
    image, text = _streams(1234, batch, image_len, text_len)
    layer = JointAttention(text_position=text_position)
    records = _Records()
    logging.getLogger("vllm_omni").addHandler(records)
    try:
        for _ in range(calls):
            with sequence_parallel_context(MODES[mode]):
                img_local = [shard_with_auto_pad(t, 1, IMAGE) for t in image]
                txt_local = [shard_with_auto_pad(t, 1, TEXT, valid_len=text_valid) for t in text]
                if pad_noise_seed is not None:
                    img_local = [
                        _fill_padding_with_noise(t, IMAGE, pad_noise_seed + i) for i, t in enumerate(img_local)
                    ]
                    txt_local = [
                        _fill_padding_with_noise(t, TEXT, pad_noise_seed + 7 + i) for i, t in enumerate(txt_local)
                    ]
                img_out, txt_out = layer(*img_local, text_qkv=tuple(txt_local))
                img_out, txt_out = gather_sequence(img_out, 1, IMAGE), gather_sequence(txt_out, 1, TEXT)
    finally:
        logging.getLogger("vllm_omni").removeHandler(records)
    warnings = [m for level, m in records.messages if level == logging.WARNING and "unmasked SP padding" in m]
    return img_out, txt_out, warnings


def reset_warnings():
    reset_warning_once()


def _check_equal_to_reference(results, batch, image_len, text_len, text_position, atol):
    image, text = _streams(1234, batch, image_len, text_len)
    ref_img, ref_txt = _reference(image, text, text_position)
    for img_out, txt_out, _ in results:
        assert img_out.shape == ref_img.shape and txt_out.shape == ref_txt.shape
        torch.testing.assert_close(img_out, ref_img, rtol=0, atol=atol)
        torch.testing.assert_close(txt_out, ref_txt, rtol=0, atol=atol)


# (image_len, text_len): divisible by 2 and 3; odd image; odd text; both odd; shorter than the degree.
LENGTHS = [(12, 6), (13, 6), (12, 7), (17, 5), (1, 2)]


@pytest.mark.parametrize("mode", ["mask", "trim"])
@pytest.mark.parametrize("text_position", ["front", "rear"])
@pytest.mark.parametrize("batch", [1, 2])
def test_exact_modes_match_single_process(sp_pool, mode, text_position, batch):
    sp_pool.run(reset_warnings)
    for image_len, text_len in LENGTHS:
        results = sp_pool.run(run_attention, mode, batch, image_len, text_len, text_position)
        _check_equal_to_reference(results, batch, image_len, text_len, text_position, atol=1e-5)
        assert all(warnings == [] for _, _, warnings in results), "exact modes must not warn"


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_padding_content_does_not_change_real_tokens(sp_pool, mode):
    for text_position in ("front", "rear"):
        clean = sp_pool.run(run_attention, mode, 2, 13, 5, text_position)
        noisy = sp_pool.run(run_attention, mode, 2, 13, 5, text_position, pad_noise_seed=99)
        for (img_a, txt_a, _), (img_b, txt_b, _) in zip(clean, noisy):
            assert torch.equal(img_a, img_b) and torch.equal(txt_a, txt_b)


def test_unmasked_padding_is_close_not_equal_and_warns_once_per_process(sp_pool):
    sp_pool.run(reset_warnings)
    results = sp_pool.run(run_attention, "none", 1, 13, 5, "front", calls=3)
    image, text = _streams(1234, 1, 13, 5)
    ref_img, _ = _reference(image, text, "front")
    for rank, (img_out, _, warnings) in enumerate(results):
        diff = (img_out - ref_img).abs().max().item()
        assert 0 < diff < 1.0, f"rank {rank}: unmasked padding should perturb slightly, diff={diff}"
        assert len(warnings) == 1, f"rank {rank}: expected one warning, got {warnings}"
        assert f"ulysses_degree={sp_pool.world_size}" in warnings[0]
        assert "mask_sp_padding=True" in warnings[0] and "trim_sp_padding=True" in warnings[0]
    # Later calls in the same processes stay silent.
    again = sp_pool.run(run_attention, "none", 2, 17, 7, "rear")
    assert all(warnings == [] for _, _, warnings in again)


def test_unpadded_unmasked_run_is_exact_and_silent(sp_pool):
    sp_pool.run(reset_warnings)
    world = sp_pool.world_size
    results = sp_pool.run(run_attention, "none", 1, 6 * world, 2 * world, "front")
    _check_equal_to_reference(results, 1, 6 * world, 2 * world, "front", atol=1e-5)
    assert all(warnings == [] for _, _, warnings in results)


def test_single_process_joint_attention_matches_sdpa():
    image, text = _streams(5, 2, 9, 4)
    for text_position in ("front", "rear"):
        img_out, txt_out = JointAttention(text_position)(*image, text_qkv=text)
        ref_img, ref_txt = _reference(image, text, text_position)
        torch.testing.assert_close(img_out, ref_img, rtol=0, atol=1e-6)
        torch.testing.assert_close(txt_out, ref_txt, rtol=0, atol=1e-6)


def _check_filler_dropped(results, batch, image_len, text_len, text_valid, text_position):
    image, text = _streams(1234, batch, image_len, text_len)
    ref_img, ref_txt = _reference(image, tuple(t[:, :text_valid] for t in text), text_position)
    for img_out, txt_out, warnings in results:
        torch.testing.assert_close(img_out, ref_img, rtol=0, atol=1e-5)
        torch.testing.assert_close(txt_out, ref_txt, rtol=0, atol=1e-5)  # gathered to the valid length
        assert warnings == []


@pytest.mark.parametrize("text_position", ["front", "rear"])
def test_stream_filler_is_dropped_exactly_in_every_mode(sp_pool, text_position):
    """A text stream of 11 tokens of which 4 are real (a bucket's filler after them) behaves like 4 tokens.

    The image length is divisible, so even none mode has no SP padding left to see: the
    filler is cut there too and never warns.
    """
    sp_pool.run(reset_warnings)
    world = sp_pool.world_size
    for mode in ("mask", "trim", "none"):
        results = sp_pool.run(run_attention, mode, 2, 4 * world, 11, text_position, text_valid=4)
        _check_filler_dropped(results, 2, 4 * world, 11, 4, text_position)
    for mode in ("mask", "trim"):  # with SP padding in both streams as well
        results = sp_pool.run(run_attention, mode, 1, 13, 11, text_position, text_valid=4)
        _check_filler_dropped(results, 1, 13, 11, 4, text_position)


def test_single_process_cuts_stream_filler():
    image, text = _streams(5, 2, 9, 7)
    for text_position in ("front", "rear"):
        with sequence_parallel_context():
            txt = tuple(shard_with_auto_pad(t, 1, TEXT, valid_len=3) for t in text)
            img_out, txt_out = JointAttention(text_position)(*image, text_qkv=txt)
        ref_img, ref_txt = _reference(image, tuple(t[:, :3] for t in text), text_position)
        torch.testing.assert_close(img_out, ref_img, rtol=0, atol=1e-6)
        torch.testing.assert_close(txt_out[:, :3], ref_txt, rtol=0, atol=1e-6)
        assert txt_out.shape[1] == 7  # filler queries keep their rows


def _check_rows_see_their_own_text(results, image_len, text_len, row_valid, text_position):
    image, text = _streams(1234, len(row_valid), image_len, text_len)
    for row, n in enumerate(row_valid):
        own_text = tuple(t[row : row + 1, :n] for t in text)
        ref_img, ref_txt = _reference(tuple(t[row : row + 1] for t in image), own_text, text_position)
        for img_out, txt_out, warnings in results:
            torch.testing.assert_close(img_out[row : row + 1], ref_img, rtol=0, atol=1e-5)
            torch.testing.assert_close(txt_out[row : row + 1, :n], ref_txt, rtol=0, atol=1e-5)
            assert warnings == []


@pytest.mark.parametrize("text_position", ["front", "rear"])
def test_rows_with_text_of_different_lengths_each_see_their_own(sp_pool, text_position):
    """A batch whose rows have 4 and 9 real tokens of an 11-token text stream (prompts of different lengths in
    one forward) gives each row what its 4 or 9 tokens alone give: in every mode, single process and under SP,
    and with SP padding in both streams too (mask and trim)."""
    world = sp_pool.world_size
    for mode in ("mask", "trim", "none"):
        results = sp_pool.run(run_attention, mode, 2, 4 * world, 11, text_position, text_valid=(4, 9))
        _check_rows_see_their_own_text(results, 4 * world, 11, (4, 9), text_position)
    for mode in ("mask", "trim"):
        results = sp_pool.run(run_attention, mode, 2, 13, 11, text_position, text_valid=(4, 9))
        _check_rows_see_their_own_text(results, 13, 11, (4, 9), text_position)
    single = run_attention("trim", 2, 13, 11, text_position, text_valid=(9, 4))
    _check_rows_see_their_own_text([single], 13, 11, (9, 4), text_position)


# ---- StreamCrossAttention: queries of one sharded stream over another's keys ----------------------


def run_stream_cross(mode, batch, query_len, kv_len, pad_noise_seed=None):
    """Worker side: each stream's queries over the other's keys (the image stream's, then the text stream's);
    gathered outputs and the warnings logged."""
    image, text = _streams(4321, batch, query_len, kv_len)
    records = _Records()
    logging.getLogger("vllm_omni").addHandler(records)
    try:
        with sequence_parallel_context(MODES[mode]):
            img_local = [shard_with_auto_pad(t, 1, IMAGE) for t in image]
            txt_local = [shard_with_auto_pad(t, 1, TEXT) for t in text]
            if pad_noise_seed is not None:
                img_local = [_fill_padding_with_noise(t, IMAGE, pad_noise_seed + i) for i, t in enumerate(img_local)]
                txt_local = [_fill_padding_with_noise(t, TEXT, pad_noise_seed + 7 + i) for i, t in enumerate(txt_local)]
            img_out = StreamCrossAttention(IMAGE, TEXT)(img_local[0], *txt_local[1:])
            txt_out = StreamCrossAttention(TEXT, IMAGE)(txt_local[0], *img_local[1:])
            img_out, txt_out = gather_sequence(img_out, 1, IMAGE), gather_sequence(txt_out, 1, TEXT)
    finally:
        logging.getLogger("vllm_omni").removeHandler(records)
    warnings = [m for level, m in records.messages if level == logging.WARNING and "unmasked SP padding" in m]
    return img_out, txt_out, warnings


def _stream_cross_reference(batch, query_len, kv_len):
    (q_img, k_img, v_img), (q_txt, k_txt, v_txt) = _streams(4321, batch, query_len, kv_len)

    def sdpa(q, k, v):
        return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)

    return sdpa(q_img, k_txt, v_txt), sdpa(q_txt, k_img, v_img)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_stream_cross_attention_exact_modes_match_single_process(sp_pool, mode):
    """Query stream padded, key stream padded, both, neither (and shorter than the degree)."""
    sp_pool.run(reset_warnings)
    for query_len, kv_len, batch in [(13, 12, 1), (12, 13, 2), (13, 7, 2), (12, 6, 1), (1, 2, 1)]:
        results = sp_pool.run(run_stream_cross, mode, batch, query_len, kv_len)
        ref_img, ref_txt = _stream_cross_reference(batch, query_len, kv_len)
        for img_out, txt_out, warnings in results:
            torch.testing.assert_close(img_out, ref_img, rtol=0, atol=1e-5)
            torch.testing.assert_close(txt_out, ref_txt, rtol=0, atol=1e-5)
            assert warnings == []
        noisy = sp_pool.run(run_stream_cross, mode, batch, query_len, kv_len, pad_noise_seed=5)
        for (img_a, txt_a, _), (img_b, txt_b, _) in zip(results, noisy):
            assert torch.equal(img_a, img_b) and torch.equal(txt_a, txt_b)


def test_stream_cross_attention_unmasked_padding_is_close_and_warns(sp_pool):
    sp_pool.run(reset_warnings)
    results = sp_pool.run(run_stream_cross, "none", 1, 12, 13)  # only the keys' stream pads (at 2 and 3)
    ref_img, _ = _stream_cross_reference(1, 12, 13)
    for img_out, _, warnings in results:
        assert 0 < (img_out - ref_img).abs().max().item() < 1.0
        assert len(warnings) == 1 and f"ulysses_degree={sp_pool.world_size}" in warnings[0]


def test_single_process_stream_cross_attention_matches_sdpa():
    (q_img, _, _), (_, k_txt, v_txt) = _streams(4321, 2, 9, 4)
    ref_img, _ = _stream_cross_reference(2, 9, 4)
    torch.testing.assert_close(StreamCrossAttention(IMAGE, TEXT)(q_img, k_txt, v_txt), ref_img, rtol=0, atol=1e-6)
