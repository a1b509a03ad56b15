"""All ranks of a Ulysses group simulated in one process, for degrees the gloo tests do not reach
(4, 8) and, on a GPU, for the CUDA kernels in bf16. The all-to-all is done by indexing:
rank r receives chunk r of every rank's send buffer. Ring attention (USP) likewise: every rank's
key/value block is built first, and each ring step hands a rank the block of the ring rank it would
receive from (ring 4, Ulysses 2 x ring 4, and on a GPU in bf16).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from vllm_omni.diffusion.attention import layer
from vllm_omni.diffusion.attention.backends import resolve_attention_backend
from vllm_omni.diffusion.attention.layer import attend_joint, attend_ring, pack_streams, unpack_streams
from vllm_omni.diffusion.distributed.comm import RingPass, SimulatedGroup
from vllm_omni.diffusion.distributed.sequence_parallel import (
    IMAGE,
    TEXT,
    SequenceParallelContext,
    shard_with_auto_pad,
    use_sp_context,
)

HEADS, HEAD_DIM = 8, 16


def _exchange(buffers: list[torch.Tensor]) -> list[torch.Tensor]:
    return [torch.stack([buf[rank] for buf in buffers]) for rank in range(len(buffers))]


def simulated_ulysses(image, text, world, mode, order, pad_noise=None, text_valid_len=None):
    """Run every rank's attention; return the gathered (image, text) outputs without padding.

    `text_valid_len`: the text's first tokens, the rest bucket filler (text compaction's)."""
    ctxs = [SequenceParallelContext(None, world, rank, world, 1, mode) for rank in range(world)]
    local = []
    for ctx in ctxs:
        with use_sp_context(ctx):
            streams = {
                IMAGE: [shard_with_auto_pad(t, 1, IMAGE) for t in image],
                TEXT: [shard_with_auto_pad(t, 1, TEXT, valid_len=text_valid_len) for t in text],
            }
        if pad_noise is not None:
            for name, tensors in streams.items():
                shard = ctx.streams[name]
                n_real = max(0, min(shard.local_seq_len, shard.original_seq_len - ctx.rank * shard.local_seq_len))
                for t in tensors:
                    t[:, n_real:] = torch.randn(t[:, n_real:].shape, generator=pad_noise, dtype=torch.float32).to(t)
        local.append(streams)
    layout = ctxs[0].joint_layout(order, image[0].device, image[0].dtype)
    backend = resolve_attention_backend(needs_mask=layout.key_mask is not None)
    recv = _exchange([pack_streams(layout, streams) for streams in local])
    back = _exchange([attend_joint(r, layout, backend) for r in recv])
    outs = [dict(zip([s.name for s in layout.slots], unpack_streams(layout, b))) for b in back]
    gathered = {}
    for slot in layout.slots:
        full = torch.cat([o[slot.name] for o in outs], dim=1)
        gathered[slot.name] = full[:, : slot.shard.original_seq_len]
    return gathered[IMAGE], gathered[TEXT]


def simulated_ring(image, text, ulysses, ring, mode, order, monkeypatch, pad_noise=None):
    """Every rank of a Ulysses x ring group in turn; the gathered (image, text) outputs without padding."""
    world = ulysses * ring
    ctxs = [SequenceParallelContext(None, world, rank, ulysses, ring, mode) for rank in range(world)]
    sends, layouts = [], []
    for ctx in ctxs:
        with use_sp_context(ctx):
            streams = {
                IMAGE: [shard_with_auto_pad(t, 1, IMAGE) for t in image],
                TEXT: [shard_with_auto_pad(t, 1, TEXT) for t in text],
            }
        if pad_noise is not None:
            for name, tensors in streams.items():
                shard = ctx.streams[name]
                n_real = max(0, min(shard.local_seq_len, shard.original_seq_len - ctx.rank * shard.local_seq_len))
                for t in tensors:
                    t[:, n_real:] = torch.randn(t[:, n_real:].shape, generator=pad_noise, dtype=torch.float32).to(t)
        layouts.append(ctx.ring_layout(order, image[0].device, image[0].dtype))
        sends.append(pack_streams(layouts[-1].own, streams))
    # The Ulysses all-to-all within each run of `ulysses` ranks: rank r*U + u receives chunk u of its group's sends.
    recvs = [
        torch.stack([sends[rank - rank % ulysses + peer][rank % ulysses] for peer in range(ulysses)])
        for rank in range(world)
    ]
    blocks = [layer._joint_buffer(recv, lay.own, None, lay.buffer_len)[1:] for recv, lay in zip(recvs, layouts)]
    steps = {}

    def ring_pass(send, recv, group, ring_rank):  # the block of the ring rank `step + 1` places before
        rank = current[0]
        steps[rank] = steps.get(rank, 0) + 1
        recv.copy_(blocks[((ring_rank - steps[rank]) % ring) * ulysses + rank % ulysses])
        return RingPass([])

    monkeypatch.setattr(layer, "ring_pass", ring_pass)
    backs, current = [], [0]
    for rank, (recv, lay) in enumerate(zip(recvs, layouts)):
        current[0] = rank
        backend = resolve_attention_backend(needs_mask=lay.needs_mask)
        backs.append(attend_ring(recv, lay, backend, SimulatedGroup(ring)))
    backs = [
        torch.stack([backs[rank - rank % ulysses + peer][rank % ulysses] for peer in range(ulysses)])
        for rank in range(world)
    ]
    outs = [dict(zip([s.name for s in lay.own.slots], unpack_streams(lay.own, b))) for lay, b in zip(layouts, backs)]
    gathered = {}
    for slot in layouts[0].own.slots:
        full = torch.cat([o[slot.name] for o in outs], dim=1)
        gathered[slot.name] = full[:, : ctxs[0].streams[slot.name].original_seq_len]
    return gathered[IMAGE], gathered[TEXT]


@pytest.mark.parametrize("ulysses,ring", [(1, 4), (2, 4)], ids=["r4", "u2r4"])
@pytest.mark.parametrize("order", [[TEXT, IMAGE], [IMAGE, TEXT]], ids=["front", "rear"])
def test_simulated_ring_4_and_ulysses_2_by_ring_4_match_reference(ulysses, ring, order, monkeypatch):
    """Padding inside a block (83 tokens: blocks of 21 or 22 rows), whole blocks of padding (5 and 1 tokens)."""
    for image_len, text_len in [(83, 30), (64, 16), (5, 3), (1, 9)]:
        image, text = _inputs(image_len, text_len, "cpu", torch.float32, batch=2)
        ref_img, ref_txt = reference(image, text, order)
        for mode in ("mask", "trim"):
            img, txt = simulated_ring(image, text, ulysses, ring, mode, order, monkeypatch)
            torch.testing.assert_close(img, ref_img, rtol=0, atol=1e-5)
            torch.testing.assert_close(txt, ref_txt, rtol=0, atol=1e-5)


def reference(image, text, order):
    parts = {IMAGE: image, TEXT: text}
    joint = [torch.cat([parts[name][i] for name in order], dim=1).transpose(1, 2) for i in range(3)]
    out = F.scaled_dot_product_attention(*joint).transpose(1, 2)
    lengths = [parts[name][0].shape[1] for name in order]
    by_name = dict(zip(order, out.split(lengths, dim=1)))
    return by_name[IMAGE], by_name[TEXT]


def _inputs(image_len, text_len, device, dtype, batch=1):
    gen = torch.Generator().manual_seed(image_len * 31 + text_len)

    def qkv(n):
        return [torch.randn(batch, n, HEADS, HEAD_DIM, generator=gen).to(device, dtype) for _ in range(3)]

    return qkv(image_len), qkv(text_len)


@pytest.mark.parametrize("world", [4, 8])
@pytest.mark.parametrize("order", [[TEXT, IMAGE], [IMAGE, TEXT]], ids=["front", "rear"])
def test_simulated_degrees_4_and_8_match_reference(world, order):
    for image_len, text_len in [(83, 30), (64, 16), (5, 3), (1, 9)]:
        image, text = _inputs(image_len, text_len, "cpu", torch.float32, batch=2)
        ref_img, ref_txt = reference(image, text, order)
        for mode in ("mask", "trim"):
            img, txt = simulated_ulysses(image, text, world, mode, order)
            torch.testing.assert_close(img, ref_img, rtol=0, atol=1e-5)
            torch.testing.assert_close(txt, ref_txt, rtol=0, atol=1e-5)
        img, _ = simulated_ulysses(image, text, world, "none", order)
        assert (img - ref_img).abs().max() > 0 or (image_len % world == 0 and text_len % world == 0)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_text_filler_longer_than_the_image_in_front_stays_exact(mode):
    # 8 valid text tokens and 26 of filler (a 34-token bucket) in front of a 15-token image: the text
    # stream's filler rows reach past every real row of the joint sequence (a batch's long prompt row).
    image, text = _inputs(15, 34, "cpu", torch.float32)
    ref_img, ref_txt = reference(image, [t[:, :8] for t in text], [TEXT, IMAGE])
    img, txt = simulated_ulysses(image, text, 2, mode, [TEXT, IMAGE], text_valid_len=8)
    torch.testing.assert_close(img, ref_img, rtol=0, atol=1e-5)
    torch.testing.assert_close(txt[:, :8], ref_txt, rtol=0, atol=1e-5)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_cuda_bf16_kernels_are_exact_and_pad_invariant(mode):
    order = [TEXT, IMAGE]
    image, text = _inputs(6889, 30, "cuda", torch.bfloat16)
    ref_img, ref_txt = reference([t.float() for t in image], [t.float() for t in text], order)
    img, txt = simulated_ulysses(image, text, 8, mode, order)
    # bf16 kernels: compare with an fp32 reference at bf16 resolution.
    torch.testing.assert_close(img.float(), ref_img, rtol=0, atol=2e-2)
    torch.testing.assert_close(txt.float(), ref_txt, rtol=0, atol=2e-2)
    noisy_img, noisy_txt = simulated_ulysses(image, text, 8, mode, order, pad_noise=torch.Generator().manual_seed(3))
    assert torch.equal(noisy_img, img) and torch.equal(noisy_txt, txt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_cuda_bf16_ring_kernels_are_exact_and_pad_invariant(mode, monkeypatch):
    """Qwen-Image 1328x1328 at Ulysses 2 x ring 4 on the GPU: flash (trim) and memory-efficient (masked block)
    kernels with their log-sum-exp, merged in fp32, against an fp32 reference at bf16 resolution."""
    order = [TEXT, IMAGE]
    image, text = _inputs(6889, 30, "cuda", torch.bfloat16)
    ref_img, ref_txt = reference([t.float() for t in image], [t.float() for t in text], order)
    img, txt = simulated_ring(image, text, 2, 4, mode, order, monkeypatch)
    torch.testing.assert_close(img.float(), ref_img, rtol=0, atol=2e-2)
    torch.testing.assert_close(txt.float(), ref_txt, rtol=0, atol=2e-2)
    noise = torch.Generator().manual_seed(3)
    noisy_img, noisy_txt = simulated_ring(image, text, 2, 4, mode, order, monkeypatch, pad_noise=noise)
    assert torch.equal(noisy_img, img) and torch.equal(noisy_txt, txt)
