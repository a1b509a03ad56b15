"""FP8 matmuls for the denoisers (`quantization="fp8"`), through torchao.

torchao's float8 dynamic-activation / float8-weight quantization with row-wise scales: each weight row
is stored as e4m3 with its own scale, and each token's activations are quantized with their own scale
at every call, so a token's output depends on no other token and the SP properties (trim equals U1,
padding content never reaches real tokens) hold as in bf16. `FP8Rule` picks the linear layers it
converts; the rest stay bf16. The runner converts each denoiser right after loading it, before its
blocks are compiled and graphs captured (`quantize_denoisers`); under CPU offload the weights wait on the
CPU, where torchao cannot convert them, so each layer visits the GPU to be converted and goes back (offload
then moves the FP8 tensors as it moves any weight). The engine refuses a device that cannot run FP8 before
any worker starts (`check_quantization`). torchao is optional
(`pip install -e '.[fp8]'`) and is imported only when FP8 is asked for.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager

import torch

from vllm_omni.diffusion.config import QUANTIZATION_METHODS
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

TORCHAO_PIN = "torchao==0.18.0"  # pyproject.toml's `fp8` extra
MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper and newer

# Layers that stay bf16 whatever their size: what the pattern (a regular expression searched in each
# dotted part of the module's name) matches -> why FP8 does not pay there. Each of these runs on one
# row per sample (the conditioning embedding) or once on the prompt, or outside the compiled blocks,
# where the activation quantization cannot fuse into the op before it and costs more than it saves.
KEEP_BF16: Mapping[str, str] = {
    "embedder": "embed",  # timestep / guidance / text / image embedders (and their projections, refiners)
    # Latents, prompt or other conditioning into the model width, once per forward, outside the compiled
    # blocks. `*_projector`s: latent patches, a glyph text's few tokens, prior tokens (one per image token,
    # yet a 4096-wide MLP there is 1/180 of the GEMM work of 30 blocks).
    "input projection": r"^(img_in|txt_in|proj_in)$|_projector$",
    "final projection": r"^(proj_out|norm_out)$",  # the output norm's AdaLN and the projection to latents
    "modulation": r"_mod$|modulation|^norm",  # AdaLN: one row per sample; its shift/scale/gate reach every token
}
# The smaller side of a linear layer below which it stays bf16: every block GEMM of the served families is
# at least 2048 wide and every small projection at most 256 on one side, so the floor lies between (what
# was measured: docs/serving.md, FP8 matmuls; benchmarks/speed_levers.py times the rule's ablations).
MIN_FEATURES = 1024


@dataclasses.dataclass(frozen=True)
class FP8Rule:
    """Which linear layers of a denoiser run FP8 matmuls; one rule for every family (names and shapes)."""

    min_features: int = MIN_FEATURES
    keep_bf16: Mapping[str, str] = dataclasses.field(default_factory=lambda: dict(KEEP_BF16))

    def bf16_reason(self, name: str, module: torch.nn.Module) -> str | None:
        """Why the module `name` stays bf16 (a `keep_bf16` key, "small", ...); None when it runs FP8."""
        if not isinstance(module, torch.nn.Linear):
            return "not linear"
        return self.bf16_reason_by_shape(name, module.in_features, module.out_features)

    def bf16_reason_by_shape(self, name: str, in_features: int, out_features: int) -> str | None:
        """`bf16_reason` of a linear layer known by its name and sides (the memory plan reads them off a
        checkpoint's header, before loading)."""
        parts = name.split(".")
        for what, pattern in self.keep_bf16.items():
            if any(re.search(pattern, part) for part in parts):
                return what
        if min(in_features, out_features) < self.min_features:
            return "small"
        if in_features % 16 or out_features % 16:
            return "not a multiple of 16"  # torchao's FP8 GEMM needs both sides multiples of 16
        return None

    def fp8_layers(self, model: torch.nn.Module) -> list[str]:
        """Names of the linear layers of `model` this rule converts, in module order."""
        return [name for name, module in model.named_modules() if self.bf16_reason(name, module) is None]


FP8_RULE = FP8Rule()


def check_quantization(method: str | None, device: str | None, dtype: str | None) -> None:
    """The engine's check before any worker starts (no CUDA context in this process): the device, the
    dtype, torchao installed. The workers check the GPU's compute capability (`quantize_denoiser`)."""
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or unset, got {method!r}")
    if device != "cuda":
        raise ValueError(
            f"quantization={method!r} needs CUDA GPUs of compute capability {'.'.join(map(str, MIN_CAPABILITY))} "
            f"or newer (Ada, Hopper, Blackwell), but the workers would run on device={device!r}: FP8 matmuls do not "
            "run there. Leave quantization unset to run unquantized, or run on such GPUs (device='cuda')."
        )
    if dtype != "bfloat16":
        raise ValueError(
            f"quantization={method!r} converts bfloat16 weights (row-wise FP8 scales), got dtype={dtype!r}; "
            "use dtype bfloat16 (the CUDA default)"
        )
    if importlib.util.find_spec("torchao") is None:
        raise ImportError(f"quantization={method!r} needs torchao: pip install -e '.[fp8]' ({TORCHAO_PIN})")


def quantize_denoisers(
    denoisers: Mapping[str, torch.nn.Module], method: str | None, device: torch.device | None = None
) -> None:
    """Convert every denoiser with `method` (None: nothing changes); the runner calls it once, after loading.
    `device`: where they run, when they wait elsewhere (offload loads them onto the CPU)."""
    if method is None:
        return
    for name, model in denoisers.items():
        converted = set(quantize_denoiser(model, method, device))
        if not converted:  # a run that claims FP8 and has none
            raise ValueError(
                f"quantization={method!r}: no linear layer of {name} is large enough for FP8 (the rule keeps layers "
                f"narrower than {FP8_RULE.min_features} in bf16: worker/quantization.py); leave quantization unset"
            )
        kept = Counter(
            FP8_RULE.bf16_reason(layer, module)
            for layer, module in model.named_modules()
            if isinstance(module, torch.nn.Linear) and layer not in converted
        )
        logger.info(
            "%s: FP8 matmuls in %d linear layer(s) (torchao float8 dynamic activation + weight, row-wise); "
            "bf16 kept in %s",
            name,
            len(converted),
            ", ".join(f"{count} {what}" for what, count in sorted(kept.items())) or "none",
        )


def quantize_denoiser(model: torch.nn.Module, method: str, device: torch.device | None = None) -> list[str]:
    """Convert `model` in place with `method` by `FP8_RULE` on `device` (default: its own), each layer left where
    it was; returns the converted layers.

    Raises ValueError on a device or dtype that cannot run it, ImportError without torchao.
    """
    layers = FP8_RULE.fp8_layers(model)
    param = converted_weight(model, layers)
    device = device or param.device
    check_quantization(method, device.type, str(param.dtype).removeprefix("torch."))
    capability = torch.cuda.get_device_capability(device)
    if capability < MIN_CAPABILITY:
        raise ValueError(
            f"quantization={method!r} needs compute capability {'.'.join(map(str, MIN_CAPABILITY))} or newer "
            f"(FP8 tensor cores: Ada, Hopper, Blackwell); {torch.cuda.get_device_name(device)} "
            f"({device}) has {'.'.join(map(str, capability))}. Leave quantization unset on this GPU."
        )
    return fp8_quantize(model, layers, device)


def grad_mode(method: str | None, cpu_offload: str) -> Callable[[], AbstractContextManager]:
    """The autograd mode a request runs in: inference mode, but no_grad where offload moves FP8 weights.

    Under inference mode a torchao tensor's `.to(device)` (aten.to.dtype_layout, which the offload hooks of
    accelerate and diffusers call) moves the FP8 data and scales but returns a wrapper that still says the old
    device (torchao 0.18.0: its handler "corrects" the output to alias the input); the FP8 GEMM then finds its
    weight on the CPU ("mat2 is on cpu", on an H200). Under no_grad the same call is a copy, moved whole.
    """
    return torch.no_grad if method is not None and cpu_offload in ("model", "layerwise") else torch.inference_mode


def converted_weight(model: torch.nn.Module, layers: list[str]) -> torch.nn.Parameter:
    """The weight whose device and dtype FP8 is checked against: the first layer to convert's, not the model's
    first parameter, which diffusers may keep in float32 (`_keep_in_fp32_modules`: a modulation table
    and time embedder, which the rule leaves unconverted anyway)."""
    return model.get_submodule(layers[0]).weight if layers else next(model.parameters())


def fp8_quantize(model: torch.nn.Module, layers: Iterable[str], device: torch.device | None = None) -> list[str]:
    """torchao's FP8 conversion of the linear layers named `layers`, in place, without the device checks
    (the CPU tests and the benchmark's per-rule ablation call it directly); returns the names. With `device`,
    each layer is converted there and moved back: one layer at a time on the GPU (offloaded weights wait on
    the CPU, where torchao converts nothing, and a denoiser may not fit the GPU whole in bf16)."""
    try:
        from torchao.quantization import Float8DynamicActivationFloat8WeightConfig, PerRow, quantize_
        from torchao.utils import TorchAOBaseTensor
    except ImportError as exc:
        raise ImportError(f"FP8 needs torchao: pip install -e '.[fp8]' ({TORCHAO_PIN}): {exc}") from exc
    names = list(layers)
    # set_inductor_config=False: compile with the engine's inductor settings, not torchao's (its
    # coordinate-descent tuning lengthens every compile, and bf16 and FP8 should compile alike).
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow(), set_inductor_config=False)
    for name in names:
        layer = model.get_submodule(name)
        move_bias_out(layer)
        home = layer.weight.device
        layer.to(device or home)
        quantize_(layer, config, filter_fn=lambda module, fqn: fqn == "")  # the layer itself (its fqn is "")
        layer.to(home)  # a torchao tensor moves whole (nn.Module.to swaps it in)
    missed = [name for name in names if not isinstance(model.get_submodule(name).weight, TorchAOBaseTensor)]
    if missed:  # torchao skips some layers silently: never claim FP8 for a layer that runs bf16
        raise RuntimeError(f"torchao left {len(missed)} layer(s) unconverted that were to run FP8: {missed[:5]}")
    return names


def move_bias_out(linear: torch.nn.Linear) -> None:
    """Move a layer's bias out of its FP8 GEMM, to an add after it (`bias_after`; fused by the compiled block).

    Measured on an H200 (torch 2.11, cuBLAS of CUDA 13.0): a compiled block calls `_scaled_mm` with the bias
    and row-wise scales, and cuBLAS refuses it (CUBLAS_STATUS_NOT_SUPPORTED); eagerly, and without a
    bias, the same GEMM runs. Some models' linear layers have biases, others none.
    """
    if linear.bias is None:
        return
    linear.bias_after = torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
    linear.bias = None
    linear.register_forward_hook(_bias_after)


def _bias_after(linear: torch.nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor:
    return output + linear.bias_after


def stored_bytes(tensor: torch.Tensor) -> int:
    """Bytes `tensor` holds: for a torchao tensor those of its parts (FP8 data and scales), not numel x 2."""
    flatten = getattr(tensor, "__tensor_flatten__", None)
    if flatten is None:
        return tensor.numel() * tensor.element_size()
    names, _ = flatten()
    return sum(stored_bytes(getattr(tensor, name)) for name in names)
