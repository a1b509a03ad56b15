"""Shared driver of the one-forward SP benchmarks (qwen_image_sp.py, flux2_sp.py).

A family's script describes its model in a `ForwardBenchmark` (real config, inputs, sizes) and
calls `main`. The driver builds one set of random bf16 weights on the GPU shared by every
variant (ours at U1 and at U2 in trim / none / mask, eager and replayed as CUDA graphs;
diffusers at U1, and with its own Ulysses and Ulysses-anything context parallelism at U2),
times them interleaved (CUDA events on rank 0, median of --iters rounds, a new random order
each round), measures how closely each variant's output agrees with ours at U1 (max abs
difference and PSNR of one forward; real ranks only), and writes the JSON results and the
docs section.

Run with torchrun on two GPUs (real NCCL all-to-alls) or with --simulate on one GPU: rank 0
of a simulated U2 group does a real rank's compute, but its all-to-alls are local copies, so
it omits the communication cost, its outputs are not the model's (no agreement numbers), and
diffusers' CP cannot run that way. `--degree N` (with --simulate) acts as rank 0 of a simulated
U<N> group instead: the variants and ratios are then named U<N>.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.docs_table import replace_section  # noqa: E402
from benchmarks.forward_timing import time_variants  # noqa: E402
from vllm_omni.diffusion.config import DiffusionParallelConfig  # noqa: E402
from vllm_omni.diffusion.distributed.parallel_state import (  # noqa: E402
    ParallelState,
    initialize_parallel_state,
    initialize_simulated_parallel_state,
    use_parallel_state,
)
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward, compile_repeated_blocks  # noqa: E402

MODES = {"trim": {}, "none": {"trim_sp_padding": False}, "mask": {"mask_sp_padding": True}}
BASELINE = "ours U1"  # what every variant's output is compared with
RATIOS = [
    ("ours U2 trim", "ours U1"),
    ("ours U2 trim graph", "ours U1 graph"),
    ("ours U2 trim graph", "ours U1"),
    ("ours U2 trim", "ours U2 none"),
    ("ours U2 trim graph", "ours U2 none graph"),
    ("ours U2 mask", "ours U2 none"),
    ("ours U2 mask graph", "ours U2 none graph"),
    ("ours U2 trim graph", "diffusers U2 ulysses_anything"),
    ("ours U1", "diffusers U1"),
    ("ours U1 compiled graph", "diffusers U1 compiled"),
    ("ours U1 compiled graph", "ours U1"),
    ("ours U2 trim compiled graph", "ours U1 compiled graph"),
    ("ours U2 trim compiled graph", "ours U2 none compiled graph"),
]

Models = dict[str, torch.nn.Module]
Variant = tuple[Callable[..., Any], ParallelState | None]  # a forward, and the parallel state to run it in


@dataclasses.dataclass(frozen=True)
class ForwardBenchmark:
    """What a family's script supplies."""

    key: str  # results/<key>[_simulated].json and the docs sections <key>_nccl / <key>_simulated
    title: str  # docs heading
    dims: str  # "Real dimensions (...)" sentence for the docs
    sizes: dict[str, int]  # size label -> latent grid side (tokens per side)
    default_layers: str
    # --layers text -> (config overrides, label stored in the results)
    parse_layers: Callable[[str], tuple[dict[str, int], Any]]
    # (device, simulate, config overrides) -> {"ours", "diffusers"[, "diffusers_ulysses", "diffusers_anything"]}
    build_models: Callable[[torch.device, bool, dict[str, int]], Models]
    make_inputs: Callable[[int, torch.device], dict[str, Any]]  # grid side -> the forward's keyword arguments


def build_shared_models(
    reference_cls: type,
    ours_cls: type,
    config: dict[str, Any],
    device: torch.device,
    simulate: bool,
    finish: Callable[[torch.nn.Module, torch.nn.Module], None] | None = None,
) -> Models:
    """The diffusers model with random bf16 weights on `device`, and copies sharing its weight tensors.

    `finish(copy, reference)` rebuilds what a meta-device copy lacks (non-parameter tensors).
    Each copy is its own module, since diffusers' CP hooks attach to it.
    """
    torch.manual_seed(0)  # identical weights on every rank
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            reference = reference_cls(**config).eval()
    finally:
        torch.set_default_dtype(previous)

    def sharing(cls: type) -> torch.nn.Module:
        with torch.device("meta"):
            model = cls(**config)
        model.load_state_dict(reference.state_dict(), assign=True)
        if finish is not None:
            finish(model, reference)
        return model.eval()

    models = {"ours": sharing(ours_cls), "diffusers": reference}
    if not simulate:
        from diffusers import ContextParallelConfig

        models["diffusers_ulysses"] = sharing(reference_cls)
        models["diffusers_ulysses"].enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        models["diffusers_anything"] = sharing(reference_cls)
        models["diffusers_anything"].enable_parallelism(
            config=ContextParallelConfig(ulysses_degree=2, ulysses_anything=True)
        )
    return models


class CompiledBlocks:
    """A model's repeated blocks compiled once, switched on only inside `with`: compiled and eager
    variants share one set of weights. `ours=True` compiles as the engine does (attention eager; each
    block's `forward` replaced by its compiled function); otherwise diffusers' own
    `compile_repeated_blocks(fullgraph=True)` (the module's compiled call)."""

    def __init__(self, model: torch.nn.Module, ours: bool) -> None:
        self.forwards: dict[torch.nn.Module, Any] = {}
        self.impls: dict[torch.nn.Module, Any] = {}
        if ours:
            before = {m for m in model.modules() if "forward" in m.__dict__}
            compile_repeated_blocks(model)
            self.forwards = {m: m.__dict__["forward"] for m in model.modules() if "forward" in m.__dict__}
            self.forwards = {m: f for m, f in self.forwards.items() if m not in before}
        else:
            model.compile_repeated_blocks(fullgraph=True)
            self.impls = {m: m._compiled_call_impl for m in model.modules() if m._compiled_call_impl is not None}
        if not (self.forwards or self.impls):
            raise RuntimeError(f"no block of {type(model).__name__} was compiled: the compiled variant would be eager")
        self.__exit__()

    def __enter__(self) -> None:
        for module, forward in self.forwards.items():
            module.forward = forward
        for module, impl in self.impls.items():
            module._compiled_call_impl = impl

    def __exit__(self, *exc: Any) -> None:
        for module in self.forwards:
            del module.forward  # the class's eager forward again
        for module in self.impls:
            module._compiled_call_impl = None


def switched_on(blocks: CompiledBlocks, fn: Callable[..., Any]) -> Callable[..., Any]:
    def call(**kwargs: Any) -> Any:
        with blocks:
            return fn(**kwargs)

    return call


def with_cuda_graphs(model: torch.nn.Module) -> Callable[..., Any]:
    """`model`'s forward with its sharded part replayed as CUDA graphs, as the engine's runner does it."""
    graphed = CUDAGraphForward(model.forward_sharded)

    def forward(**kwargs: Any) -> Any:
        model.sharded_wrapper = graphed
        try:
            return model(**kwargs)
        finally:
            model.sharded_wrapper = None

    return forward


def ratios(degree: int) -> list[tuple[str, str]]:
    """RATIOS with the U2 variants named for `degree`."""
    return [(a.replace("U2", f"U{degree}"), b.replace("U2", f"U{degree}")) for a, b in RATIOS]


def variants(
    models: Models, u2_state: ParallelState, simulate: bool, graphs: bool, compiled: bool = False
) -> dict[str, Variant]:
    """name -> (callable taking the forward's keyword arguments, parallel state for our model or None)."""
    ours = {"": models["ours"]}
    if graphs:
        ours[" graph"] = with_cuda_graphs(models["ours"])
    if compiled:
        ours[" compiled graph"] = switched_on(
            CompiledBlocks(models["ours"], ours=True), with_cuda_graphs(models["ours"])
        )
    out = {}
    degree = u2_state.config.ulysses_degree  # 2, or a simulated rank's --degree
    for suffix, fn in ours.items():
        out[f"ours U1{suffix}"] = (fn, None)
        for mode, flags in MODES.items():
            config = DiffusionParallelConfig(ulysses_degree=degree, **flags)
            out[f"ours U{degree} {mode}{suffix}"] = (fn, dataclasses.replace(u2_state, config=config))
    out["diffusers U1"] = (models["diffusers"], None)
    if compiled:
        diffusers_blocks = CompiledBlocks(models["diffusers"], ours=False)
        out["diffusers U1 compiled"] = (switched_on(diffusers_blocks, models["diffusers"]), None)
    if not simulate:
        out["diffusers U2 ulysses"] = (models["diffusers_ulysses"], None)
        out["diffusers U2 ulysses_anything"] = (models["diffusers_anything"], None)
    return out


def _error_text(exc: Exception) -> str:
    return f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]


def time_size(name_to_variant: dict[str, Variant], inputs: dict, iters: int, warmup: int, rank: int) -> dict:
    """name -> median ms, or the error text of a variant that cannot run (same on every rank)."""
    known: dict[str, str] = {}
    if "diffusers U2 ulysses" in name_to_variant and inputs["hidden_states"].shape[1] % 2:
        # Its sharder asserts on one rank while the other enters a collective: NCCL is left corrupt
        # (illegal memory access in the next variant). Not run; the error it raises is recorded.
        known["diffusers U2 ulysses"] = "AssertionError: sequence not divisible by the degree (not run)"
    runnable = {name: variant for name, variant in name_to_variant.items() if name not in known}
    result, _ = time_variants(runnable, inputs, iters, warmup, rank)
    return {name: known.get(name) or result[name] for name in name_to_variant}


def agreement(name_to_variant: dict[str, Variant], inputs: dict, skip: set[str]) -> dict[str, dict[str, Any]]:
    """name -> how one forward's output compares with ours at U1, in float32.

    `max_abs_diff`, and `psnr_db` = 10 log10(R^2 / MSE) with R the peak-to-peak range of the
    U1 output; `note` says "identical" or "non-finite output" where numbers say nothing.
    """
    outputs: dict[str, torch.Tensor] = {}
    for name, (model, state) in name_to_variant.items():
        if name in skip:
            continue
        if dist.is_initialized():
            dist.barrier()
        with use_parallel_state(state), torch.inference_mode():
            outputs[name] = model(**inputs)[0].float()
    baseline = outputs[BASELINE]
    peak = (baseline.max() - baseline.min()).item()
    result = {}
    for name, out in outputs.items():
        if not (torch.isfinite(out).all() and torch.isfinite(baseline).all()):
            result[name] = {"max_abs_diff": None, "psnr_db": None, "note": "non-finite output"}
            continue
        diff = out - baseline
        mse = diff.square().mean().item()
        result[name] = {
            "max_abs_diff": diff.abs().max().item(),
            "psnr_db": None if mse == 0 else round(10 * math.log10(peak**2 / mse), 2),
            "note": "identical" if mse == 0 else None,
        }
    return result


def _agreement_cell(row: dict | None) -> str:
    if not row or (row.get("max_abs_diff") is None and not row.get("note")):
        return "n/a"
    if row.get("note"):
        return row["note"]
    return f"{row['max_abs_diff']:.3g} / {row['psnr_db']:.1f} dB"


def write_docs(bench: ForwardBenchmark, rows: list[dict], path: Path, setup: str, degree: int = 2) -> None:
    device = rows[0]["device"]
    sizes = [size for size in bench.sizes if any(row["size"] == size for row in rows)]  # the sizes run
    table: dict[str, dict[str, object]] = {}
    accuracy: dict[str, dict[str, dict]] = {}
    for row in rows:
        table.setdefault(row["variant"], {})[row["size"]] = row["ms"] if row["ms"] is not None else row["error"]
        accuracy.setdefault(row["variant"], {})[row["size"]] = row
    layers = rows[0]["layers"]

    def cell(value):
        return f"{value:.1f}" if isinstance(value, float) else f"error: {value}"

    lines = [
        f"## {bench.title}",
        "",
        f"{bench.dims}, random bf16 weights shared by every variant, batch 1, {device}; {setup}"
        f"{'' if layers == bench.parse_layers(bench.default_layers)[1] else f'; layers: {layers}'}. "
        "Median ms over the run, variants interleaved.",
        "",
        "| variant | " + " | ".join(sizes) + " |",
        "|---|" + "---|" * len(sizes),
    ]
    for variant, by_size in table.items():
        lines.append(f"| {variant} | " + " | ".join(cell(by_size.get(size)) for size in sizes) + " |")

    def ratio(a, b, size):
        x, y = table.get(a, {}).get(size), table.get(b, {}).get(size)
        return f"{x / y:.3f}" if isinstance(x, float) and isinstance(y, float) else "n/a"

    lines += ["", "| ratio | " + " | ".join(sizes) + " |", "|---|" + "---|" * len(sizes)]
    for a, b in ratios(degree):
        if a in table and b in table:
            lines.append(f"| {a} / {b} | " + " | ".join(ratio(a, b, size) for size in sizes) + " |")

    if any(row.get("max_abs_diff") is not None or row.get("note") for row in rows):
        lines += [
            "",
            f"Agreement of one forward's bf16 output with `{BASELINE}`: max abs difference / PSNR "
            "(peak-to-peak range of the U1 output over the RMS difference).",
            "",
            "| variant | " + " | ".join(sizes) + " |",
            "|---|" + "---|" * len(sizes),
        ]
        for variant, by_size in accuracy.items():
            lines.append(f"| {variant} | " + " | ".join(_agreement_cell(by_size.get(size)) for size in sizes) + " |")
    section = f"{bench.key}_{'simulated' if 'simulated' in setup else 'nccl'}{'' if degree == 2 else f'_u{degree}'}"
    replace_section(path, section, "\n".join(lines), script=bench.key)


def main(bench: ForwardBenchmark, description: str, argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true", help="one GPU: act as rank 0 of a simulated U2 group")
    parser.add_argument("--degree", type=int, default=2, help="with --simulate: the simulated Ulysses degree (2)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", default=bench.default_layers, help="fewer layers for a quick check (%(default)s)")
    parser.add_argument("--sizes", nargs="+", choices=list(bench.sizes), default=list(bench.sizes))
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph variants of our model")
    parser.add_argument(
        "--compile", action="store_true", help="add compiled-block variants (ours with graphs, diffusers' own)"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--docs", type=Path, default=ROOT / "docs/benchmarks.md")
    args = parser.parse_args(argv)
    overrides, layers_label = bench.parse_layers(args.layers)
    if args.degree != 2 and not args.simulate:
        parser.error("--degree other than 2 needs --simulate (the real-rank run is two GPUs)")
    if not torch.cuda.is_available():
        sys.exit(f"{bench.key}.py needs a CUDA GPU")

    if args.simulate:
        rank, device = 0, torch.device("cuda", 0)
        torch.cuda.set_device(device)
        u2_state = initialize_simulated_parallel_state(DiffusionParallelConfig(ulysses_degree=args.degree))
        setup = f"one GPU, simulated U{args.degree} rank (all-to-alls are local copies: no communication cost)"
    else:
        rank = int(os.environ["RANK"])
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", timeout=timedelta(seconds=120), device_id=device)
        u2_state = initialize_parallel_state(DiffusionParallelConfig(ulysses_degree=2), rank, "env://", device)
        setup = "two GPUs, real NCCL all-to-alls"

    models = bench.build_models(device, args.simulate, overrides)
    name_to_variant = variants(models, u2_state, args.simulate, not args.no_graphs, args.compile)
    rows = []
    for size in args.sizes:
        inputs = bench.make_inputs(bench.sizes[size], device)
        result = time_size(name_to_variant, inputs, args.iters, args.warmup, rank)
        failed = {name for name, value in result.items() if not isinstance(value, float)}
        agrees = {} if args.simulate else agreement(name_to_variant, inputs, skip=failed)
        for variant, value in result.items():
            ms = value if isinstance(value, float) else None
            close = agrees.get(variant, {})
            if rank == 0:
                note = f" | {_agreement_cell(close)} vs {BASELINE}" if close else ""
                print(f"{size} {variant:32s} {value if ms is None else f'{ms:.2f} ms'}{note}", flush=True)
            rows.append(
                {
                    "size": size,
                    "variant": variant,
                    "ms": None if ms is None else round(ms, 3),
                    "error": None if ms is not None else value,
                    # agreement with ours at U1 (real ranks only): see `agreement`
                    "max_abs_diff": close.get("max_abs_diff"),
                    "psnr_db": close.get("psnr_db"),
                    "note": close.get("note"),
                    "setup": setup,
                    "device": torch.cuda.get_device_name(device),
                    "layers": layers_label,
                }
            )
    if rank == 0:
        suffix = ("_simulated" if args.simulate else "") + ("" if args.degree == 2 else f"_u{args.degree}")
        out = args.out or ROOT / f"benchmarks/results/{bench.key}{suffix}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")
        write_docs(bench, rows, args.docs, setup, args.degree)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
