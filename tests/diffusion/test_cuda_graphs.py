"""CUDAGraphForward: what it replays and what it leaves eager (the replay itself runs in test_omni_cuda.py)."""

from __future__ import annotations

import torch

from vllm_omni.diffusion.cuda_graphs import CUDAGraphForward


def test_cpu_and_masked_calls_run_eagerly():
    calls = []

    def forward(**kwargs):
        calls.append(kwargs)
        return (kwargs["hidden_states"] * 2,)

    graphed = CUDAGraphForward(forward)
    x = torch.ones(1, 3, 4)
    assert torch.equal(graphed(hidden_states=x, encoder_hidden_states_mask=None, return_dict=False)[0], x * 2)
    assert len(calls) == 1 and graphed.graphs == {}
    cuda_like = {"hidden_states": x, "encoder_hidden_states_mask": torch.ones(1, 2)}
    assert not CUDAGraphForward._replayable(cuda_like)


def test_graph_key_separates_shapes_and_padding_modes():
    from vllm_omni.diffusion.data import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import ParallelState, use_parallel_state

    kwargs = dict(hidden_states=torch.ones(1, 6, 4), timestep=torch.ones(1), img_shapes=[[(1, 2, 3)]])
    base = CUDAGraphForward._key(kwargs)
    assert CUDAGraphForward._key(dict(kwargs, hidden_states=torch.ones(1, 8, 4))) != base
    assert CUDAGraphForward._key(dict(kwargs, img_shapes=[[(1, 3, 2)]])) != base
    trim = ParallelState(DiffusionParallelConfig(ulysses_degree=2), 0, 2, None, None)
    none = ParallelState(DiffusionParallelConfig(ulysses_degree=2, trim_sp_padding=False), 0, 2, None, None)
    with use_parallel_state(trim):
        key_trim = CUDAGraphForward._key(kwargs)
    with use_parallel_state(none):
        key_none = CUDAGraphForward._key(kwargs)
    assert len({base, key_trim, key_none}) == 3
