"""The MLP's bias + tanh GELU in its GEMM's epilogue (worker/fused_gelu.py), on the CPU: which modules are swapped,
that each call takes the fused path only where it may (decided as if on a GPU, with `on_cuda`), that on the CPU the
swapped module computes the reference's bits, and that a compiled block traces it without a graph break or a
recompile per call. The fused GEMM itself on a GPU: test_fused_gelu_cuda.py.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry, ModelHook
from diffusers.models.activations import GELU
from diffusers.models.attention import FeedForward

from vllm_omni.diffusion.worker import fused_gelu
from vllm_omni.diffusion.worker.fused_gelu import EpilogueGELU, epilogue_applies, fuse_gelu_epilogues

DIM = 32


class Marked(torch.Tensor):
    """A tensor subclass standing in for a quantized weight (torchao's FP8 tensors are subclasses)."""


def _ffn(activation_fn: str = "gelu-approximate", dtype: torch.dtype = torch.bfloat16) -> FeedForward:
    torch.manual_seed(0)
    return FeedForward(DIM, activation_fn=activation_fn).to(dtype).eval()


def _block() -> torch.nn.ModuleDict:
    """Two tanh-GELU MLPs (as a joint block's image and text streams) beside FFNs that must stay as they are."""
    return torch.nn.ModuleDict(
        {
            "img_mlp": _ffn(),
            "txt_mlp": _ffn(),
            "exact_gelu": _ffn("gelu"),  # approximate="none": not the epilogue's function
            "geglu": _ffn("geglu"),
            "silu": _ffn("linear-silu"),
            "float32": _ffn(dtype=torch.float32),  # no epilogue in float32 (TF32-dependent)
        }
    )


def _hidden(dtype: torch.dtype = torch.bfloat16, shape: tuple[int, ...] = (2, 7)) -> torch.Tensor:
    return torch.randn(*shape, DIM, generator=torch.Generator().manual_seed(1)).to(dtype)


@pytest.fixture
def addmm_calls(monkeypatch) -> list[tuple]:
    """Every call of the fused op (the fused path's only GEMM), still computed."""
    calls, op = [], torch._addmm_activation
    monkeypatch.setattr(torch, "_addmm_activation", lambda *args, **kwargs: calls.append(args) or op(*args, **kwargs))
    return calls


@pytest.fixture
def as_on_cuda(monkeypatch):
    """Every swapped module decides as if its input were on a GPU: the fused path, run by the CPU's kernels."""
    decide = fused_gelu.epilogue_applies
    monkeypatch.setattr(
        fused_gelu, "epilogue_applies", lambda proj, hidden_states, on_cuda: decide(proj, hidden_states, True)
    )


def test_only_tanh_gelu_projections_that_can_fuse_are_swapped_and_counted():
    block = _block()
    assert fuse_gelu_epilogues(block) == 2
    swapped = {name for name, module in block.named_modules() if isinstance(module, EpilogueGELU)}
    assert swapped == {"img_mlp.net.0", "txt_mlp.net.0"}
    assert type(block["exact_gelu"].net[0]) is GELU and type(block["float32"].net[0]) is GELU
    assert fuse_gelu_epilogues(block) == 0  # already swapped


def test_a_projection_without_bias_or_with_a_quantized_weight_is_not_swapped():
    no_bias = GELU(DIM, 4 * DIM, approximate="tanh", bias=False).bfloat16()
    quantized = GELU(DIM, 4 * DIM, approximate="tanh").bfloat16()
    quantized.proj.weight = torch.nn.Parameter(quantized.proj.weight.detach().as_subclass(Marked))
    assert fuse_gelu_epilogues(torch.nn.ModuleList([no_bias, quantized])) == 0


def test_the_swap_keeps_every_parameter_name_and_value():
    block = _block()
    before = {name: tensor.clone() for name, tensor in block.state_dict().items()}
    fuse_gelu_epilogues(block)
    after = block.state_dict()
    assert list(after) == list(before)
    assert all(torch.equal(after[name], before[name]) for name in before)


@pytest.mark.parametrize("shape", [(2, 7), (1, 3, 5)], ids=["tokens", "frames"])
def test_on_the_cpu_the_output_is_the_references_bit_for_bit(addmm_calls, shape):
    block, reference = _block(), _block()
    fuse_gelu_epilogues(block)
    x = _hidden(shape=shape)
    with torch.inference_mode():
        for name, ffn in block.items():
            x = x.to(next(ffn.parameters()).dtype)
            assert torch.equal(ffn(x), reference[name](x)), name
    assert addmm_calls == []


def _proj() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(DIM, 4 * DIM).bfloat16().requires_grad_(False)


def _wrapped_in_lora(proj: torch.nn.Linear) -> torch.nn.Module:
    from peft import LoraConfig, inject_adapter_in_model

    gelu = GELU(DIM, 4 * DIM, approximate="tanh").bfloat16()
    gelu.proj = proj
    inject_adapter_in_model(LoraConfig(r=2, target_modules=["proj"]), gelu)  # what diffusers' LoRA loading puts there
    return gelu.proj


def _with_forward_hook(proj: torch.nn.Linear) -> torch.nn.Linear:
    proj.register_forward_hook(lambda module, args, output: None)
    return proj


def _with_forward_pre_hook(proj: torch.nn.Linear) -> torch.nn.Linear:
    proj.register_forward_pre_hook(lambda module, args: None)
    return proj


def _with_diffusers_hook(proj: torch.nn.Linear) -> torch.nn.Linear:
    HookRegistry.check_if_exists_or_initialize(proj).register_hook(ModelHook(), "onload")  # as group offload's
    return proj


def _with_accelerate_hook(proj: torch.nn.Linear) -> torch.nn.Linear:
    from accelerate.hooks import ModelHook as AccelerateHook
    from accelerate.hooks import add_hook_to_module

    add_hook_to_module(proj, AccelerateHook())  # as accelerate's offload: a forward set on the instance
    return proj


def _with_quantized_weight(proj: torch.nn.Linear) -> torch.nn.Linear:
    proj.weight = torch.nn.Parameter(proj.weight.detach().as_subclass(Marked), requires_grad=False)
    return proj


REFERENCE_PATH = {  # why the call must take the reference path -> the projection so changed
    "LoRA wrapper": _wrapped_in_lora,
    "Linear subclass": lambda proj: type("QuantLinear", (torch.nn.Linear,), {})(DIM, 4 * DIM).bfloat16(),
    "no bias": lambda proj: torch.nn.Linear(DIM, 4 * DIM, bias=False).bfloat16(),
    "forward hook": _with_forward_hook,
    "forward pre-hook": _with_forward_pre_hook,
    "diffusers hook": _with_diffusers_hook,
    "accelerate hook": _with_accelerate_hook,
    "tensor subclass weight": _with_quantized_weight,
    "float32 weight": lambda proj: proj.float(),
    "float16 weight, bf16 input": lambda proj: proj.half(),
}


def test_a_plain_projection_on_cuda_takes_the_fused_path_and_on_the_cpu_the_reference():
    with torch.inference_mode():
        assert epilogue_applies(_proj(), _hidden(), on_cuda=True)
        assert epilogue_applies(_proj().half(), _hidden(torch.float16), on_cuda=True)
        assert not epilogue_applies(_proj(), _hidden(), on_cuda=False)


@pytest.mark.parametrize("why", REFERENCE_PATH)
def test_a_wrapped_hooked_or_quantized_projection_takes_the_reference_path(why):
    proj = REFERENCE_PATH[why](_proj())
    with torch.inference_mode():
        assert not epilogue_applies(proj, _hidden(), on_cuda=True)


def test_where_autograd_records_the_reference_path_runs():
    """The fused op has no derivative."""
    proj, x = _proj().requires_grad_(True), _hidden()
    assert not epilogue_applies(proj, x, on_cuda=True)
    assert epilogue_applies(proj.requires_grad_(False), x, on_cuda=True)  # grad mode on, nothing requires grad
    with torch.no_grad():
        assert epilogue_applies(proj.requires_grad_(True), x, on_cuda=True)


@pytest.mark.parametrize("shape", [(2, 7), (1, 3, 5)], ids=["tokens", "frames"])
def test_the_fused_path_is_one_gemm_with_bias_then_tanh_gelu(addmm_calls, as_on_cuda, shape):
    ffn, reference = _ffn(), _ffn()
    fuse_gelu_epilogues(ffn)
    x = _hidden(shape=shape)
    with torch.inference_mode():
        out = ffn.net[0](x)
        expected = reference.net[0](x)
    assert len(addmm_calls) == 1
    bias, rows, weight = addmm_calls[0]
    assert bias is ffn.net[0].proj.bias and rows.shape == (x.numel() // DIM, DIM) and weight.shape == (DIM, 4 * DIM)
    assert out.shape == expected.shape and out.dtype == torch.bfloat16
    torch.testing.assert_close(out, expected)  # bf16's rounding apart: the CPU rounds once fused, twice unfused


def _compiled_forwards(module: torch.nn.Module, x: torch.Tensor, calls: int) -> tuple[torch.Tensor, int]:
    """The output of `calls` calls of `module` compiled (aot_eager), and how many graphs dynamo made for them."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    compiled = torch.compile(module, backend="aot_eager")
    before = counters["stats"]["unique_graphs"]
    for _ in range(calls):
        out = compiled(x)
    return out, counters["stats"]["unique_graphs"] - before


@pytest.mark.parametrize("path", ["reference", "fused"])
def test_a_compiled_block_traces_the_swapped_gelu_whole_and_once(request, path):
    if path == "fused":
        request.getfixturevalue("as_on_cuda")
    ffn, x = _ffn(), _hidden()
    fuse_gelu_epilogues(ffn)
    with torch.inference_mode():
        explained = torch._dynamo.explain(ffn)(x)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert ("_addmm_activation" in explained.graphs[0].code) == (path == "fused")
        out, graphs = _compiled_forwards(ffn, x, calls=3)
        assert graphs == 1  # no recompile per call
        assert torch.equal(out, ffn(x))


@pytest.mark.parametrize("when", ["before", "after"])
def test_a_hook_on_the_projection_runs_in_a_compiled_block(as_on_cuda, when):
    """Hooked before the first compiled call (the runner places offload's hooks before any forward), the block traces
    the reference path, where the hook runs (the fused path never calls the projection). Hooked after it, the
    decision's reads are guards that recompile the block, where torch guards on hooks at all: by default it skips
    guards on a module's empty hook dicts (`skip_nnmodule_hook_guards`), for the reference path's call as well."""
    ffn, x = _ffn(), _hidden()
    fuse_gelu_epilogues(ffn)
    seen = []

    def hook() -> None:
        ffn.net[0].proj.register_forward_hook(lambda module, args, output: seen.append(output.shape))

    with torch.inference_mode(), torch._dynamo.config.patch(skip_nnmodule_hook_guards=when == "before"):
        torch._dynamo.reset()
        compiled = torch.compile(ffn, backend="aot_eager")
        if when == "before":
            hook()
        first = compiled(x)
        if when == "after":
            hook()
        second = compiled(x)
    assert seen == [(2, 7, 4 * DIM)] * (2 if when == "before" else 1)
    torch.testing.assert_close(second, first, rtol=1.6e-2, atol=1e-3)  # the GELU rounded once or twice
