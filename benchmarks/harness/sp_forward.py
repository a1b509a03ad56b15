"""SP forwards: one forward of a family's transformer, ours at Ulysses degrees against diffusers, timed.

A family's script declares its model (real config, inputs, sizes) and its variants; this module does the rest:
joining a torchrun NCCL world or acting as rank 0 of a simulated U<N> group (`init_parallel`,
`parallel_setup`), one set of random bf16 weights shared by every variant (`build_shared_models`),
compiled blocks and CUDA graphs as the engine runs them (`CompiledBlocks`, `with_cuda_graphs`,
`compiled_forwards`), interleaved timing (`time_variants`: a new random order each round, CUDA events on
each rank, median of the timed rounds), and the agreement of each variant with ours at U1.

`ForwardBenchmark` + `main` is the whole driver of the simplest scripts (qwen_image_sp.py, flux2_sp.py,
z_image_sp.py): ours at U1 and at U2 in trim / none / mask, eager and replayed as CUDA graphs; diffusers at
U1, and with its own Ulysses and Ulysses-anything context parallelism at U2. Run with torchrun on two GPUs
(real NCCL all-to-alls) or with --simulate on one GPU: rank 0 of a simulated U2 group does a real rank's
compute, but its all-to-alls are local copies, so it omits the communication cost, its outputs are not the
model's (no agreement numbers), and diffusers' CP cannot run that way. `--degree N` (with --simulate) acts
as rank 0 of a simulated U<N> group instead: the variants and ratios are then named U<N>. `--phase docs`
re-renders the docs section from the results JSON.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import random
import statistics
import sys
import time
import traceback
import types
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any
from unittest import mock

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402
from benchmarks.harness.reports import agreement as output_agreement  # noqa: E402
from vllm_omni.diffusion.config import DiffusionParallelConfig  # noqa: E402
from vllm_omni.diffusion.distributed.parallel_state import (  # noqa: E402
    ParallelState,
    initialize_parallel_state,
    initialize_simulated_parallel_state,
    use_parallel_state,
)
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward, compile_repeated_blocks  # noqa: E402

MODES = {"trim": {}, "none": {"trim_sp_padding": False}, "mask": {"mask_sp_padding": True}}
DEFAULT = " default"  # suffix of the variants run as the engine runs them: compiled blocks, CUDA graphs
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


# ---- ranks and timing ----------------------------------------------------------------------------


@dataclasses.dataclass
class ParallelSetup:
    rank: int
    device: torch.device
    state: ParallelState  # the Ulysses-N state; variants copy it with their padding mode
    simulated: bool
    description: str


def init_parallel(simulate: bool, degree: int | None = None) -> ParallelSetup:
    """torchrun: every process joins one NCCL group of WORLD_SIZE ranks. Simulated: rank 0 of a U`degree` group."""
    if simulate:
        degree = degree or 2
        device = torch.device("cuda", 0)
        torch.cuda.set_device(device)
        state = initialize_simulated_parallel_state(DiffusionParallelConfig(ulysses_degree=degree))
        setup = f"one GPU, simulated U{degree} rank (all-to-alls are local copies: no communication cost)"
        return ParallelSetup(0, device, state, True, setup)
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if degree is not None and degree != world:
        raise SystemExit(f"--degree {degree} needs torchrun --nproc_per_node {degree} (got {world} processes)")
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", timeout=timedelta(seconds=600), device_id=device)
    state = initialize_parallel_state(DiffusionParallelConfig(ulysses_degree=world), rank, "env://", device)
    names = {1: "one GPU", 2: "two GPUs"}
    return ParallelSetup(rank, device, state, False, f"{names.get(world, f'{world} GPUs')}, real NCCL all-to-alls")


def add_rank_args(parser: argparse.ArgumentParser, iters: int, warmup: int) -> None:
    """The options every SP-forward script shares: which rank this process is, and how many rounds it times."""
    parser.add_argument("--simulate", action="store_true", help="one GPU: act as rank 0 of a simulated group")
    parser.add_argument("--degree", type=int, default=None, help="Ulysses degree (default: torchrun's world size; 2)")
    parser.add_argument("--iters", type=int, default=iters)
    parser.add_argument("--warmup", type=int, default=warmup)


def check_heads(heads: int, degree: int) -> None:
    """Ulysses splits the heads over the group: a degree that does not divide them cannot run."""
    if degree > 1 and heads % degree:
        sys.exit(f"Ulysses {degree} does not divide the {heads} heads")


def end_run(parallel: ParallelSetup, save: Callable[[], None]) -> None:
    """Rank 0 saves the run (`save`: results file and docs); then every rank leaves the NCCL group together."""
    if parallel.rank == 0:
        save()
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


def with_padding_mode(state: ParallelState, **flags) -> ParallelState:
    """`state` with its config's padding flags replaced (mask_sp_padding / trim_sp_padding)."""
    return dataclasses.replace(state, config=state.config.replace(**flags))


def time_variants(
    name_to_variant: dict, inputs: dict, iters: int, warmup: int, rank: int, keep_outputs: bool = False
) -> tuple[dict[str, object], dict[str, torch.Tensor]]:
    """Median ms (or an error string) per variant, and each variant's last output if `keep_outputs`.

    A variant is (callable taking the forward's keyword arguments, parallel state or None).
    """
    timings: dict[str, list[float]] = {name: [] for name in name_to_variant}
    errors: dict[str, str] = {}
    outputs: dict[str, torch.Tensor] = {}
    names = list(name_to_variant)
    order = random.Random(0)  # same shuffle on every rank
    for i in range(warmup + iters):
        order.shuffle(names)  # a new order each round: no variant always follows the same one
        for name in names:
            if name in errors:
                continue
            model, state = name_to_variant[name]
            if dist.is_initialized():
                dist.barrier()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            try:
                with use_parallel_state(state), torch.inference_mode():
                    start.record()
                    out = model(**inputs)
                    end.record()
                torch.cuda.synchronize()
            except Exception as exc:  # noqa: BLE001 - recorded in the results (e.g. a variant that rejects a size)
                errors[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:200]
                if rank == 0:
                    traceback.print_exc()
                continue
            if keep_outputs:
                outputs[name] = out[0] if isinstance(out, tuple) else out.sample
            if i >= warmup:
                timings[name].append(start.elapsed_time(end))
    return {name: errors.get(name) or statistics.median(times) for name, times in timings.items()}, outputs


def agreement(actual: torch.Tensor, expected: torch.Tensor) -> dict[str, float]:
    """Max abs difference and PSNR (dB, peak = the expected output's max abs value), in fp32."""
    close = output_agreement(actual, expected, peak="max_abs")
    return {name: close[name] for name in ("max_abs_diff", "psnr_db", "finite")}


@contextlib.contextmanager
def host_timing(device: torch.device) -> Iterator[None]:
    """On a CPU (a --tiny smoke run), time_variants' CUDA events measure host time instead."""
    if device.type == "cuda":
        yield
        return

    class HostEvent:
        def __init__(self, enable_timing: bool = False) -> None:
            self.at = 0.0

        def record(self) -> None:
            self.at = time.perf_counter()

        def elapsed_time(self, end: HostEvent) -> float:
            return (end.at - self.at) * 1e3

    with mock.patch.object(torch.cuda, "Event", HostEvent), mock.patch.object(torch.cuda, "synchronize", lambda: None):
        yield


def parallel_setup(degree: int) -> ParallelSetup:
    """Rank 0 of a simulated U`degree` group: on the GPU (`init_parallel`), else on the CPU."""
    if torch.cuda.is_available():
        return init_parallel(True, degree)
    state = initialize_simulated_parallel_state(DiffusionParallelConfig(ulysses_degree=degree))
    return ParallelSetup(0, torch.device("cpu"), state, True, f"CPU smoke run, simulated U{degree} rank")


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"


def image_size_label(text: str) -> str:
    """'WxH' with both sides multiples of 32 (an argparse type)."""
    try:
        width, height = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not WIDTHxHEIGHT") from None
    if width <= 0 or height <= 0 or width % 32 or height % 32:
        raise argparse.ArgumentTypeError(f"size {text!r}: width and height must be multiples of 32")
    return text


# ---- models: shared weights, compiled blocks, CUDA graphs -------------------------------------------


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


def own_block_code(*block_lists: Any) -> None:
    """Gives each list of diffusers' blocks a copy of its block class's forward code object (same bytecode).

    Our blocks are diffusers' block classes with our processors, and dynamo keeps compiled code per code
    object. Once ours compiled (a graph break at the attention layer, so its guards do not look at the
    processors), diffusers' compiled blocks ran that entry instead of compiling their own fullgraph code:
    eager speed, bitwise the eager output (seen on CPU, torch 2.14). With their own code object they compile
    as they would in a process of their own.
    """
    for blocks in block_lists:
        block_cls = type(blocks[0])
        forward = block_cls.forward
        copy = types.FunctionType(
            forward.__code__.replace(), forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
        )
        copy.__kwdefaults__, copy.__qualname__ = forward.__kwdefaults__, forward.__qualname__
        # The same class name: compile_repeated_blocks finds blocks by it.
        own_cls = type(block_cls.__name__, (block_cls,), {"forward": copy, "__module__": block_cls.__module__})
        for block in blocks:
            block.__class__ = own_cls


def compiled_forwards(models: dict) -> dict:
    """Built once for every size, so compiled blocks and captured graphs persist across sizes."""
    ours_graphs = with_cuda_graphs(models["ours"])
    # with_cuda_graphs' CUDAGraphForward, read after a size: a failed capture makes it run eagerly from then on.
    cells = (cell.cell_contents for cell in ours_graphs.__closure__)
    wrapper = next(value for value in cells if isinstance(value, CUDAGraphForward))
    return {
        "ours": switched_on(CompiledBlocks(models["ours"], ours=True), ours_graphs),
        "diffusers": switched_on(CompiledBlocks(models["diffusers"], ours=False), models["diffusers"]),
        "graphs": wrapper,
    }


def compiled_variants(models: dict, compiled: dict | None, state, degree: int, simulated: bool, tokens: int) -> dict:
    """name -> (callable taking the forward's keyword arguments, parallel state for our model or None)."""
    out = {"ours U1": (models["ours"], None)}
    if compiled:
        out[f"ours U1{DEFAULT}"] = (compiled["ours"], None)
    for mode, flags in MODES.items() if degree > 1 else ():
        out[f"ours U{degree} {mode}"] = (models["ours"], with_padding_mode(state, **flags))
    if compiled and degree > 1 and not simulated:  # a simulated rank times the padding modes eagerly
        out[f"ours U{degree} trim{DEFAULT}"] = (compiled["ours"], with_padding_mode(state))
    out["diffusers U1"] = (models["diffusers"], None)
    if compiled:
        out["diffusers U1 compiled"] = (compiled["diffusers"], None)
    if "diffusers_ulysses" in models:
        # Plain Ulysses needs the tokens to divide by the degree (its sharder asserts, leaving NCCL corrupt).
        if tokens % 2 == 0:
            out["diffusers U2 ulysses"] = (models["diffusers_ulysses"], None)
        else:
            out["diffusers U2 ulysses_anything"] = (models["diffusers_anything"], None)
    return out


def compiled_ratios(degree: int) -> list[tuple[str, str, str]]:
    """(numerator, denominator, target) of the ratio table of `compiled_variants`."""
    u = f"ours U{degree}"
    return [
        (f"ours U1{DEFAULT}", "diffusers U1 compiled", "at most 0.95"),
        ("ours U1", "diffusers U1", ""),
        (f"ours U1{DEFAULT}", "ours U1", ""),
        ("diffusers U1 compiled", "diffusers U1", ""),
        (f"{u} trim", f"{u} none", "at most 1.01"),
        (f"{u} mask", f"{u} none", "reported"),
        (f"{u} trim", "ours U1", ""),
        (f"{u} trim{DEFAULT}", f"ours U1{DEFAULT}", ""),
        ("ours U2 trim", "diffusers U2 ulysses", ""),
        ("ours U2 trim", "diffusers U2 ulysses_anything", ""),
        (f"ours U2 trim{DEFAULT}", "diffusers U2 ulysses", ""),
        (f"ours U2 trim{DEFAULT}", "diffusers U2 ulysses_anything", ""),
    ]


# ---- a family's sizes timed, its rows kept, its tables -------------------------------------------------


def time_sizes(
    parallel: ParallelSetup,
    sizes: list[str],
    variants_of: Callable[[str], dict[str, Variant]],
    inputs_of: Callable[[str], dict[str, Any]],
    fields_of: Callable[[str], dict[str, Any]],
    layers: Any,
    iters: int,
    warmup: int,
    compiled: dict | None = None,
    keep_outputs: bool = True,
    label: str = "",
) -> list[dict[str, Any]]:
    """Each size's variants timed interleaved (`time_variants`), one row a variant and size: `fields_of(size)`
    (the size and what the family says of it), then variant, ms, error, setup, device, layers, degree, and
    the agreement with ours U1 (`agreement`) where the output is the model's (a simulated rank's U<N> outputs
    are not). With `compiled` (`compiled_forwards`), a default variant whose graph capture failed is an error,
    and a compiled variant bitwise equal to its eager one is flagged."""
    device, degree = parallel.device, parallel.state.config.ulysses_degree
    rows = []
    for size in sizes:
        with host_timing(device):
            result, outputs = time_variants(
                variants_of(size), inputs_of(size), iters, warmup, parallel.rank, keep_outputs=keep_outputs
            )
        graphs_failed = compiled is not None and compiled["graphs"].disabled
        for variant, value in result.items():
            ms = value if isinstance(value, float) else None
            if ms is not None and variant.endswith(DEFAULT) and graphs_failed:
                ms, value = None, "CUDA graph capture failed: it ran eagerly (see the log), not as the engine does"
            row = {
                **fields_of(size),
                "variant": variant,
                "ms": None if ms is None else round(ms, 3),
                "error": None if ms is not None else value,
                "setup": parallel.description,
                "device": device_name(device),
                "layers": layers,
                "degree": degree,
            }
            real = not parallel.simulated or not variant.startswith(f"ours U{degree} ")
            if real and ms is not None and variant in outputs and "ours U1" in outputs:
                row.update(agreement(outputs[variant], outputs["ours U1"]))
            eager = variant.removesuffix(DEFAULT).removesuffix(" compiled")
            if compiled is not None and eager != variant and eager in outputs and variant in outputs:
                if torch.equal(outputs[variant], outputs[eager]):
                    row["note"] = "bitwise equal to eager: did its blocks compile?"
            rows.append(row)
            if parallel.rank == 0:
                extra = f"  PSNR {row['psnr_db']:.1f} dB, max {row['max_abs_diff']:.3g}" if "psnr_db" in row else ""
                extra += f"  [{row['note']}]" if "note" in row else ""
                print(f"{label}{size} {variant:28s} {value if ms is None else f'{ms:.1f} ms'}{extra}", flush=True)
        outputs.clear()
    return rows


def merge_rows(path: Path, rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[dict[str, Any]]:
    """One results file for every run: the file's rows whose `keys` this run repeats are replaced by `rows`;
    returns (and saves) the rows kept, then this run's."""
    ran = {tuple(row[key] for key in keys) for row in rows}
    kept = [row for row in load_json(path, []) if tuple(row[key] for key in keys) not in ran]
    save_json(path, kept + rows)
    return kept + rows


def save_run(out: Path, rows: list[dict[str, Any]], run_keys: tuple[str, ...], write_docs, docs: Path) -> None:
    """This run's rows into the results file (a row of an earlier run is replaced where this run repeats its
    `run_keys` and size), then the docs section of this run: every row of the file with this run's `run_keys`."""
    every = merge_rows(out, rows, (*run_keys, "size"))
    this_run = {tuple(row[key] for key in run_keys) for row in rows}
    write_docs([row for row in every if tuple(row[key] for key in run_keys) in this_run], docs)


def runs_of(rows: list[dict[str, Any]], keys: tuple[str, ...]) -> list[list[dict[str, Any]]]:
    """The rows of each run (the same values of `keys`), runs in the order the rows first name them."""
    runs: dict[tuple, list[dict[str, Any]]] = {}
    for row in rows:
        runs.setdefault(tuple(row[key] for key in keys), []).append(row)
    return list(runs.values())


def forward_cell(row: dict[str, Any] | None) -> str:
    """A table cell: median ms, then the agreement with ours U1 in brackets and a note."""
    if row is None:
        return "n/a"
    if row["ms"] is None:
        return f"error: {row['error']}"
    text = f"{row['ms']:.1f}"
    if row.get("psnr_db") is not None and row["variant"] != "ours U1":
        psnr = "exact" if row["psnr_db"] == float("inf") else f"{row['psnr_db']:.1f} dB"
        text += f" ({psnr}, max {row['max_abs_diff']:.3g})"
    if row.get("note"):
        text += f" [{row['note']}]"
    return text


def forward_tables(rows: list[dict[str, Any]], sizes: list[str], header: list[str], ratios: list[tuple]) -> list[str]:
    """The docs' two tables of `time_sizes` rows: variants by size (`header`: the sizes' column titles), then
    the ratios (numerator, denominator[, target]) of which a variant ran."""
    table: dict[str, dict[str, dict]] = {}
    for row in rows:
        table.setdefault(row["variant"], {})[row["size"]] = row
    lines = ["| variant | " + " | ".join(header) + " |", "|---|" + "---|" * len(header)]
    for variant, by_size in table.items():
        lines.append(f"| {variant} | " + " | ".join(forward_cell(by_size.get(size)) for size in sizes) + " |")

    def ratio(a: str, b: str, size: str) -> str:
        x, y = table.get(a, {}).get(size, {}).get("ms"), table.get(b, {}).get(size, {}).get("ms")
        return f"{x / y:.3f}" if x and y else "n/a"

    targets = any(len(entry) == 3 for entry in ratios)
    lines += [
        "",
        "| ratio | " + " | ".join(sizes) + (" | target |" if targets else " |"),
        "|---|" + "---|" * (len(sizes) + targets),
    ]
    for a, b, *target in ratios:
        cells = [ratio(a, b, size) for size in sizes]
        if any(cell != "n/a" for cell in cells):  # a run without those variants leaves the row out
            lines.append(f"| {a} / {b} | " + " | ".join(cells) + (f" | {target[0]} |" if targets else " |"))
    return lines


# ---- the simplest scripts' driver: ForwardBenchmark and main ---------------------------------------


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


def agreement_with_baseline(
    name_to_variant: dict[str, Variant], inputs: dict, skip: set[str]
) -> dict[str, dict[str, Any]]:
    """name -> how one forward's output compares with ours at U1, in float32 (`reports.agreement`).

    `max_abs_diff`, `rel_l2`, and `psnr_db` = 10 log10(R^2 / MSE) with R the peak-to-peak range of the
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
    result = {}
    for name, out in outputs.items():
        if not (torch.isfinite(out).all() and torch.isfinite(baseline).all()):
            result[name] = {"max_abs_diff": None, "rel_l2": None, "psnr_db": None, "note": "non-finite output"}
            continue
        close = output_agreement(out, baseline, peak="range")
        identical = math.isinf(close["psnr_db"])
        result[name] = {
            "max_abs_diff": close["max_abs_diff"],
            "rel_l2": close["rel_l2"],
            "psnr_db": None if identical else round(close["psnr_db"], 2),
            "note": "identical" if identical else None,
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
    add_docs_phase(parser)
    args = parser.parse_args(argv)
    overrides, layers_label = bench.parse_layers(args.layers)
    if args.degree != 2 and not args.simulate:
        parser.error("--degree other than 2 needs --simulate (the real-rank run is two GPUs)")
    suffix = ("_simulated" if args.simulate else "") + ("" if args.degree == 2 else f"_u{args.degree}")
    out = args.out or ROOT / f"benchmarks/results/{bench.key}{suffix}.json"
    if args.phase == "docs":
        rows = load_json(out)
        write_docs(bench, rows, args.docs, rows[0]["setup"], args.degree)
        return
    if not torch.cuda.is_available():
        sys.exit(f"{bench.key}.py needs a CUDA GPU")

    parallel = init_parallel(args.simulate, args.degree)
    rank, device, u2_state, setup = parallel.rank, parallel.device, parallel.state, parallel.description

    models = bench.build_models(device, args.simulate, overrides)
    name_to_variant = variants(models, u2_state, args.simulate, not args.no_graphs, args.compile)
    rows = []
    for size in args.sizes:
        inputs = bench.make_inputs(bench.sizes[size], device)
        result = time_size(name_to_variant, inputs, args.iters, args.warmup, rank)
        failed = {name for name, value in result.items() if not isinstance(value, float)}
        agrees = {} if args.simulate else agreement_with_baseline(name_to_variant, inputs, skip=failed)
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
                    "rel_l2": close.get("rel_l2"),
                    "psnr_db": close.get("psnr_db"),
                    "note": close.get("note"),
                    "setup": setup,
                    "device": torch.cuda.get_device_name(device),
                    "layers": layers_label,
                }
            )
    end_run(parallel, lambda: (save_json(out, rows), write_docs(bench, rows, args.docs, setup, args.degree)))
