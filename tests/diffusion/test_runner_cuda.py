"""The runner on one CUDA GPU, for a pipeline with two denoisers (Wan2.2 A14B's experts): both are
compiled and graphed, each captures its own graph, and the result is what eager computes.
Skipped on machines without GPUs: `python -m pytest tests/diffusion/test_runner_cuda.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.cuda_graphs import CUDAGraphForward
from vllm_omni.diffusion.data import DiffusionRequest
from vllm_omni.diffusion.loader import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.runner import PipelineRunner

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _run(runner: PipelineRunner, seed: int) -> np.ndarray:
    request = DiffusionRequest(
        request_id=f"r{seed}",
        prompt="a paper boat on a pond",
        negative_prompt="blurry",
        height=80,
        width=112,
        num_frames=17,
        num_inference_steps=2,
        seed=seed,
        output_type="np",
    )
    return runner.run(request, lambda step: None)


def test_both_experts_are_compiled_graphed_and_equal_eager():
    path = resolve_model_path("tiny/wan2.2-t2v")
    spec = read_pipeline_spec(path)
    device = torch.device("cuda", 0)
    eager = PipelineRunner(path, spec, device, torch.float32, rank=0, enforce_eager=True)
    expected = [_run(eager, seed) for seed in (1, 2)]
    del eager
    runner = PipelineRunner(path, spec, device, torch.float32, rank=0)
    actual = [_run(runner, seed) for seed in (1, 2)]
    for name in ("transformer", "transformer_2"):
        graphs = runner.denoisers[name].forward_sharded
        assert isinstance(graphs, CUDAGraphForward) and not graphs.disabled
        # One shape per expert (cond and uncond share it): one capture, replayed by the second request.
        assert graphs.captures == 1, (name, graphs.captures)
    assert runner.graph_capture_failures == []
    for got, want in zip(actual, expected):
        # Inductor's fused norms round float32 differently from eager (see test_omni_cuda.py).
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)
