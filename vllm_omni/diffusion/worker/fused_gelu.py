"""Bias + tanh GELU fused into the epilogue of the MLP's first GEMM, on CUDA (`fuse_gelu_epilogues`).

A diffusers FFN with `activation_fn="gelu-approximate"` is a `GELU` module: its `proj` Linear, then tanh GELU.
Compiled, inductor runs the Linear as a cuBLAS GEMM and the bias with the GELU as one more pass over the MLP's
widest activation. `torch._addmm_activation(bias, x, weight.t(), use_gelu=True)` is a single cuBLASLt GEMM whose
GELU_BIAS epilogue adds the bias and applies tanh GELU to the fp32 accumulator, then rounds once (the reference
rounds the GEMM's output, then the GELU's); inductor has no decomposition of it, so it stays one extern kernel.
Where cuBLASLt cannot take the epilogue, torch itself runs the GEMM and then its GELU: the same values, unfused.

The runner (runner.py) swaps the class of each such module to `EpilogueGELU` once, on CUDA, after quantization and
before the blocks are compiled: a declared subclass, as the VAE's decode split is (forward_chain.py), since the
forward is replaced rather than wrapped, and the parameters keep their names (checkpoints, LoRA keys). Every call
still decides (`epilogue_applies`) and otherwise runs diffusers' forward unchanged, since what wraps the Linear can
change after the swap: LoRA loading wraps it for a while, offload hooks move weights in. Compiled, the checks are
attribute reads that become guards, so a block does not recompile per call; torch does not guard a module's empty
hook dicts, though, so hooks on the Linear must be in place before the block's first call (as for the Linear's own
call on the reference path).
"""

from __future__ import annotations

import torch
from diffusers.models.activations import GELU

from vllm_omni.diffusion import diffusers_compat

EPILOGUE_DTYPES = (torch.bfloat16, torch.float16)  # the serving dtypes; fp32 GEMMs depend on the TF32 setting
PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # not a subclass (torchao's FP8 weights run their own matmul)


def fusable_linear(proj: torch.nn.Module) -> bool:
    """Whether `proj` could run as the fused GEMM at all: a plain Linear (not a LoRA wrapper or a quantized layer)
    with a bias, its weight and bias plain tensors of one 16-bit dtype."""
    if type(proj) is not torch.nn.Linear or proj.bias is None:
        return False
    weight, bias = proj.weight, proj.bias
    plain = type(weight) in PLAIN_TENSORS and type(bias) in PLAIN_TENSORS
    return plain and weight.dtype == bias.dtype and weight.dtype in EPILOGUE_DTYPES


def hooked(module: torch.nn.Module) -> bool:
    """Whether anything runs around `module`'s own forward (torch hooks, diffusers' hook registry, a forward set on
    the instance as accelerate's hooks do): offload moves weights in there, which the fused GEMM would skip."""
    return (
        bool(module._forward_pre_hooks or module._forward_hooks)
        or diffusers_compat.hook_registry(module) is not None
        or "forward" in vars(module)
    )


def epilogue_applies(proj: torch.nn.Module, hidden_states: torch.Tensor, on_cuda: bool) -> bool:
    """Whether `proj(hidden_states)` then tanh GELU may run as one GEMM with the bias + GELU epilogue. `on_cuda` is
    the input's, passed apart so that a test on the CPU can ask as if on a GPU."""
    if not on_cuda or not fusable_linear(proj) or hooked(proj):
        return False
    weight, bias = proj.weight, proj.bias
    recording = torch.is_grad_enabled() and (hidden_states.requires_grad or weight.requires_grad or bias.requires_grad)
    # The op has no derivative: the reference path wherever autograd records.
    return weight.dtype == hidden_states.dtype and weight.device == hidden_states.device and not recording


class EpilogueGELU(GELU):
    """diffusers' `GELU` whose projection takes the bias and tanh GELU as its GEMM's epilogue where it can."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if not epilogue_applies(self.proj, hidden_states, hidden_states.is_cuda):
            return super().forward(hidden_states)
        rows = hidden_states.reshape(-1, hidden_states.shape[-1])
        out = torch._addmm_activation(self.proj.bias, rows, self.proj.weight.t(), use_gelu=True)
        return out.view(*hidden_states.shape[:-1], out.shape[-1])


def fuse_gelu_epilogues(model: torch.nn.Module) -> int:
    """Swap each tanh `GELU` of `model` whose projection is fusable now to `EpilogueGELU` (parameters, names and
    state_dict unchanged); returns how many were swapped (none a second time)."""
    swapped = 0
    for module in model.modules():
        # Exactly diffusers' class: a subclass of it may have changed what its forward computes.
        if type(module) is GELU and module.approximate == "tanh" and fusable_linear(module.proj):
            module.__class__ = EpilogueGELU
            swapped += 1
    return swapped
