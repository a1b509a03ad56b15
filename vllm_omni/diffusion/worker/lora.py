"""LoRA adapters on a rank: read through diffusers, merged into the denoisers' weights in place, undone exactly.

Why merged: a request then runs exactly today's forward (no extra matmul, nothing for torch.compile
to guard on, the same weight addresses for a captured CUDA graph), so a request without an adapter
costs nothing and one with an adapter costs only the switch. The switch writes
`W = W0 + scale * s * B @ A` (one `addmm` per adapted linear) from a copy of the linear's original
weight `W0`, made the first time an adapter touches it and kept on the device; going back to the
base model (or to an adapter that leaves that linear alone) copies `W0` back, so the base model is
bit-identical to a fresh start after any sequence of switches. The price is that copy: the weights
of every linear an adapter touched, once (docs/serving.md#lora-adapters).

Reading goes through the family pipeline's own diffusers loader (`load_lora_weights`: the formats
and key converters diffusers knows, PEFT's ranks and alphas); its PEFT layers live only until their
factors A, B and scaling s are copied out, then `unload_lora_weights` puts the original linears back.
Up to `max_loras` adapters keep their factors on the device, more up to `max_cpu_loras` on the CPU
(least recently used first out); a dropped one is read from its file again when asked for. An adapter of two
files (a two-expert model's few-step pair, `LoraRequest.path_2`) loads each into its own expert: the first into the
high-noise `transformer`, the second into the low-noise `transformer_2` (`load_into_transformer_2=True`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.diffusion.request import LoraRequest
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


@dataclass
class LinearFactors:
    """One adapted linear: W += scale * scaling * B @ A."""

    a: torch.Tensor  # [rank, in]
    b: torch.Tensor  # [out, rank]
    scaling: float  # PEFT's lora_alpha / r (or / sqrt(r)), as diffusers configured it


# (denoiser name, module path) -> its factors
Factors = dict[tuple[str, str], LinearFactors]


def read_factors(pipe: Any, denoisers: Mapping[str, torch.nn.Module], lora: LoraRequest) -> Factors:
    """The adapter's factors for every linear of the denoisers it adapts, read with the pipeline's own diffusers
    loader into every denoiser (two experts both, as `load_into_transformer_2=True` does for the second): its one
    file into each, or a pair's file of each expert into that expert.
    """
    from peft.tuners.lora import LoraLayer

    adapter = f"vllm_omni_{lora.name}"
    factors: Factors = {}
    try:
        for name in denoisers:
            extra = {"load_into_transformer_2": True} if name == "transformer_2" else {}
            pipe.load_lora_weights(lora.path_for(name), adapter_name=adapter, **extra)
        for name, denoiser in denoisers.items():
            for path, module in denoiser.named_modules():
                if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
                    continue
                if not isinstance(module.get_base_layer(), torch.nn.Linear):
                    raise ValueError(f"adapter {lora.name!r} adapts {path}, which is not a linear layer")
                if module.use_dora.get(adapter) or getattr(module, "fan_in_fan_out", False):
                    raise ValueError(f"adapter {lora.name!r} is a DoRA or fan-in-fan-out adapter at {path}")
                factors[(name, path)] = LinearFactors(
                    module.lora_A[adapter].weight.detach().clone(),
                    module.lora_B[adapter].weight.detach().clone(),
                    float(module.scaling[adapter]),
                )
    finally:
        pipe.unload_lora_weights()  # the PEFT layers go; the original linears are back in place
    if not factors:
        raise ValueError(f"adapter {lora.name!r} ({','.join(lora.paths)}) adapts no linear layer of the denoisers")
    return factors


class LoraAdapters:
    """A rank's adapters: the factors it keeps, and which adapter is merged into its denoisers now."""

    def __init__(
        self,
        pipe: Any,
        denoisers: Mapping[str, torch.nn.Module],
        device: torch.device,
        max_loras: int,
        max_cpu_loras: int,
    ) -> None:
        self.pipe = pipe
        self.denoisers = dict(denoisers)
        self.device = device
        self.max_loras = max_loras
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        # (name, paths, version) -> factors, least recently used first
        self.kept: OrderedDict[tuple[str, tuple[str, ...], int], Factors] = OrderedDict()
        self.merged: LoraRequest | None = None
        self.originals: dict[tuple[str, str], torch.Tensor] = {}  # W0 of every linear an adapter touched
        self.switch_seconds = 0.0  # the last switch's (merge and restore), for the log and the benchmark

    def _weight(self, key: tuple[str, str]) -> torch.Tensor:
        return self.denoisers[key[0]].get_submodule(key[1]).weight

    def factors(self, lora: LoraRequest) -> Factors:
        """The adapter's factors on the device: kept ones (most recently used last), else read from its file."""
        key = (lora.name, lora.paths, lora.version)
        factors = self.kept.pop(key, None)
        if factors is None:
            start = time.perf_counter()
            factors = read_factors(self.pipe, self.denoisers, lora)
            logger.info(
                "LoRA adapter %r read from %s: %d linear layers, in %.2f s",
                lora.name,
                ",".join(lora.paths),
                len(factors),
                time.perf_counter() - start,
            )
        factors = {k: LinearFactors(f.a.to(self.device), f.b.to(self.device), f.scaling) for k, f in factors.items()}
        self.kept[key] = factors
        # The least recently used leave the device first, then the CPU.
        for index, old in enumerate(reversed(list(self.kept))):
            if index >= self.max_cpu_loras:
                del self.kept[old]
            elif index >= self.max_loras:
                self.kept[old] = {k: LinearFactors(f.a.cpu(), f.b.cpu(), f.scaling) for k, f in self.kept[old].items()}
        return factors

    @torch.no_grad()
    def activate(self, lora: LoraRequest | None) -> None:
        """Merge `lora` (None: the base model) into the denoisers, undoing the adapter merged before."""
        if lora == self.merged:
            return
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the last request's kernels are not the switch's time
        start = time.perf_counter()
        factors = self.factors(lora) if lora is not None else {}
        previous, self.merged = self.merged, None  # if this fails half-way, the originals are restored below
        try:
            for key, original in self.originals.items():
                if key not in factors:
                    self._weight(key).copy_(original)
            for key, f in factors.items():
                weight = self._weight(key)
                original = self.originals.get(key)
                if original is None:
                    original = self.originals[key] = weight.detach().clone()
                a, b = f.a.to(weight.dtype), f.b.to(weight.dtype)
                torch.addmm(original, b, a, alpha=lora.scale * f.scaling, out=weight)
        except BaseException:
            for key, original in self.originals.items():
                self._weight(key).copy_(original)
            raise
        self.merged = lora
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.switch_seconds = time.perf_counter() - start
        logger.info(
            "LoRA: %s -> %s in %.1f ms",
            "base" if previous is None else f"{previous.name} x{previous.scale:g}",
            "base" if lora is None else f"{lora.name} x{lora.scale:g}",
            self.switch_seconds * 1e3,
        )
