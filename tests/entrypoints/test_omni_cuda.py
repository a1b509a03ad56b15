"""The offline engine on CUDA GPUs (NCCL between ranks); skipped on machines without GPUs.

Run on a GPU machine: `python -m pytest tests/entrypoints/test_omni_cuda.py`.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA GPUs")

HEIGHT, WIDTH = 208, 272  # 13x17 tokens: padded at Ulysses 2


def _generate(omni, prompt="a red fox in the snow", **kwargs):
    args = dict(height=HEIGHT, width=WIDTH, num_inference_steps=3, seed=11, output_type="np")
    args.update(kwargs)
    return np.stack(omni.generate(prompt, **args))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("mode", ["trim", "mask"])
def test_ulysses_2_on_two_gpus_equals_one_gpu(mode):
    from vllm_omni import Omni

    with Omni("tiny/qwen-image", device="cuda", dtype="float32") as omni:
        expected = _generate(omni, negative_prompt=" ")
    with Omni(
        "tiny/qwen-image", ulysses_degree=2, device="cuda", dtype="float32", mask_sp_padding=mode == "mask"
    ) as omni:
        actual = _generate(omni, negative_prompt=" ")
        assert omni.engine.config.device == "cuda"
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-3)


def test_bfloat16_on_one_gpu_runs_and_is_finite():
    from vllm_omni import Omni

    with Omni("tiny/qwen-image") as omni:
        assert (omni.engine.config.device, omni.engine.config.dtype) == ("cuda", "bfloat16")
        images = _generate(omni)
    assert images.shape == (1, HEIGHT, WIDTH, 3) and np.isfinite(images).all()


def test_compiled_blocks_and_cuda_graphs_compute_what_eager_computes():
    from vllm_omni import Omni

    with Omni("tiny/qwen-image", dtype="float32", enforce_eager=True) as omni:
        eager = _generate(omni, negative_prompt=" ")
    with Omni("tiny/qwen-image", dtype="float32") as omni:  # the default: compiled blocks, CUDA graphs
        graphed = _generate(omni, negative_prompt=" ")
        again = _generate(omni, negative_prompt=" ")  # replays the captured graphs
    # Inductor's fused norms round float32 differently (seen on an H200: at most 6e-4 after 3 steps
    # and the VAE); a graph replaying wrong or stale inputs is off by far more.
    np.testing.assert_allclose(graphed, eager, rtol=0, atol=2e-3)
    np.testing.assert_array_equal(again, graphed)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_cfg_parallel_with_cuda_graphs_on_two_gpus_equals_one_gpu_over_requests_that_miss_apart():
    """The two CFG groups miss their graph caches at different requests (group 1 has the negative
    prompt as its prompt): captures are agreed per SP group, so nothing desynchronises."""
    from vllm_omni import Omni

    # (prompt, negative): group 0 captures at requests 1 and 2, group 1 at requests 1 and 3.
    requests = [("a red fox", " "), ("a red fox in the snow at dawn, photographed", " "), ("a red fox", "blurry")]

    with Omni("tiny/qwen-image", device="cuda", dtype="float32", enforce_eager=True) as omni:
        expected = [
            _generate(omni, negative_prompt=neg, true_cfg_scale=4.0, prompt=prompt)[0] for prompt, neg in requests
        ]
    with Omni("tiny/qwen-image", cfg_parallel_size=2, device="cuda", dtype="float32") as omni:
        actual = [
            _generate(omni, negative_prompt=neg, true_cfg_scale=4.0, prompt=prompt)[0] for prompt, neg in requests
        ]
        assert omni.engine.graph_capture_failures == 0 and omni.engine.restarts == 0
    for a, e in zip(actual, expected):
        np.testing.assert_allclose(a, e, rtol=0, atol=2e-3)  # compiled blocks round float32 differently


def test_after_the_warm_up_no_size_or_prompt_length_recompiles(capfd, monkeypatch):
    """The second warm-up request (engine.warmup_requests) makes the compiled blocks dynamic at start-up."""
    from vllm_omni import Omni

    monkeypatch.setenv("TORCH_LOGS", "recompiles")  # the workers log each recompile, with its cause
    with Omni("tiny/qwen-image") as omni:
        start = capfd.readouterr().err
        assert "Warm-up done in" in start and "(2 request(s):" in start
        assert "Recompiling function" in start  # the second warm-up request recompiled: the log works
        omni.generate("a red fox in the snow, " * 30, height=208, width=272, num_inference_steps=2, seed=1)
        omni.generate("a cat", height=400, width=336, num_inference_steps=2, seed=1, negative_prompt=" ")
        after = capfd.readouterr().err
    assert "Recompiling function" not in after, after[-3000:]


def test_interleaved_requests_with_compiled_blocks_and_cuda_graphs_equal_their_runs_alone():
    # The CPU test (test_omni_interleave.py) covers SP, CFG parallel and the step cache; here the inner request
    # replays and captures graphs (another size) between two of the outer one's replays.
    import time

    from vllm_omni import Omni
    from vllm_omni.diffusion.request import GenerationParams

    outer = GenerationParams("a red fox in the snow", height=HEIGHT, width=WIDTH, num_inference_steps=200, seed=11,
                             negative_prompt=" ", true_cfg_scale=4.0, output_type="np")  # fmt: skip
    inner = GenerationParams("a cat", height=128, width=128, num_inference_steps=4, seed=3, output_type="np")
    with Omni("tiny/qwen-image", dtype="float32", scheduling_policy="fair", max_num_seqs=2) as omni:

        def run(params):
            return omni._call(omni.scheduler.submit(params))

        alone = {p.prompt: np.stack(omni._call(run(p).wait()).result.images) for p in (outer, inner)}
        first = run(outer)
        while first.progress < 3 and not first.finished:
            time.sleep(0.005)
        second = run(inner)
        first, second = omni._call(first.wait()), omni._call(second.wait())
    assert second.completed_at < first.completed_at and first.suspended_s > 0
    for job in (first, second):
        np.testing.assert_array_equal(np.stack(job.result.images), alone[job.request.prompt])
