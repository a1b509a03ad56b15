"""The sharding helper: shapes, recorded padding per stream, gather round trip, debug line."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap

import pytest
import torch

from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    REFERENCE,
    TEXT,
    SequenceParallelContext,
    StreamShard,
    gather_sequence,
    sequence_parallel_context,
    shard_with_auto_pad,
)


class _Records(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record):
        self.messages.append(record.getMessage())


def shard_and_gather(image_len: int, text_len: int, dim: int):
    """Worker side: shard two streams (and a rotary-like table that travels with the image), gather back."""
    root = logging.getLogger("vllm_omni")
    records, old_level = _Records(), root.level
    root.addHandler(records)
    root.setLevel(logging.DEBUG)
    try:
        image = torch.arange(2 * image_len * 3, dtype=torch.float32).view(2, image_len, 3).movedim(1, dim)
        text = torch.arange(text_len * 4, dtype=torch.float32).view(1, text_len, 4)
        rope = torch.randn(image_len, 8, dtype=torch.complex64, generator=torch.Generator().manual_seed(0))
        with sequence_parallel_context() as ctx:
            image_local = shard_with_auto_pad(image, dim, IMAGE)
            text_local = shard_with_auto_pad(text, 1, TEXT)
            rope_local = shard_with_auto_pad(rope, 0, IMAGE)
            back = gather_sequence(image_local, dim, IMAGE), gather_sequence(text_local, 1, TEXT)
            streams = dict(ctx.streams)
        return {
            "image_local": image_local,
            "text_local_shape": tuple(text_local.shape),
            "rope_local": rope_local,
            "image_back": back[0],
            "text_back": back[1],
            "streams": streams,
            "image": image,
            "text": text,
            "rope": rope,
            "logs": [m for m in records.messages if m.startswith("Auto-padded")],
        }
    finally:
        root.removeHandler(records)
        root.setLevel(old_level)


@pytest.mark.parametrize("image_len,text_len", [(12, 6), (13, 7), (2, 1), (1, 1)])
def test_shard_pads_global_tail_and_gather_round_trips(sp_pool, image_len, text_len):
    world = sp_pool.world_size
    results = sp_pool.run(shard_and_gather, image_len, text_len, 1)
    padded = -(-image_len // world) * world
    local = padded // world
    for rank, res in enumerate(results):
        assert res["streams"][IMAGE] == StreamShard(image_len, padded - image_len, world)
        assert res["streams"][TEXT].original_seq_len == text_len
        assert res["streams"][TEXT].padded_seq_len % world == 0
        assert res["image_local"].shape == (2, local, 3)
        assert res["text_local_shape"] == (1, res["streams"][TEXT].local_seq_len, 4)
        # The chunk is this rank's slice of the zero-padded sequence.
        full = torch.cat([res["image"], res["image"].new_zeros(2, padded - image_len, 3)], dim=1)
        assert torch.equal(res["image_local"], full[:, rank * local : (rank + 1) * local])
        # Tensors that travel with the stream follow the same rule; padded rows are finite zeros.
        rope_full = torch.cat([res["rope"], res["rope"].new_zeros(padded - image_len, 8)])
        assert torch.equal(res["rope_local"], rope_full[rank * local : (rank + 1) * local])
        assert torch.equal(res["image_back"], res["image"]) and torch.equal(res["text_back"], res["text"])
        pad = padded - image_len
        expected = f"Auto-padded sequence from {image_len} to {padded} (pad_size={pad}, world_size={world}, dim=1)"
        assert (expected in res["logs"]) == (padded != image_len)
        if padded == image_len and res["streams"][TEXT].pad_size == 0:
            assert res["logs"] == []


def test_shard_along_other_dims(sp_pool):
    results = sp_pool.run(shard_and_gather, 5, 3, 2)
    for res in results:
        assert torch.equal(res["image_back"], res["image"])
        assert any(line.endswith("dim=2)") for line in res["logs"])


def test_no_context_or_one_rank_is_identity():
    x = torch.randn(1, 7, 2)
    assert shard_with_auto_pad(x, 1) is x and gather_sequence(x, 1) is x
    with sequence_parallel_context() as ctx:
        assert not ctx.enabled
        assert shard_with_auto_pad(x, 1) is x


def _ctx(mode: str, ring_degree: int = 1) -> SequenceParallelContext:
    config = {
        "mask": DiffusionParallelConfig(mask_sp_padding=True),
        "trim": DiffusionParallelConfig(),
        "none": DiffusionParallelConfig(trim_sp_padding=False),
    }[mode]
    return SequenceParallelContext(None, 4, 0, 4 // ring_degree, ring_degree, config.padding_mode)


def test_layout_per_mode():
    for mode in ("mask", "trim", "none"):
        ctx = _ctx(mode)
        ctx.record_stream(TEXT, 6)  # padded to 8
        ctx.record_stream(IMAGE, 13)  # padded to 16
        layout = ctx.joint_layout([TEXT, IMAGE], torch.device("cpu"), torch.float32)
        assert [s.local_start for s in layout.slots] == [0, 2]
        assert layout.local_len == 6
        if mode == "trim":
            # Image starts where the real text ends; keys stop at the true end.
            assert [s.joint_offset for s in layout.slots] == [0, 6]
            assert (layout.query_len, layout.kv_len, layout.key_mask) == (22, 19, None)
        else:
            assert [s.joint_offset for s in layout.slots] == [0, 8]
            assert (layout.query_len, layout.kv_len) == (24, 24)
        if mode == "mask":
            valid = layout.key_mask.view(-1) == 0
            assert valid.tolist() == [True] * 6 + [False] * 2 + [True] * 13 + [False] * 3
        else:
            assert layout.key_mask is None  # never built outside mask mode
        assert ctx.joint_layout([TEXT, IMAGE], torch.device("cpu"), torch.float32) is layout


def test_kept_stream_is_placed_as_when_exchanged_but_not_exchanged():
    """FLUX.2 klein KV: the reference stream's later-step layout has its first-step offsets and mask."""
    for mode in ("mask", "trim", "none"):
        ctx = _ctx(mode)
        for stream, length in ((REFERENCE, 5), (TEXT, 6), (IMAGE, 13)):  # padded to 8, 8, 16
            ctx.record_stream(stream, length)
        order, cpu = [REFERENCE, TEXT, IMAGE], torch.device("cpu")
        exchanged = ctx.joint_layout(order, cpu, torch.float32)
        kept = ctx.joint_layout(order, cpu, torch.float32, kept=(REFERENCE,))
        assert [s.joint_offset for s in kept.slots] == [s.joint_offset for s in exchanged.slots]
        assert (kept.query_len, kept.kv_len) == (exchanged.query_len, exchanged.kv_len)
        assert (kept.key_mask is None) == (exchanged.key_mask is None)
        if kept.key_mask is not None:
            assert torch.equal(kept.key_mask, exchanged.key_mask)
        assert [s.exchanged for s in kept.slots] == [False, True, True]
        assert (exchanged.local_len, kept.local_len) == (2 + 2 + 4, 2 + 4)
        assert [s.local_start for s in kept.slots[1:]] == [0, 2]
        # The reference span runs to the text's offset: cut at its true length in trim mode only.
        assert kept.span(0) == (0, 5 if mode == "trim" else 8)


def test_layout_with_stream_filler_per_mode():
    """Text of 10 tokens of which 6 are real (filler 4, padded to 12), behind 13 image tokens (padded to 16)."""
    for mode in ("mask", "trim", "none"):
        ctx = _ctx(mode)
        ctx.record_stream(IMAGE, 13)
        assert ctx.record_stream(TEXT, 10, valid_len=6) == StreamShard(6, 6, 4, filler_len=4)
        rear = ctx.joint_layout([IMAGE, TEXT], torch.device("cpu"), torch.float32)
        front = ctx.joint_layout([TEXT, IMAGE], torch.device("cpu"), torch.float32)
        if mode == "trim":
            assert [s.joint_offset for s in rear.slots] == [0, 13] and (rear.query_len, rear.kv_len) == (25, 19)
        elif mode == "mask":
            assert [s.joint_offset for s in rear.slots] == [0, 16] and (rear.query_len, rear.kv_len) == (28, 28)
            valid = rear.key_mask.view(-1) == 0
            assert valid.tolist() == [True] * 13 + [False] * 3 + [True] * 6 + [False] * 6
        else:
            # none: the image keeps its unmasked SP padding, the text is cut at its true length.
            assert [s.joint_offset for s in rear.slots] == [0, 16] and (rear.query_len, rear.kv_len) == (28, 22)
            assert [s.joint_offset for s in front.slots] == [0, 6] and (front.query_len, front.kv_len) == (22, 22)
            assert rear.key_mask is None


def test_valid_len_is_recorded_with_one_rank():
    x = torch.randn(1, 7, 2)
    with sequence_parallel_context() as ctx:
        assert shard_with_auto_pad(x, 1, TEXT, valid_len=3) is x
        assert ctx.streams[TEXT] == StreamShard(3, 4, 1, filler_len=4)
        assert gather_sequence(x, 1, TEXT) is x  # one rank: nothing to gather or strip


def test_valid_len_errors():
    ctx = _ctx("trim")
    with pytest.raises(ValueError, match="valid_len must be in"):
        ctx.record_stream(TEXT, 5, valid_len=6)
    ctx.record_stream(TEXT, 8, valid_len=5)
    ctx.record_stream(TEXT, 8)  # a table that travels with the stream: same length, true length known
    with pytest.raises(ValueError, match="must have its length"):
        ctx.record_stream(TEXT, 8, valid_len=6)


def test_mask_is_not_built_without_padding():
    ctx = _ctx("mask")
    ctx.record_stream(IMAGE, 16)
    assert ctx.joint_layout([IMAGE], torch.device("cpu"), torch.float32).key_mask is None


def test_ring_blocks_are_cut_masked_or_kept_whole_per_mode():
    """Ulysses 2 x ring 2: text of 10 tokens, 6 real (filler 4, padded to 12: blocks of 6 rows), in front of 13
    image tokens (padded to 16: blocks of 8). Ring rank 0's block is whole; rank 1's holds the text's filler and
    padding (all of it) and the image's 3 pad rows (trim cuts them, mask masks them, none keeps the image's)."""
    cpu = torch.device("cpu")
    for mode in ("mask", "trim", "none"):
        ctx = _ctx(mode, ring_degree=2)
        ctx.record_stream(TEXT, 10, valid_len=6)
        ctx.record_stream(IMAGE, 13)
        ring = ctx.ring_layout([TEXT, IMAGE], cpu, torch.float32)
        assert ring.rank == 0 and ring.own is ring.blocks[0]
        assert ctx.ring_layout([TEXT, IMAGE], cpu, torch.float32) is ring  # once per forward
        whole, tail = ring.blocks
        assert [s.shard for s in whole.slots] == [StreamShard(6, 0, 2), StreamShard(8, 0, 2)]
        assert [s.shard for s in tail.slots] == [StreamShard(0, 6, 2, filler_len=4), StreamShard(5, 3, 2)]
        assert [s.local_start for s in tail.slots] == [s.local_start for s in whole.slots] == [0, 3]
        assert (whole.kv_len, whole.query_len, whole.key_mask) == (14, 14, None)
        if mode == "trim":
            assert [s.joint_offset for s in tail.slots] == [0, 0] and (tail.kv_len, tail.visible_keys) == (5, 5)
        elif mode == "mask":
            assert [s.joint_offset for s in tail.slots] == [0, 6] and (tail.kv_len, tail.visible_keys) == (14, 5)
            assert (tail.key_mask.view(-1) == 0).tolist() == [False] * 6 + [True] * 5 + [False] * 3
        else:  # the text's filler is cut (and its SP padding with it); the image's padding stays, unmasked
            assert [s.joint_offset for s in tail.slots] == [0, 0] and (tail.kv_len, tail.visible_keys) == (8, 8)
        assert ring.buffer_len == 14 and ring.needs_mask == (mode == "mask")


def test_a_ring_block_of_padding_only_gives_no_keys():
    """One image token at ring 3 (Ulysses 1): blocks 1 and 2 hold padding only; the kernel skips them."""
    for mode in ("mask", "trim"):
        ctx = SequenceParallelContext(None, 3, 2, 1, 3, mode)
        ctx.record_stream(IMAGE, 1)
        ring = ctx.ring_layout([IMAGE], torch.device("cpu"), torch.float32)
        assert ring.rank == 2 and [block.visible_keys for block in ring.blocks] == [1, 0, 0]


def test_stream_length_mismatch_is_an_error():
    ctx = _ctx("trim")
    ctx.record_stream(IMAGE, 16)
    with pytest.raises(ValueError, match="must have its length"):
        ctx.record_stream(IMAGE, 15)


def test_unmasked_padding_warning_is_one_stderr_line_per_process():
    script = textwrap.dedent(
        """
        import torch
        from vllm_omni.diffusion.distributed.sequence_parallel import SequenceParallelContext
        for mode in ("trim", "mask", "none", "none"):
            ctx = SequenceParallelContext(None, 8, 0, 8, 1, mode)
            ctx.record_stream("text", 30)
            ctx.record_stream("image", 6889)
            for dtype in (torch.float32, torch.bfloat16):
                ctx.joint_layout(["text", "image"], torch.device("cpu"), dtype)
        """
    )
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if "unmasked SP padding" in line]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("WARNING")
    # 30 text tokens pad by 2, 6889 image tokens by 7: 9 pad tokens on 6919 real ones at U8.
    assert "9 pad tokens" in lines[0] and "6919 real tokens" in lines[0] and "ulysses_degree=8" in lines[0]
    assert "mask_sp_padding=True" in lines[0] and "trim_sp_padding=True" in lines[0]
