"""CUDAGraphForward: what it replays, what it leaves eager, and that every tensor argument is live.

The replays run on CUDA only (skipped here without a GPU); the rules that decide them are host
logic and run everywhere. The whole engine's replay is checked in test_omni_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward, _NotReplayable

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def _forward(*, hidden_states, img_ids, scale: float = 1.0, residuals=None):
    out = hidden_states * scale + img_ids.to(hidden_states.dtype).sum(-1, keepdim=True)
    if residuals is not None:
        out = out + sum(residuals)
    return out


def test_cpu_calls_run_eagerly_and_capture_nothing():
    graphed = CUDAGraphForward(_forward)
    x, ids = torch.ones(1, 3, 4), torch.arange(3).view(1, 3, 1)
    assert torch.equal(graphed(hidden_states=x, img_ids=ids), _forward(hidden_states=x, img_ids=ids))
    assert graphed.graphs == {}


def test_tensors_inside_containers_and_objects_are_not_replayable():
    x = torch.ones(1, 3, 4)
    with pytest.raises(_NotReplayable):
        CUDAGraphForward._key(dict(hidden_states=x, residuals=[x]))
    with pytest.raises(_NotReplayable):
        CUDAGraphForward._key(dict(hidden_states=x, attention_kwargs={"processor": object()}))


@pytest.fixture
def cuda_like(monkeypatch):
    """Let CPU tensors pass as CUDA ones, so the key's rules are tested without a GPU."""
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))


def test_graph_key_separates_every_argument(cuda_like):
    from vllm_omni.diffusion.config import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import ParallelState, use_parallel_state

    kwargs = dict(hidden_states=torch.ones(1, 6, 4), txt_ids=torch.ones(1, 5, 4), img_shapes=[[(1, 2, 3)]])
    base = CUDAGraphForward._key(kwargs)
    assert CUDAGraphForward._key(dict(kwargs, hidden_states=torch.ones(1, 8, 4))) != base
    assert CUDAGraphForward._key(dict(kwargs, txt_ids=torch.ones(1, 7, 4))) != base  # any tensor, by rule
    assert CUDAGraphForward._key(dict(kwargs, txt_ids=torch.ones(1, 5, 4, dtype=torch.int64))) != base
    assert CUDAGraphForward._key(dict(kwargs, img_shapes=[[(1, 3, 2)]])) != base
    assert CUDAGraphForward._key(dict(kwargs, attention_kwargs={})) != base
    # Rows of a batch with their own text lengths (host ints): a graph replays only for the lengths it captured.
    rows = CUDAGraphForward._key(dict(kwargs, text_valid_len=(5, 3)))
    assert rows != CUDAGraphForward._key(dict(kwargs, text_valid_len=(3, 5))) and rows != base
    trim = ParallelState(DiffusionParallelConfig(ulysses_degree=2), 0, 2, None, None)
    none = ParallelState(DiffusionParallelConfig(ulysses_degree=2, trim_sp_padding=False), 0, 2, None, None)
    with use_parallel_state(trim):
        key_trim = CUDAGraphForward._key(kwargs)
    with use_parallel_state(none):
        key_none = CUDAGraphForward._key(kwargs)
    assert len({base, key_trim, key_none}) == 3


@needs_cuda
def test_every_tensor_argument_is_copied_in_at_each_replay():
    """An argument the old wrapper did not know by name (FLUX.2's img_ids) must not be replayed stale."""
    graphed = CUDAGraphForward(_forward)
    x = torch.randn(1, 6, 4, device="cuda")
    for step in range(3):
        ids = torch.randint(0, 100, (1, 6, 3), device="cuda")
        out = graphed(hidden_states=x * step, img_ids=ids, scale=2.0)
        torch.testing.assert_close(out, _forward(hidden_states=x * step, img_ids=ids, scale=2.0), rtol=0, atol=0)
    assert len(graphed.graphs) == 1
    residual = torch.ones_like(x)
    out = graphed(hidden_states=x, img_ids=ids, residuals=[residual])  # runs eagerly
    torch.testing.assert_close(out, _forward(hidden_states=x, img_ids=ids, residuals=[residual]))
    assert len(graphed.graphs) == 1
