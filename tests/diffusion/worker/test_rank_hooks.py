"""A rank's test seams (diffusion/worker/hooks.py): production has none, and the factory the tests name
(testing/hooks.py) builds, per rank, the doubles the environment switches on, and only those."""

from __future__ import annotations

import json

import pytest

from vllm_omni import envs
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.worker.hooks import rank_hooks
from vllm_omni.testing.graphs import SimulatedGraphs
from vllm_omni.testing.hooks import FACTORY, MEMORY_TRACE

DOUBLES = (
    envs.TEST_FAULT,
    envs.TEST_MEMORY_TRACE,
    envs.TEST_CUDA_GRAPHS,
    envs.TEST_GPU_MEMORY,
    envs.TEST_MEASURED_STEP,
)


@pytest.fixture
def environment(monkeypatch):
    for name in DOUBLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(envs.TEST_HOOKS, FACTORY)
    return monkeypatch


def test_a_rank_has_no_hooks_without_the_factory_variable_even_with_a_double_switched_on(environment):
    environment.setenv(envs.TEST_FAULT, json.dumps({"kind": "raise", "rank": 0, "step": 0}))
    environment.delenv(envs.TEST_HOOKS)
    assert rank_hooks(0) is None


def test_the_factory_builds_no_hooks_where_no_double_is_switched_on(environment):
    assert rank_hooks(0) is None


def test_the_hooks_raise_the_fault_at_its_point_on_its_rank_only(environment):
    environment.setenv(envs.TEST_FAULT, json.dumps({"kind": "raise", "rank": 1, "step": 2, "phase": "decode"}))
    request = DiffusionRequest("req-1", "a cat")
    hooks, other = rank_hooks(1), rank_hooks(0)
    assert hooks is not None and other is not None
    hooks.at("decode", 1, request, lambda: False)  # another tile
    hooks.at("step", 2, request, lambda: False)  # another point
    other.at("decode", 2, request, lambda: False)  # another rank
    with pytest.raises(RuntimeError, match="test fault on rank 1 at decode 2"):
        hooks.at("decode", 2, request, lambda: False)


def test_the_hooks_carry_the_simulated_graphs_memory_step_and_trace(environment):
    environment.setenv(envs.TEST_CUDA_GRAPHS, "simulate:fail-rank=1")
    environment.setenv(envs.TEST_GPU_MEMORY, "8GiB,200MiB")
    environment.setenv(envs.TEST_MEASURED_STEP, "1.5")
    environment.setenv(envs.TEST_MEMORY_TRACE, "a probe")
    hooks = rank_hooks(0)
    assert hooks.graph_backend() == SimulatedGraphs(fail_rank=1)
    assert hooks.device_memory() == (8 * 2**30, 200 * 2**20)
    assert hooks.measured_step_bytes(1000) == 1500
    assert hooks.request_extras(DiffusionRequest("req-1", "a cat")) == {}  # not the traced prompt
    traced = hooks.request_extras(DiffusionRequest("req-2", "a probe"))[MEMORY_TRACE]
    assert traced.keys() == {"objects", "tensors", "tensor_bytes"} and traced["objects"] > 0
