"""The MLP's bias + tanh GELU in its GEMM's epilogue (worker/fused_gelu.py) on a CUDA GPU (skipped elsewhere), at
Qwen-Image's MLP shape (1024x1024: 4096 image tokens, 3072 -> 12288): at least as exact as the reference path against
an fp64 reference, GEMM kernels only (no GELU pass after them), and the same bits compiled and replayed from a CUDA
graph as the engine runs a block.

    pytest -v -rA tests/diffusion/worker/test_fused_gelu_cuda.py
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from diffusers.models.activations import GELU

from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphs
from vllm_omni.diffusion.worker.fused_gelu import EpilogueGELU, fuse_gelu_epilogues

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOKENS, DIM, HIDDEN = 4096, 3072, 12288
TOLERANCE = 1.01  # the fused path rounds once where the reference rounds twice: never worse, up to noise


def _mlp() -> GELU:
    """diffusers' GELU at the shape, swapped: `GELU.forward(mlp, x)` is still the reference path on its weights."""
    torch.manual_seed(0)
    mlp = GELU(DIM, HIDDEN, approximate="tanh").to("cuda", torch.bfloat16).eval().requires_grad_(False)
    assert fuse_gelu_epilogues(mlp) == 1 and isinstance(mlp, EpilogueGELU)
    return mlp


def _hidden(seed: int) -> torch.Tensor:
    gen = torch.Generator("cuda").manual_seed(seed)
    return torch.randn(1, TOKENS, DIM, generator=gen, device="cuda", dtype=torch.bfloat16)


def _relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def _kernels(fn, *args) -> list[str]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [event.name for event in prof.events() if event.device_type == torch.autograd.DeviceType.CUDA]


def test_as_exact_as_the_reference_path_against_fp64():
    mlp, x = _mlp(), _hidden(1)
    proj = mlp.proj
    with torch.inference_mode():
        exact = F.gelu(F.linear(x.double(), proj.weight.double(), proj.bias.double()), approximate="tanh")
        fused = _relative_l2(mlp(x), exact)
        eager = _relative_l2(GELU.forward(mlp, x), exact)  # the GEMM's output rounded to bf16, then the GELU's
        compiled = _relative_l2(torch.compile(lambda h: GELU.forward(mlp, h))(x), exact)  # inductor: mm, bias+GELU
    print(f"relative L2 against fp64: fused {fused:.3e}, reference eager {eager:.3e}, compiled {compiled:.3e}")
    assert fused <= TOLERANCE * min(eager, compiled)


def _after_the_gemm(kernel: str) -> bool:
    """A GELU pass of torch's own (at::native's elementwise kernels) or of inductor's (triton)."""
    return "at::native" in kernel or kernel.startswith("triton")


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_the_gemm_takes_the_gelu_and_no_kernel_runs_after_it(compiled):
    """Where cuBLASLt could not take the epilogue, torch would run its GELU after the GEMM (at::native's kernel); the
    reference path shows that the check sees such a pass."""
    mlp, x = _mlp(), _hidden(1)
    fused, reference = mlp, lambda h: GELU.forward(mlp, h)
    if compiled:
        fused, reference = torch.compile(fused), torch.compile(reference)
    with torch.inference_mode():
        fused(x), reference(x)  # compile, warm up cuBLASLt
        kernels = _kernels(fused, x)
        unfused = _kernels(reference, x)
    print(f"fused: {kernels}\nreference: {unfused}")
    assert kernels and not [name for name in kernels if _after_the_gemm(name)]
    assert [name for name in unfused if _after_the_gemm(name)]


def test_compiled_and_replayed_from_a_cuda_graph_it_is_the_eager_bits():
    mlp, x = _mlp(), _hidden(1)
    compiled = torch.compile(mlp)  # inductor, as compile_repeated_blocks compiles a block
    with torch.inference_mode():
        eager = mlp(x)
        assert torch.equal(compiled(x), eager)
        graph, captured = CUDAGraphs().capture(
            lambda hidden_states: compiled(hidden_states), dict(hidden_states=x), 1, None
        )
        for seed in (2, 1):  # new inputs in the same buffer, then the first ones again
            x.copy_(_hidden(seed))
            graph.replay()
            torch.cuda.synchronize()
            assert torch.equal(captured, mlp(x))
    assert torch.equal(captured, eager)


def test_the_runner_fuses_a_denoisers_gelus_and_serves_with_compiled_blocks_and_graphs():
    from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
    from vllm_omni.diffusion.request import DiffusionRequest
    from vllm_omni.diffusion.worker.runner import PipelineRunner

    path = resolve_model_path("tiny/qwen-image")
    runner = PipelineRunner(path, read_pipeline_spec(path), torch.device("cuda", 0), torch.bfloat16, rank=0)
    transformer = runner.denoisers["transformer"]
    fused = [module for module in transformer.modules() if isinstance(module, EpilogueGELU)]
    assert len(fused) == 2 * transformer.config.num_layers  # each block's image and text MLP
    request = DiffusionRequest(
        request_id="g", prompt="a paper boat on a pond", negative_prompt="blurry", height=80, width=112,
        num_inference_steps=3, true_cfg_scale=4.0, seed=5, output_type="np",
    )  # fmt: skip
    images = [runner.run(request, lambda step: None) for _ in range(2)]  # the second replays only
    assert runner.graph_capture_failures == [] and runner.graph_captures >= 1
    np.testing.assert_allclose(images[1], images[0], rtol=0, atol=2e-3)
