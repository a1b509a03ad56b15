"""The memory plan: what a rank will hold on its GPU, computed before it loads a weight (worker.py).

Weights come from the checkpoint's safetensors headers (shapes and dtypes, no tensor read), per
component, at the dtype the rank serves them in, without what text-once leaves out (an SP peer
loads no text encoder) and with FP8's one byte per converted weight (the same `FP8_RULE` that
converts them). One denoising step's activations are estimated at the request the deploy must admit
(`Admission`: the model's default request, one image, or the user's `--max-tokens-per-step`; this rank's
share of it under Ulysses); with interleaving (`--max-num-seqs N` under fair or priority), what N - 1
suspended requests of that size keep too. What is on the GPU at once depends on `--cpu-offload`:

- none: every component, plus a step;
- encoders: the denoisers, plus a step; the text encoders and the VAE one at a time beside them, in their phases;
- model: one component at a time (the last one moves out first; of two experts, the idle one waits on the CPU);
- layerwise: a denoiser's non-block weights and two of its blocks (the one running and the one
  prefetched; diffusers' group offloading), plus a step; another component, two of its layers. What
  the budget leaves beyond that (less a tenth, `RESIDENT_HEADROOM`) keeps as many of the denoisers'
  blocks resident (`resident_blocks`): each one kept is one fewer streamed over PCIe at every forward.

With LoRA adapters served, a copy of the weights they adapt is planned too (the originals the merge restores from,
worker/lora.py): those the served adapters adapt when none can be added at run time (the engine passes them down,
`lora_adapted`), else every 2-D weight of the denoisers' blocks.

The budget is `gpu_memory_utilization` of the device, and no more than is free when the rank
starts. A plan that does not fit refuses the deploy, saying by how much and which settings fit. One that fits
has an envelope (`widest_envelope`): the larger requests and the rows per forward that the rest of the budget
holds, up to the model's token cap and the rows the limits allow. The engine's warm-up then measures one step at
the envelope's largest row (`RankPlan.measured`) and serves what the measurement says fits.
The VAE decode is planned only for images, where its untiled peak was measured (a family's decode bytes per pixel),
and only for what layerwise offload keeps resident through it (a tiled decode's peak is set by its tiles;
docs/serving.md). At run time a decode whose untiled peak (measured per VAE class) the rank cannot allocate is
tiled instead (vae_parallel.py).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import json
import math
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.config import PLACEMENTS, Admission, Envelope
from vllm_omni.diffusion.models.registry import UNTILED_DECODE_BYTES_PER_PIXEL
from vllm_omni.diffusion.worker.memory_guard import ALLOCATION_MARGIN

# Bytes of activations per token, per unit of model width and per byte of dtype, that one block of a
# denoiser keeps alive at its peak: q, k, v and the attention output (and their all-to-all copies), the
# MLP's 4x-wide hidden before and after its activation, the residual stream and its modulated copy.
# Measured on an H200.
STEP_BYTES_PER_TOKEN_WIDTH = 20
# What a request suspended between two of its steps keeps while others run inside it (interleaving, --max-num-seqs),
# likewise: the step cache's residuals (the first block's and the others', per CFG branch); its latents and prompt
# embeddings are far smaller. An upper estimate, not measured.
SUSPENDED_BYTES_PER_TOKEN_WIDTH = 4
# The share of the budget that resident blocks leave free under layerwise offload, for what the plan does not
# count: the VAE decode, a third block still in flight on the prefetch stream (or freed but not yet passed by the
# compute stream: offload.py's record_stream), the allocator's fragmentation.
# Measured on an H200 with a 20B image model within 24 GiB: 34 resident blocks left 0.3 GiB, and the decode ran out.
RESIDENT_HEADROOM = 0.1
# How finely the envelope's token counts are searched (a few percent of a 1024x1024 image's 4096 tokens).
ENVELOPE_STEP_TOKENS = 256
# An untiled VAE decode's peak activations per output pixel, in bfloat16, by the VAE's class (vae/config.json), as
# each family declares it (its spec.py: `Family.decode_bytes_per_pixel`, from benchmarks/results/vae_decode.json).
# Resident blocks stay on the GPU through the decode, so under layerwise offload they leave room for it; and a decode
# whose untiled peak the rank cannot allocate when it starts is tiled (`untiled_decode_bytes`, vae_parallel.py).
DEFAULT_TEXT_TOKENS = 512
# The placements that keep the denoisers on the GPU, where served LoRA adapters are merged into them (worker/lora.py).
LORA_PLACEMENTS = ("none", "encoders")

_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I64": 8, "I32": 4, "I16": 2}
_DTYPE_BYTES |= {"I8": 1, "U8": 1, "BOOL": 1}
_FLOAT = {"F64", "F32", "F16", "BF16"}
GiB = 2**30


@dataclasses.dataclass(frozen=True)
class ComponentWeights:
    """One pipeline component's weights as this rank would hold them: all, and per repeated block."""

    name: str
    total: int
    blocks: tuple[int, ...] = ()  # bytes of each direct child block (`transformer_blocks.7`), for layerwise
    largest_layer: int = 0  # bytes of its largest module's own tensors (a leaf-level group)
    block_matrices: int = 0  # bytes of what LoRA adapters may adapt: its blocks' 2-D weights, or the adapted ones

    def layerwise(self, block_level: bool) -> int:
        """On the GPU at once under group offloading: at block level the non-block weights and two blocks, at
        leaf level two layers (the one running, the one prefetched)."""
        if not block_level:
            return min(self.total, 2 * self.largest_layer)
        if not self.blocks:
            return self.total
        return self.total - sum(self.blocks) + min(2, len(self.blocks)) * max(self.blocks)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    """What one rank plans to hold, against what it may use."""

    components: tuple[ComponentWeights, ...]
    denoisers: frozenset[str]
    step_bytes: int  # one denoising step's activations at the request the deploy must admit
    offload: str  # none, model, layerwise
    device_total: int
    device_free: int
    utilization: float
    decode_bytes: int = 0  # the untiled VAE decode's activations at that request's image (0: not measured)
    # LoRA adapters served: the rank keeps a copy of every weight an adapter touched (worker/lora.py), planned as
    # every 2-D weight of the denoisers' blocks.
    lora: bool = False
    suspended_bytes: int = 0  # the requests others run inside (--max-num-seqs - 1 of them) at that request

    @property
    def lora_copy(self) -> int:
        return sum(c.block_matrices for c in self.components if c.name in self.denoisers) if self.lora else 0

    @property
    def budget(self) -> int:
        return min(int(self.utilization * self.device_total), self.device_free)

    @property
    def weights(self) -> int:
        """Weights on the GPU at the busiest moment."""
        if self.offload == "none":
            return self.need - self.step_bytes - self.suspended_bytes
        return self._peak()[1] + self._resident_bytes() + self.lora_copy

    @property
    def need(self) -> int:
        if self.offload == "none":
            return sum(c.total for c in self.components) + self.step_bytes + self.lora_copy + self.suspended_bytes
        return self._peak()[0] + self._resident_bytes() + self.lora_copy + self.suspended_bytes

    def resident_blocks(self) -> dict[str, int]:
        """Under layerwise: how many of each denoiser's blocks stay on the GPU, within what the streamed plan
        leaves of the budget (the first denoiser first; a second expert gets what remains)."""
        if self.offload != "layerwise":
            return {}
        # The decode runs with the resident blocks still on the GPU: they leave room for it too, with the margin
        # the decode's own check asks (memory_guard.allocation_check). Else it is tiled, and the image is not the
        # one every weight resident gives (at 1328x1328 in 24 GiB, FP8: 1.56 s against 0.12).
        decode = int(self.decode_bytes * ALLOCATION_MARGIN)
        spare = int(self.budget * (1 - RESIDENT_HEADROOM)) - max(self._peak()[0], decode)
        kept = {}
        for component in self.components:
            if component.name not in self.denoisers or len(component.blocks) <= 2:
                continue
            # Two blocks are planned on the GPU already (running, prefetched): the rest may stay.
            count = min(len(component.blocks) - 2, max(spare, 0) // max(component.blocks))
            kept[component.name] = count
            spare -= count * max(component.blocks)
        return kept

    def _resident_bytes(self) -> int:
        sizes = {c.name: max(c.blocks, default=0) for c in self.components}
        return sum(count * sizes[name] for name, count in self.resident_blocks().items())

    def _peak(self) -> tuple[int, int]:
        """(need, weights) in the busiest phase: each component's, with what is on the GPU while it runs."""
        phases = [(self._on_gpu(c) + self._activations(c), self._on_gpu(c)) for c in self.components]
        return max(phases, default=(self.step_bytes, 0))

    def _on_gpu(self, component: ComponentWeights) -> int:
        """Weights on the GPU while `component` runs."""
        if self.offload == "layerwise":
            return component.layerwise(block_level=component.name in self.denoisers)
        if self.offload == "encoders":  # the denoisers stay; the component running beside them when it is not one
            stay = sum(c.total for c in self.components if c.name in self.denoisers)
            return stay + (0 if component.name in self.denoisers else component.total)
        return component.total

    def _activations(self, component: ComponentWeights) -> int:
        return self.step_bytes if component.name in self.denoisers else 0

    @property
    def fits(self) -> bool:
        return self.need <= self.budget

    def line(self) -> str:
        """The start line's account: weights by component, the step, the total against the budget."""
        held = ", ".join(f"{c.name} {size(c.total)}" for c in self.components)
        resident = ", ".join(f"{count} {name} blocks" for name, count in self.resident_blocks().items())
        kept = f", {resident} resident" if resident else ""
        kept += f", {size(self.lora_copy)} of LoRA originals" if self.lora else ""
        suspended = f", requests run inside others {size(self.suspended_bytes)}" if self.suspended_bytes else ""
        return (
            f"memory plan: weights {held} (offload {self.offload}: {size(self.weights)} on the GPU at once{kept}), one "
            f"step at the request it must admit {size(self.step_bytes)}{suspended}: needs {size(self.need)} of "
            f"{size(self.budget)} ({self.utilization:g} of {size(self.device_total)}, {size(self.device_free)} free)"
        )


def size(count: int) -> str:
    """Bytes as GiB (MiB below one GiB: the tiny models' plans)."""
    return f"{count / GiB:.2f} GiB" if count >= GiB else f"{count / 2**20:.1f} MiB"


def header_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (dtype, shape) of every tensor in a safetensors file, from its header alone."""
    stat = path.stat()
    return _header_tensors(path, stat.st_mtime_ns, stat.st_size)


@functools.lru_cache(maxsize=256)  # the envelope's search plans many sizes of one checkpoint
def _header_tensors(path: Path, mtime_ns: int, length_on_disk: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    with open(path, "rb") as f:
        prefix = f.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 <= length <= length_on_disk - 8:  # not safetensors: no read of a length that is not one
            raise ValueError(f"{path} is not a safetensors file")
        header = json.loads(f.read(length))
    header.pop("__metadata__", None)
    return {name: (entry["dtype"], tuple(entry["shape"])) for name, entry in header.items()}


def component_tensors(folder: Path) -> dict[str, tuple[str, tuple[int, ...]]]:
    """name -> (safetensors dtype, shape) of every tensor of the component in `folder`: from its safetensors headers,
    or, for a folder of configs without weights (`vllm-omni plan` of a checkpoint not downloaded, the released
    checkpoints' configs in benchmarks/checkpoints/), from its class built on the meta device."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        return {name: entry for file in files for name, entry in header_tensors(file).items()}
    config = folder / "config.json"
    if not config.is_file():
        return {}  # no weights and no config: a scheduler, a tokenizer
    return _meta_tensors(folder, config.stat().st_mtime_ns)


def component_class(library: str, class_name: str) -> type:
    """The class model_index.json names for a component: diffusers', transformers' (also where the library named
    is a diffusers pipeline module that takes the class from transformers), or that pipeline module's own
    (`diffusers.pipelines.<library>`: a text connector, a vocoder)."""
    import diffusers
    import transformers

    if library == "diffusers":
        return getattr(diffusers, class_name)
    if library == "transformers" or hasattr(transformers, class_name):
        return getattr(transformers, class_name)
    return getattr(importlib.import_module(f"diffusers.pipelines.{library}"), class_name)


def component_on_meta(folder: Path) -> Any:
    """The component in `folder` (a pipeline folder's subfolder: its config, and model_index.json's entry for it)
    built on the meta device: no memory, no weights."""
    import diffusers
    import torch
    import transformers

    index = json.loads((folder.parent / "model_index.json").read_text())
    model_class = component_class(*index[folder.name])
    with torch.device("meta"):
        if issubclass(model_class, diffusers.ModelMixin):
            return model_class.from_config(model_class.load_config(folder))
        return diffusers_compat.model_on_meta(model_class, transformers.AutoConfig.from_pretrained(folder))


@functools.lru_cache(maxsize=64)
def _meta_tensors(folder: Path, mtime_ns: int) -> dict[str, tuple[str, tuple[int, ...]]]:
    import torch

    model = component_on_meta(folder)
    names = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.int64: "I64"}
    tensors = {**dict(model.named_parameters()), **dict(model.named_buffers())}
    return {name: (names.get(t.dtype, "F32"), tuple(t.shape)) for name, t in tensors.items()}


def component_weights(
    folder: Path, name: str, dtype_bytes: int, fp8_reason: Any | None = None, adapted: frozenset[str] | None = None
) -> ComponentWeights:
    """The weights of the component in `folder` (its *.safetensors), floating tensors at `dtype_bytes`
    each. `fp8_reason(layer, in, out)`: FP8Rule.bf16_reason_by_shape for a denoiser served in FP8 (a
    converted weight is one byte per element and a float32 scale per row). `adapted`: the tensors LoRA adapters
    adapt (their `block_matrices`; None: every 2-D weight of the blocks)."""
    total = 0
    blocks: dict[str, int] = {}
    layers: dict[str, int] = {}
    matrices = 0
    for tensor, (dtype, shape) in component_tensors(folder).items():
        count = math.prod(shape)
        size = count * (dtype_bytes if dtype in _FLOAT else _DTYPE_BYTES.get(dtype, 4))
        layer, _, kind = tensor.rpartition(".")
        if fp8_reason is not None and kind == "weight" and len(shape) == 2 and dtype in _FLOAT:
            if fp8_reason(layer, shape[1], shape[0]) is None:
                size = count + 4 * shape[0]
        total += size
        layers[layer] = layers.get(layer, 0) + size
        parts = tensor.split(".")
        in_block = len(parts) > 2 and parts[1].isdigit()  # a block of a ModuleList child: group offloading's unit
        if in_block:
            key = f"{parts[0]}.{parts[1]}"
            blocks[key] = blocks.get(key, 0) + size
        adaptable = tensor in adapted if adapted is not None else in_block and kind == "weight" and len(shape) == 2
        if adaptable and dtype in _FLOAT:
            matrices += size
    return ComponentWeights(name, total, tuple(blocks.values()), max(layers.values(), default=0), matrices)


def step_bytes(config: Mapping[str, Any], tokens: int, text_tokens: int, rows: int, sp: int, dtype_bytes: int) -> int:
    """One denoising step's activations on a rank: `rows` sequences of `tokens` image and `text_tokens`
    text tokens, each split over `sp` ranks, at the denoiser's width (heads x head dim). A suspended request
    of that size keeps SUSPENDED_BYTES_PER_TOKEN_WIDTH / STEP_BYTES_PER_TOKEN_WIDTH of it."""
    width = int(config.get("num_attention_heads", 0)) * int(config.get("attention_head_dim", 0))
    if width <= 0:  # some configs name the width `dim` or `hidden_size`
        width = int(config.get("dim", 0) or config.get("hidden_size", 0) or 3072)
    per_rank = math.ceil(tokens / sp) + math.ceil(text_tokens / sp)
    return rows * per_rank * width * dtype_bytes * STEP_BYTES_PER_TOKEN_WIDTH


def plan_for_checkpoint(
    path: Path,
    components: Iterable[str],
    denoisers: Iterable[str],
    *,
    dtype_bytes: int,
    fp8_reason: Any | None,
    tokens: int,
    text_tokens: int,
    rows: int,
    sp: int,
    offload: str,
    device_total: int,
    device_free: int,
    utilization: float,
    pixels: int = 0,
    lora: bool = False,
    lora_adapted: Iterable[str] | None = None,
    in_flight: int = 1,
    step_scale: float = 1.0,
) -> MemoryPlan:
    """The plan of a rank that loads `components` of the checkpoint at `path` (see the module doc).
    `lora_adapted`: the denoiser weights the served adapters adapt (None: any of their blocks' 2-D weights);
    `in_flight`: requests in flight at once (interleaving: all but one suspended, each at the largest request);
    `step_scale`: a measured step over its estimate (RankPlan.measured)."""
    denoisers = frozenset(denoisers)
    adapted = frozenset(lora_adapted) if lora_adapted is not None else None
    held = [
        component_weights(path / name, name, dtype_bytes, fp8_reason, adapted)  # FP8 and LoRA touch only these
        if name in denoisers
        else component_weights(path / name, name, dtype_bytes)
        for name in components
    ]
    weights = tuple(c for c in held if c.total)  # the scheduler and tokenizers hold none
    steps = [
        step_bytes(_config(path / name), tokens, text_tokens, rows, sp, dtype_bytes)
        for name in components
        if name in denoisers
    ]
    vae = _config(path / "vae").get("_class_name", "") if "vae" in components else ""
    decode = int(pixels * UNTILED_DECODE_BYTES_PER_PIXEL.get(vae, 0) * dtype_bytes / 2)
    steps_peak = int(max(steps, default=0) * step_scale)
    suspended = (in_flight - 1) * steps_peak * SUSPENDED_BYTES_PER_TOKEN_WIDTH // STEP_BYTES_PER_TOKEN_WIDTH
    return MemoryPlan(
        weights, denoisers, steps_peak, offload, device_total, device_free, utilization, decode, lora, suspended
    )


def untiled_decode_bytes(vae: Any, latent_shape: tuple[int, ...]) -> int | None:
    """The untiled decode's peak activations for a latent [B, C, (T,) H, W] by the VAE module `vae`
    (UNTILED_DECODE_BYTES_PER_PIXEL, at its parameters' dtype); None where its class was not measured."""
    names = [cls.__name__ for cls in type(vae).__mro__]  # a DecodeSplitVAE subclass: its VAE class's figure
    per_pixel = next((UNTILED_DECODE_BYTES_PER_PIXEL[n] for n in names if n in UNTILED_DECODE_BYTES_PER_PIXEL), None)
    if per_pixel is None:
        return None
    config = vae.config
    stages = config.get("temperal_downsample") or ()  # causal video VAEs give their factors as stages
    spatial = config.get("spatial_compression_ratio") or config.get("scale_factor_spatial") or 2 ** len(stages)
    temporal = config.get("temporal_compression_ratio") or config.get("scale_factor_temporal") or 2 ** sum(stages)
    batch, height, width = latent_shape[0], latent_shape[-2], latent_shape[-1]
    frames = 1 + (latent_shape[2] - 1) * temporal if len(latent_shape) == 5 else 1
    dtype_bytes = next(vae.parameters()).element_size()
    return int(batch * frames * height * spatial * width * spatial * per_pixel * dtype_bytes / 2)


def _config(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def refusal(plan: MemoryPlan, alternatives: Mapping[str, MemoryPlan], max_tokens: int) -> str:
    """Why `plan` cannot run, by how much, and which of `alternatives` (setting -> its plan) would fit."""
    short = plan.need - plan.budget
    fitting = [f"{setting} ({size(alt.need)})" for setting, alt in alternatives.items() if alt.fits]
    # The largest --max-tokens-per-step at which this plan fits: the step scales with the tokens.
    spare = plan.budget - (plan.need - plan.step_bytes)
    if plan.step_bytes and spare > 0:
        tokens = int(max_tokens * spare / plan.step_bytes) // 256 * 256
        if tokens > 0:
            fitting.append(f"--max-tokens-per-step {tokens}")
    advice = "; would fit: " + ", ".join(fitting) if fitting else "; no single setting fits: combine them"
    return f"the deploy does not fit: {plan.line()}, short by {size(short)}{advice}"


@dataclasses.dataclass(frozen=True)
class RankPlan:
    """One rank's plan at the request it must admit (`plan`), the envelope its memory leaves beyond that
    (`envelope`), and the same once one denoising step was measured (`measured`)."""

    plan: MemoryPlan
    envelope: Envelope
    admission: Admission
    text_tokens: int
    plan_at: Callable[..., MemoryPlan]  # (tokens, step_scale=1.0, text_tokens=...) -> the plan at one row of tokens
    rows: int = 1  # under layerwise offload: rows of the admitted request the plan holds (widest_envelope)

    def measured(self, step_bytes: int, tokens: int) -> Envelope:
        """The envelope once a step of `tokens` image tokens (one row, a short prompt) was measured to take
        `step_bytes` of activations: the estimate scaled by measurement over estimate (the estimate counted
        without text, so the scale errs high), never narrower than the request the deploy must admit."""
        estimate = self.plan_at(tokens, text_tokens=0).step_bytes
        scale = step_bytes / estimate if estimate else 1.0
        return widest_envelope(self.plan_at, self.admission, self.text_tokens, self.plan.offload, scale, self.rows)


def widest_envelope(
    plan_at: Callable[..., MemoryPlan],
    admission: Admission,
    text_tokens: int,
    offload: str,
    scale: float = 1.0,
    rows: int = 1,
) -> Envelope:
    """The widest forward that fits: the most tokens one row of a step may have (the model's cap at most), and the
    most tokens all rows together may have (their text allowance counted). A step's activations grow with rows x
    tokens, so one row of the forward's tokens stands for any rows of the same total. Under layerwise offload the
    memory the admitted request leaves keeps denoiser blocks resident instead (resident_blocks): no wider than the
    `rows` of it the plan holds."""
    required = admission.required_tokens
    most = rows * required + (rows - 1) * text_tokens
    widest_row = required
    if offload != "layerwise":
        high = admission.max_tokens * admission.max_rows + text_tokens * (admission.max_rows - 1)
        if plan_at(high, scale).fits:
            most = high
        else:
            low = required  # fits (or is admitted regardless: never narrower than the model's default request)
            while high - low > ENVELOPE_STEP_TOKENS:
                middle = (low + high) // 2
                low, high = (middle, high) if plan_at(middle, scale).fits else (low, middle)
            most = low
        widest_row = most
    per_row = admission.max_tokens if admission.max_tokens_set else max(required, min(widest_row, admission.max_tokens))
    return Envelope(per_row, max(most, per_row) + text_tokens, admission.max_rows, text_tokens)


def cheapest_placement(plan_at: Callable[..., MemoryPlan], lora: bool) -> str:
    """`cpu_offload="auto"`: the first of PLACEMENTS (cheapest first, each the same weights and arithmetic) in which
    the request the deploy must admit fits; "none" where none does (the refusal then names what would). From pinned
    memory a request moves each offloaded weight in once: the text encoders and the VAE cost little beside a
    denoising loop (encoders), of two experts the second once at its boundary step (model); layerwise streams every
    block at every step. Served LoRA adapters are merged into resident denoisers (LORA_PLACEMENTS)."""
    for mode in LORA_PLACEMENTS if lora else PLACEMENTS:
        if plan_at(offload=mode).fits:
            return mode
    return "none"


def device_memory(device: Any) -> tuple[int, int] | None:
    """(total, free) bytes of the rank's device; None on a CPU (no device memory to plan against)."""
    if device.type != "cuda":
        return None
    import torch

    free, total = torch.cuda.mem_get_info(device)
    return total, free


def plan_rank(
    config: Any, spec: Any, path: Path, device: Any, components: Iterable[str], memory: tuple[int, int] | None = None
) -> RankPlan | None:
    """This rank's plan (None on a CPU), or ValueError when the deploy cannot fit (`refusal`).

    The plan is made at the request the deploy must admit (`config.admission`: the model's default request, or
    the user's --max-tokens-per-step), and the envelope is what the rest of the memory holds beyond it. Under
    `cpu_offload="auto"` the placement is the cheapest that fits (`cheapest_placement`; `plan.offload` says which;
    the worker has every rank agree on it).
    `components`: those this rank loads (runner.loaded_components). `config` is the worker's
    OmniDiffusionConfig; `spec` the pipeline's PipelineSpec. `memory`: (total, free) bytes of a device to plan
    against instead of `device`'s (`vllm-omni plan`; a simulated device, the rank's hooks)."""
    memory = memory or device_memory(device)
    if memory is None:
        return None
    from vllm_omni.diffusion.models.family import attention_heads
    from vllm_omni.diffusion.worker.quantization import FP8_RULE

    components = list(components)
    denoisers = [name for name in spec.family_pipeline().denoisers if name in components]
    dtype_bytes = {"float32": 4}.get(config.dtype, 2)
    admission = config.admission or Admission(spec.max_tokens_per_step, spec.max_tokens_per_step, 1)
    text_allowance = max(spec.max_prompt_tokens or 0, DEFAULT_TEXT_TOKENS)
    parallel = config.parallel_config

    in_flight = config.max_num_seqs if config.scheduling_policy != "fcfs" else 1  # fcfs never interleaves
    lora = bool(config.lora_modules or config.allow_runtime_lora)
    placement = config.cpu_offload

    def plan(
        tokens: int = admission.required_tokens,
        step_scale: float = 1.0,
        text_tokens: int = text_allowance,
        offload: str | None = None,
        fp8: bool = config.quantization == "fp8",
        sp: int = 0,
        seqs: int = in_flight,
        rows: int = 1,
    ) -> MemoryPlan:
        return plan_for_checkpoint(
            path,
            components,
            denoisers,
            dtype_bytes=dtype_bytes,
            fp8_reason=FP8_RULE.bf16_reason_by_shape if fp8 else None,
            tokens=tokens,
            text_tokens=text_tokens,
            rows=rows,
            sp=sp or parallel.sequence_parallel_size,
            offload=offload or placement,
            device_total=memory[0],
            device_free=memory[1],
            utilization=config.gpu_memory_utilization,
            pixels=tokens * spec.token_side**2 if spec.modality == "image" else 0,
            lora=lora,
            lora_adapted=config.lora_adapted,
            in_flight=seqs,
            step_scale=step_scale,
        )

    if placement == "auto":
        placement = cheapest_placement(plan, lora)
    chosen = plan()
    if chosen.fits:
        rows = 1
        if chosen.offload == "layerwise" and config.cfg_one_pass_allowed and spec.family_pipeline().joins_cfg_rows:
            # The weights stream to the GPU every forward: a CFG step's two branches in one forward stream them once
            # a step, not twice (worker/cfg_batch.py). Room for both rows of the admitted request costs a resident
            # block or so; where it does not fit, the branches run as two forwards.
            both = plan(rows=2)
            if both.fits:
                chosen, rows = both, 2
        envelope = widest_envelope(plan, admission, text_allowance, chosen.offload, rows=rows)
        return RankPlan(chosen, envelope, admission, text_allowance, plan, rows)
    alternatives: dict[str, MemoryPlan] = {}
    fp8 = config.quantization is None and dtype_bytes == 2  # FP8 converts bf16 weights
    if fp8:
        alternatives["--quantization fp8"] = plan(fp8=True)
    for mode in PLACEMENTS[1:]:
        if mode != placement and not (lora and mode not in LORA_PLACEMENTS):
            alternatives[f"--cpu-offload {mode}"] = alone = plan(offload=mode)
            if fp8 and not alone.fits and not alternatives["--quantization fp8"].fits:  # both together
                alternatives[f"--quantization fp8 --cpu-offload {mode}"] = plan(fp8=True, offload=mode)
    if in_flight > 1:
        alternatives["--max-num-seqs 1"] = plan(seqs=1)
    heads = [attention_heads(_config(path / name)) for name in denoisers]
    degree = parallel.ulysses_degree * 2
    if heads and all(isinstance(h, int) and h % degree == 0 for h in heads):
        alternatives[f"--ulysses-degree {degree}"] = plan(sp=degree * parallel.ring_degree)
    else:  # the heads allow no more Ulysses: twice the ranks through ring attention
        alternatives[f"--ring-degree {parallel.ring_degree * 2}"] = plan(sp=parallel.sequence_parallel_size * 2)
    raise ValueError(refusal(chosen, alternatives, admission.required_tokens))
