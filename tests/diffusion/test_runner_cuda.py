"""The runner on one CUDA GPU, for a pipeline with two denoisers (Wan2.2 A14B's experts): both are
compiled and graphed, each captures its own graph, and the result is what eager computes; and the
step cache with real CUDA graphs (tiny Qwen-Image) decides and computes what it does eagerly.
Skipped on machines without GPUs: `python -m pytest tests/diffusion/test_runner_cuda.py`.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.config import StepCacheConfig
from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward
from vllm_omni.diffusion.worker.runner import PipelineRunner
from vllm_omni.diffusion.worker.step_cache import CachedForward

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
        graphs = runner.denoisers[name].sharded_wrapper
        assert isinstance(graphs, CUDAGraphForward) and not graphs.disabled
        # One shape per expert (cond and uncond share it): one capture, replayed by the second request.
        assert graphs.captures == 1, (name, graphs.captures)
    assert runner.graph_capture_failures == []
    for got, want in zip(actual, expected):
        # Inductor's fused norms round float32 differently from eager (see test_omni_cuda.py).
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


def _qwen_request(seed: int) -> DiffusionRequest:
    return DiffusionRequest(
        request_id=f"q{seed}",
        prompt="a cat holding a sign",
        negative_prompt="blurry",
        height=208,
        width=272,
        num_inference_steps=8,
        true_cfg_scale=4.0,
        seed=seed,
        cache_threshold=0.55,  # skips steps 3 and 5 of the tiny model (tests/entrypoints/test_omni_step_cache.py)
        output_type="np",
    )


def test_the_step_cache_with_real_graphs_decides_as_eager_and_replays_its_residuals():
    """A computed step replays its graph, which writes the cache's residuals without running Python: the
    second request (replays only) must skip the steps eager skips and give eager's image."""
    path = resolve_model_path("tiny/qwen-image")
    spec = read_pipeline_spec(path)
    device = torch.device("cuda", 0)
    cache = StepCacheConfig(threshold=0.55)
    eager = PipelineRunner(path, spec, device, torch.float32, rank=0, enforce_eager=True, cache=cache)
    expected = [(_run_request(eager, seed), eager.cache.summary()["decisions"]) for seed in (1, 2)]
    del eager
    runner = PipelineRunner(path, spec, device, torch.float32, rank=0, cache=cache)
    actual = [(_run_request(runner, seed), runner.cache.summary()["decisions"]) for seed in (1, 2)]
    graphs = runner.denoisers["transformer"].sharded_wrapper
    assert isinstance(graphs, CachedForward) and not graphs.graphed.disabled
    assert graphs.captures == 2  # the prompt's and the negative prompt's text lengths
    assert runner.graph_capture_failures == []
    for (got, got_decisions), (want, want_decisions) in zip(actual, expected):
        assert got_decisions == want_decisions
        assert any(not computed for steps in want_decisions.values() for computed in steps.values())
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


def _run_request(runner: PipelineRunner, seed: int) -> np.ndarray:
    return runner.run(_qwen_request(seed), lambda step: None)


@pytest.mark.parametrize("name", ["tiny/qwen-image", "tiny/wan2.2-t2v"])
def test_cfg_in_one_pass_with_compiled_blocks_and_real_graphs_gives_two_forwards_image(name):
    """Both rows of a CFG step in one graphed forward (worker/cfg_batch.py): each replay after the first step,
    eager's two-forward image."""
    path = resolve_model_path(name)
    spec = read_pipeline_spec(path)
    device = torch.device("cuda", 0)
    fields = dict(num_frames=17) if spec.modality == "video" else dict(true_cfg_scale=4.0)
    request = DiffusionRequest(
        request_id="c", prompt="a paper boat on a pond", negative_prompt="blurry", height=80, width=112,
        num_inference_steps=4, seed=5, output_type="np", **fields,
    )  # fmt: skip
    eager = PipelineRunner(path, spec, device, torch.float32, rank=0, enforce_eager=True)
    expected = eager.run(request, lambda step: None)
    del eager
    runner = PipelineRunner(path, spec, device, torch.float32, rank=0)
    for _ in range(2):  # the second request replays only
        actual = runner.run(dataclasses.replace(request, cfg_one_pass=True), lambda step: None)
        assert runner.cfg_one_pass_steps == 3
        np.testing.assert_allclose(actual, expected, rtol=0, atol=2e-3)
    assert runner.graph_capture_failures == []
