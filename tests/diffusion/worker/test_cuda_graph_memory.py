"""A captured CUDA graph owns every tensor it reads (CUDA only; skipped without a GPU).

Replays read device memory by address. A tensor the capture read but does not own (the padding
mask cached from the capture's eager warm-up, a rotary table in diffusers' evicting LRU) can be
freed and handed out again; the replay then reads someone else's data with no error. Each test
captures, frees and overwrites as much memory as it can (NaN everywhere), and replays.
"""

from __future__ import annotations

import gc

import pytest
import torch

from vllm_omni.diffusion.attention.backends import configure_attention_backend
from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.comm import SimulatedGroup
from vllm_omni.diffusion.distributed.parallel_state import ParallelState, use_parallel_state
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")

CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=32,
    num_attention_heads=4,
    joint_attention_dim=24,
    axes_dims_rope=(8, 12, 12),
)
ROTARY_CACHE = 128  # diffusers' QwenEmbedRope._compute_video_freqs lru_cache(maxsize=128)


def _inputs(grid: tuple[int, int, int], text_len: int = 11, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    tokens = grid[0] * grid[1] * grid[2]
    cpu = dict(
        hidden_states=torch.randn(1, tokens, CONFIG["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(1, text_len, CONFIG["joint_attention_dim"], generator=gen),
        timestep=torch.rand(1, generator=gen),
    )
    return {k: v.cuda() for k, v in cpu.items()} | dict(img_shapes=[[grid]], return_dict=False)


def _churn() -> None:
    """Hand out every freed block again and fill it with NaN: from the allocator's cache on the
    current stream and on side streams (a capture's warm-up runs on one, and the blocks it frees
    go back to that stream's pool), then, after `empty_cache`, from the driver."""
    for _ in range(2):
        torch.cuda.synchronize()
        for stream, count in [(torch.cuda.current_stream(), 8)] + [(torch.cuda.Stream(), 2) for _ in range(40)]:
            with torch.cuda.stream(stream):
                poisoned = [torch.full((1 << k,), float("nan"), device="cuda") for k in range(23) for _ in range(count)]
                del poisoned
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


@pytest.fixture
def model():
    torch.manual_seed(0)
    model = QwenImageTransformer2DModel(**CONFIG).cuda().eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    yield model
    # The model and its CUDAGraphForward refer to each other: free the graphs now, not whenever the
    # garbage collector runs (during the next test's capture, say).
    model.sharded_wrapper = None
    del model
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    configure_attention_backend(None, False)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_a_replay_after_the_allocator_reused_everything_equals_eager(model, mode):
    config = DiffusionParallelConfig(ulysses_degree=2, mask_sp_padding=mode == "mask")
    configure_attention_backend(None, config.mask_sp_padding)
    rank0 = ParallelState(config, rank=0, world_size=2, sp_group=SimulatedGroup(2), cfg_group=None)
    inputs = _inputs((1, 5, 7))  # 35 image tokens + 11 text: padded at U2 on both streams
    with use_parallel_state(rank0), torch.inference_mode():
        expected = model(**inputs)[0].clone()
        graphed = CUDAGraphForward(model.forward_sharded)
        model.sharded_wrapper = graphed
        model(**inputs)  # captures
        assert len(graphed.graphs) == 1
        _churn()
        actual = model(**inputs)[0]
        assert graphed.captures == 1  # a replay, not a new capture
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)


def test_a_replay_after_its_rotary_table_left_diffusers_cache_equals_eager(model):
    inputs = _inputs((1, 6, 6))
    with torch.inference_mode():
        expected = model(**inputs)[0].clone()
        graphed = CUDAGraphForward(model.forward_sharded)
        model.sharded_wrapper = graphed
        model(**inputs)  # captures
        # More grids than the rotary cache holds: the first grid's table is evicted and freed.
        for width in range(1, ROTARY_CACHE + 8):
            model.pos_embed([[(1, 2, width)]], max_txt_seq_len=11, device=torch.device("cuda"))
        _churn()
        actual = model(**inputs)[0]
        assert graphed.captures == 1
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-6)
