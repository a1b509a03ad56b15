"""LoRA adapters on one GPU: the forward without and with an adapter, the switch, the load (issue 29).

Real-size transformers with random bf16 weights (the SP benchmarks' builders), each with random rank-64 adapters
on every attention and MLP linear of its blocks, written as diffusers-format safetensors and read back through
the pipeline's own diffusers loader, as a worker does (vllm_omni/diffusion/worker/lora.py). Per model, one
forward at its size is timed as the engine runs it, replayed as a CUDA graph captured once before any adapter:

    base      no adapter ever merged (today's forward)
    lora      adapter A merged
    base-after  after switching to A, to B and back: the same graph, the original weights copied back

interleaved (a new random order each round; switching between timed rounds), median of --iters. Also: the time to
read an adapter from disk into the rank's cache (diffusers + PEFT, then the factors copied out), the time to
switch between two resident adapters (merge B from the originals, median of 10), whether the graph's output with
A differs from base and whether base-after equals base bit for bit.

    python benchmarks/lora.py --models qwen-image flux2 wan2.2     # one H200; results/lora.json, docs

Models: Qwen-Image (60 layers) at 1328x1328; FLUX.2-dev with --flux2-layers of its 8 + 48 blocks (the engine
keeps a copy of every adapted weight: the whole 32B model twice does not fit one GPU beside its activations)
at 1024x1024; Wan2.2 A14B's high-noise expert at 848x480x81.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.e2e import RANK, write_adapter  # noqa: E402
from benchmarks.harness.reports import replace_section  # noqa: E402
from vllm_omni.diffusion.request import LoraRequest  # noqa: E402
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward  # noqa: E402
from vllm_omni.diffusion.worker.lora import LoraAdapters  # noqa: E402

TARGETS_RATIO = [("lora", "base", "<= 1.10"), ("base-after", "base", "<= 1.01")]


def _model(name: str, device: torch.device, flux2_layers: str) -> tuple[torch.nn.Module, dict[str, Any], str, str]:
    """(our transformer, one forward's inputs, the diffusers pipeline class, the size label)."""
    if name == "qwen-image":
        from benchmarks import qwen_image_sp as family

        return (
            family.build_models(device, True, {})["ours"],
            family.make_inputs(83, device),
            "QwenImagePipeline",
            ("1328x1328"),
        )
    if name == "flux2":
        from benchmarks import flux2_sp as family

        overrides, _ = family.parse_layers(flux2_layers)
        models = family.build_models(device, True, overrides)
        return models["ours"], family.make_inputs(64, device), "Flux2Pipeline", f"1024x1024, {flux2_layers} blocks"
    from benchmarks import wan22_sp as family

    models = family.build_models(device, family.REAL_CONFIG["num_layers"], diffusers_ulysses=False)
    return models["ours"], family.make_inputs("848x480x81", device), "WanPipeline", "848x480x81"


def pipeline_around(pipeline_class: str, model: torch.nn.Module) -> Any:
    """The diffusers pipeline with only its transformer: what its LoRA loader needs."""
    import diffusers

    cls = getattr(diffusers, pipeline_class)
    names = [n for n in inspect.signature(cls.__init__).parameters if n not in ("self", "transformer")]
    return cls(**dict.fromkeys(names), transformer=model)


def _timed(fn: Any, iters: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def run_model(name: str, args: argparse.Namespace, device: torch.device, scratch: Path) -> dict[str, Any]:
    model, inputs, pipeline_class, size = _model(name, device, args.flux2_layers)
    folders = {key: scratch / f"{name}-{key}" for key in ("a", "b")}
    linears = [write_adapter(model, folder, seed) for seed, folder in enumerate(folders.values())][0]
    loras = {key: LoraRequest(key, str(folder)) for key, folder in folders.items()}
    adapters = LoraAdapters(pipeline_around(pipeline_class, model), {"transformer": model}, device, 2, 2)
    graphed = CUDAGraphForward(model.forward_sharded)

    def forward() -> torch.Tensor:
        model.sharded_wrapper = graphed
        try:
            with torch.inference_mode():
                out = model(**inputs)
            return out[0] if isinstance(out, tuple) else out.sample
        finally:
            model.sharded_wrapper = None

    base_out = forward().clone()  # captures the graph, before any adapter
    loads = []
    for key in ("a", "b"):
        start = time.perf_counter()
        adapters.factors(loras[key])
        torch.cuda.synchronize()
        loads.append(time.perf_counter() - start)
    adapters.activate(loras["a"])
    lora_out = forward().clone()
    switches = []
    for index in range(10):
        adapters.activate(loras["b" if index % 2 == 0 else "a"])
        switches.append(adapters.switch_seconds)
    adapters.activate(None)
    after_out = forward().clone()
    times: dict[str, list[float]] = {"base": [], "lora": [], "base-after": []}
    for _ in range(args.warmup):
        forward()
    for _ in range(args.iters):
        for variant in random.sample(list(times), len(times)):
            adapters.activate(loras["a"] if variant == "lora" else None)
            times[variant].append(_timed(forward, 1))
    ms = {variant: statistics.median(values) for variant, values in times.items()}
    row = {
        "model": name,
        "size": size,
        "adapted_linears": linears,
        "rank": RANK,
        "forward_ms": ms,
        "ratios": {f"{a} / {b}": ms[a] / ms[b] for a, b, _ in TARGETS_RATIO},
        "switch_ms_median": statistics.median(switches) * 1e3,
        "load_s": loads,
        "lora_changes_output": bool((lora_out != base_out).any()),
        "base_after_equals_base": bool(torch.equal(after_out, base_out)),
        "original_copy_gib": sum(t.numel() * t.element_size() for t in adapters.originals.values()) / 2**30,
        "peak_gib": torch.cuda.max_memory_allocated(device) / 2**30,
    }
    print(json.dumps(row, indent=1), flush=True)
    return row


def write_docs(rows: list[dict[str, Any]], path: Path) -> None:
    lines = [
        "## LoRA adapters: one forward without and with an adapter, the switch, the load",
        "",
        "`python benchmarks/lora.py` on one H200: real-size transformers with random bf16 weights, a random rank-64 "
        "adapter on every attention and MLP linear of the blocks, merged into the weights (worker/lora.py); one "
        "forward replayed as a CUDA graph captured before any adapter, median of interleaved rounds.",
        "",
        "| model | size | adapted linears | base ms | with adapter ms | base after switches ms | with / base "
        "(<= 1.10) | base after / base (<= 1.01) | switch ms (<= 50) | load from disk s | base after = base "
        "| copy of originals GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ms = r["forward_ms"]
        lines.append(
            f"| {r['model']} | {r['size']} | {r['adapted_linears']} | {ms['base']:.1f} | {ms['lora']:.1f} | "
            f"{ms['base-after']:.1f} | {r['ratios']['lora / base']:.3f} | {r['ratios']['base-after / base']:.3f} | "
            f"{r['switch_ms_median']:.1f} | {r['load_s'][0]:.2f} | {'yes' if r['base_after_equals_base'] else 'NO'} "
            f"| {r['original_copy_gib']:.1f} |"
        )
    replace_section(path, "lora", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=["qwen-image", "flux2", "wan2.2"])
    parser.add_argument("--flux2-layers", default="8,24", help="FLUX.2 double,single blocks (%(default)s)")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/lora.json")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs/benchmarks.md")
    parser.add_argument("--phase", choices=("run", "docs"), default="run")
    args = parser.parse_args()
    if args.phase == "docs":
        write_docs(json.loads(args.out.read_text())["rows"], args.docs)
        return
    if not torch.cuda.is_available():
        sys.exit("lora.py needs a CUDA GPU")
    device = torch.device("cuda", 0)
    rows = []
    with tempfile.TemporaryDirectory() as scratch:
        for name in args.models:
            rows.append(run_model(name, args, device, Path(scratch)))
            gc.collect()  # the model and its copies went with run_model's frame
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            args.out.parent.mkdir(parents=True, exist_ok=True)
            args.out.write_text(json.dumps({"device": torch.cuda.get_device_name(0), "rows": rows}, indent=1))
            write_docs(rows, args.docs)


if __name__ == "__main__":
    main()
