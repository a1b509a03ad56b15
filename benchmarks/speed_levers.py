"""Speed levers beyond bf16 parity with diffusers compiled: what each buys in one transformer forward.

Phases (each merges its results into the JSON under its own key and rewrites its own docs section,
so phases and models can run in separate calls):

    fp8    Qwen-Image and FLUX.2-dev at real dimensions (the configs of qwen_image_sp.py and flux2_sp.py),
           random bf16 weights built on the GPU, one forward at 1328x1328, batch 1, variants interleaved:
             ours bf16                   the engine's default: compiled blocks + CUDA graphs
             ours fp8                    the same after the engine's FP8 conversion (quantize_denoiser:
                                         the rule of vllm_omni/diffusion/worker/quantization.py)
             ours fp8 all linears        ablation: FP8 on every linear layer torchao can convert
             ours fp8 rule + modulation  ablation: the rule, with the AdaLN modulation linears in FP8 too
             diffusers compiled          diffusers' model after its compile_repeated_blocks(fullgraph=True)
           Every variant shares the bf16 weight tensors; the FP8 ones share each converted layer. Agreement
           of each output with ours bf16: max abs difference, relative L2 error, PSNR. With random weights
           this measures numerics, not picture quality.
    Step caching, and FP8 end to end, are variants of benchmarks/qwen_image_e2e.py (its `levers` phase).

On one H200 (`.whl` carried: diffusers and torchao 0.18.0, which supports torch >= 2.11), one model per
call: each compiles five variants (minutes), and FLUX.2-dev holds 64 GB of bf16 weights plus 32 GB of FP8
ones. A call cut short keeps nothing of its model: rerun it on the warm machine (inductor's disk cache
makes the compiles short), or split it with --variants (ratios are then across calls).

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 benchmarks/speed_levers.py --phase fp8 --models qwen_image --copy-to $OUT
    python3 benchmarks/speed_levers.py --phase fp8 --models flux2 --copy-to $OUT

Copy the returned speed_levers.json to benchmarks/results/ between calls (models accumulate) and run
`--phase docs` here at the end. `--tiny` runs the same code on CPU with tiny widths (plumbing only: eager,
no compile or graphs, FP8 skipped with the reason, timings meaningless).
"""  # noqa: E501

from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks import flux2_sp, qwen_image_sp  # noqa: E402
from benchmarks.harness.e2e import copy_outputs  # noqa: E402
from benchmarks.harness.reports import agreement, replace_section  # noqa: E402
from benchmarks.harness.sp_forward import (  # noqa: E402
    CompiledBlocks,
    ForwardBenchmark,
    switched_on,
    time_variants,
    with_cuda_graphs,
)
from vllm_omni.diffusion.worker.quantization import (  # noqa: E402
    FP8_RULE,
    KEEP_BF16,
    FP8Rule,
    check_quantization,
    fp8_quantize,
    move_bias_out,
    quantize_denoiser,
)

KEY = "speed_levers"
DEFAULT_OUT = ROOT / f"benchmarks/results/{KEY}.json"
DEFAULT_DOCS = ROOT / "docs/benchmarks.md"
SIZE = "1328x1328"
BASELINE = "ours bf16"


@dataclasses.dataclass(frozen=True)
class Model:
    title: str
    bench: ForwardBenchmark  # the family's one-forward benchmark: real config, weights, inputs
    tiny: dict[str, Any]  # --tiny: config overrides (input widths kept: its inputs are built for them)


MODELS = {
    "qwen_image": Model(
        "Qwen-Image",
        qwen_image_sp.BENCHMARK,
        dict(num_layers=1, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4, 6, 6)),
    ),
    "flux2": Model(
        "FLUX.2-dev",
        flux2_sp.BENCHMARK,
        dict(num_layers=1, num_single_layers=1, attention_head_dim=16, num_attention_heads=2, axes_dims_rope=(4,) * 4),
    ),
}
TINY_SIDE = 8  # 64 image tokens

# The per-rule ablation: FP8 by other rules than the engine's (FP8_RULE), to measure that one.
ABLATION = {
    "ours fp8 all linears": FP8Rule(min_features=16, keep_bf16={}),
    "ours fp8 rule + modulation": FP8Rule(keep_bf16={k: v for k, v in KEEP_BF16.items() if k != "modulation"}),
}
VARIANTS = [BASELINE, "ours fp8", *ABLATION, "diffusers compiled"]
RATIOS = [
    ("ours fp8", "diffusers compiled"),  # issue 21's target: at most 0.75 (moonshot 0.65)
    ("ours bf16", "diffusers compiled"),
    ("ours fp8", "ours bf16"),
    ("ours fp8 all linears", "ours fp8"),
    ("ours fp8 rule + modulation", "ours fp8"),
]


# ---- fp8 --------------------------------------------------------------------------------------------


def sharing_copy(model: torch.nn.Module) -> Callable[[], torch.nn.Module]:
    """A function that builds another instance of `model`'s class sharing its tensors (built on meta)."""

    def build() -> torch.nn.Module:
        with torch.device("meta"):
            copy = type(model).from_config(model.config)
        copy.load_state_dict(model.state_dict(), assign=True)
        for name, buffer in model.named_buffers():  # non-persistent ones (rotary tables) too
            copy.get_submodule(name.rpartition(".")[0]).register_buffer(name.rpartition(".")[2], buffer)
        for child, source in zip(copy.modules(), model.modules()):  # plain tensor attributes (rotary tables)
            for attr, value in vars(source).items():
                if isinstance(value, torch.Tensor) and not isinstance(value, torch.nn.Parameter):
                    setattr(child, attr, value)
        return copy.eval()

    return build


def fp8_models(ours: torch.nn.Module, labels: list[str]) -> dict[str, torch.nn.Module]:
    """The FP8 variants of `ours` named in `labels`: the engine's conversion ("ours fp8", always made: the
    ablation reuses its layers) and the ablation rules'; each layer is converted once and shared."""
    share = sharing_copy(ours)
    engine = share()
    weights = {name: engine.get_submodule(name).weight for name in quantize_denoiser(engine, "fp8")}
    models = {"ours fp8": engine}
    for label in labels:
        if label not in ABLATION:
            continue
        model = share()
        layers = ABLATION[label].fp8_layers(model)
        new = [name for name in layers if name not in weights]
        fp8_quantize(model, new)
        weights.update((name, model.get_submodule(name).weight) for name in new)
        for name in layers:
            linear = model.get_submodule(name)
            if name not in new:
                move_bias_out(linear)  # as fp8_quantize did to the layer whose FP8 weight it shares
            linear.weight = weights[name]
        models[label] = model
    return {label: model for label, model in models.items() if label in labels}


def layer_summary(model: torch.nn.Module) -> dict[str, Any]:
    """How many linear layers, and what share of their weights, each rule converts to FP8."""
    linears = {name: m for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    total = sum(m.weight.numel() for m in linears.values())
    out = {"linear_layers": len(linears)}
    for label, rule in {"ours fp8": FP8_RULE, **ABLATION}.items():
        layers = rule.fp8_layers(model)
        out[label] = {
            "fp8_layers": len(layers),
            "fp8_weight_share": round(sum(linears[name].weight.numel() for name in layers) / total, 4),
        }
    return out


def agreement_row(out: torch.Tensor, baseline: torch.Tensor) -> dict[str, Any]:
    close = agreement(out, baseline)  # the PSNR's peak: the baseline's max abs value
    return {
        "max_abs_diff": close["max_abs_diff"],
        "rel_l2": close["rel_l2"],
        "psnr_db": None if math.isinf(close["psnr_db"]) else round(close["psnr_db"], 2),
        "finite": close["finite"],
    }


def run_fp8(model_key: str, args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    spec = MODELS[model_key]
    overrides = spec.tiny if args.tiny else spec.bench.parse_layers(args.layers)[0] if args.layers else {}
    side = TINY_SIDE if args.tiny else spec.bench.sizes[SIZE]
    cuda = device.type == "cuda"
    built = spec.bench.build_models(device, True, overrides)  # {"ours", "diffusers"}, shared bf16 weights
    ours, diffusers = built["ours"], built["diffusers"]

    def engine_default(model: torch.nn.Module) -> Callable[..., Any]:
        """Compiled blocks + CUDA graphs, as the engine runs on GPUs; eager on CPU."""
        return switched_on(CompiledBlocks(model, ours=True), with_cuda_graphs(model)) if cuda else model

    models = {BASELINE: ours}  # the baseline of every agreement figure: always run
    fp8 = [name for name in args.variants if name == "ours fp8" or name in ABLATION]
    skipped = None
    if fp8:
        try:
            check_quantization("fp8", device.type, "bfloat16")
            models.update(fp8_models(ours, fp8))
        except (ValueError, ImportError) as exc:  # a CPU run, a GPU below 8.9, no torchao: said, not hidden
            skipped = str(exc)
            print(f"{model_key}: FP8 variants skipped: {skipped}", flush=True)
    variants = {name: (engine_default(model), None) for name, model in models.items()}
    if "diffusers compiled" in args.variants:
        compiled = switched_on(CompiledBlocks(diffusers, ours=False), diffusers) if cuda else diffusers
        variants["diffusers compiled"] = (compiled, None)

    inputs = spec.bench.make_inputs(side, device)
    if cuda:
        timings, outputs = time_variants(variants, inputs, args.iters, args.warmup, 0, keep_outputs=True)
    else:  # plumbing only: one eager forward each, not timed
        with torch.inference_mode():
            outputs = {name: fn(**inputs)[0] for name, (fn, _) in variants.items()}
        timings = dict.fromkeys(variants, None)
    rows = {}
    for name in VARIANTS:
        if name not in variants and not (skipped and name in fp8):
            continue
        value = timings.get(name, "skipped")
        row = {"ms": round(value, 3) if isinstance(value, float) else None}
        row["error"] = value if isinstance(value, str) else None
        if name in outputs and BASELINE in outputs:
            row.update(agreement_row(outputs[name], outputs[BASELINE]))
        rows[name] = row
        close = "" if "rel_l2" not in row else f", max abs {row['max_abs_diff']:.3g}, rel L2 {row['rel_l2']:.3g}"
        print(f"{model_key} {name:28s} {row['ms'] or row['error'] or 'not timed'}{close}", flush=True)
    return {
        "title": spec.title,
        "size": f"{side * 16}x{side * 16}",
        "image_tokens": side * side,
        "layers": layer_summary(ours),
        "fp8_skipped": skipped,
        "variants": rows,
    }


def fp8_section(phase: dict[str, Any]) -> str:
    models = phase["models"].values()
    lines = [
        "## Speed levers: FP8 matmuls, one transformer forward",
        "",
        "Real dimensions (the configs of benchmarks/qwen_image_sp.py and flux2_sp.py), random bf16 weights shared "
        "by every variant, batch 1; median ms over the run, variants interleaved. `ours bf16` is the engine's "
        "default (compiled blocks + CUDA graphs); `ours fp8` the same after the engine's FP8 conversion "
        "(`--quantization fp8`: torchao float8 dynamic activation + weight, row-wise scales, on the layers the rule "
        "of vllm_omni/diffusion/worker/quantization.py picks); the ablation converts every linear layer, or the rule's "
        "layers and the AdaLN modulation linears. Agreement with `ours bf16`: max abs difference / relative L2 "
        "error / PSNR (peak: the largest |output|). With random weights this measures numerics, not picture "
        "quality: with a real checkpoint, compare FP8 and bf16 images of the same prompts and seeds.",
        "",
    ]
    lines += [
        f"- {m['title']} at {m['size']} ({m['image_tokens']} image tokens): {m['device']}, torch {m['torch']}, "
        f"torchao {m['torchao']}; {m['setup']}"
        + (f". FP8 variants skipped: {m['fp8_skipped']}" if m["fp8_skipped"] else "")
        for m in models
    ]
    lines += ["", "| model | variant | ms | vs ours bf16 |", "|---|---|---|---|"]
    for model in models:
        for name, row in model["variants"].items():
            ms = f"{row['ms']:.1f}" if row["ms"] is not None else "failed" if row["error"] else "not timed"
            close = "n/a" if row.get("rel_l2") is None else f"{row['max_abs_diff']:.3g} / {row['rel_l2']:.2e}"
            if row.get("psnr_db") is not None:
                close += f" / {row['psnr_db']:.1f} dB"
            lines.append(f"| {model['title']} | {name} | {ms} | {close} |")
    lines += ["", "| model | " + " | ".join(f"{a} / {b}" for a, b in RATIOS) + " |", "|---|" + "---|" * len(RATIOS)]
    for model in models:
        ms = {name: row["ms"] for name, row in model["variants"].items()}
        cells = [f"{ms[a] / ms[b]:.3f}" if ms.get(a) and ms.get(b) else "n/a" for a, b in RATIOS]
        lines.append(f"| {model['title']} | " + " | ".join(cells) + " |")
    lines += ["", "Linear layers in FP8 (layers / share of the linear layers' weights):", ""]
    for model in models:
        layers = model["layers"]
        picks = [
            f"{label}: {layers[label]['fp8_layers']} / {layers[label]['fp8_weight_share']:.1%}"
            for label in layers
            if label != "linear_layers"
        ]
        lines.append(f"- {model['title']}, {layers['linear_layers']} linear layers: " + "; ".join(picks))
    failed = [(m["title"], name, row["error"]) for m in models for name, row in m["variants"].items() if row["error"]]
    if failed:
        lines += ["", "Failed variants:", ""] + [f"- {title}, {name}: `{error[:300]}`" for title, name, error in failed]
    return "\n".join(lines)


def phase_fp8(args: argparse.Namespace, results: dict[str, Any], save: Callable[[], None]) -> None:
    cuda = torch.cuda.is_available() and not args.tiny
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    try:
        import torchao

        torchao_version = torchao.__version__
    except ImportError:
        torchao_version = "not installed"
    setup = dict(
        device=torch.cuda.get_device_name(device) if cuda else "cpu",
        torch=torch.__version__,
        torchao=torchao_version,
        setup="one GPU" if cuda else "CPU plumbing run (--tiny widths): eager, not timed",
    )
    phase = results.setdefault("fp8", {"models": {}})
    for model_key in args.models:
        start = time.perf_counter()
        row = dict(setup, **run_fp8(model_key, args, device), seconds=round(time.perf_counter() - start))
        phase["models"][model_key] = row
        save()
        torch._dynamo.reset()  # the next model's compiled variants start from no cached code (the disk cache stays)
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()


PHASES: dict[str, tuple[Callable[..., None], Callable[[dict[str, Any]], str]]] = {"fp8": (phase_fp8, fp8_section)}


def write_docs(results: dict[str, Any], docs: Path) -> None:
    for name, (_, section) in PHASES.items():
        if results.get(name, {}).get("models"):
            replace_section(docs, f"{KEY}_{name}", section(results[name]), script=KEY)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", nargs="+", choices=[*PHASES, "docs"], default=list(PHASES))
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument(
        "--variants", nargs="+", choices=VARIANTS, default=VARIANTS, help="a subset (ours bf16 always runs)"
    )
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2, help="untimed rounds first (compile, graph capture)")
    parser.add_argument("--layers", default=None, help="fewer layers for a quick check, as the *_sp.py scripts take")
    parser.add_argument("--tiny", action="store_true", help="tiny widths on CPU: the plumbing only")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--docs", type=Path, default=DEFAULT_DOCS)
    parser.add_argument("--copy-to", type=Path, help="also copy the JSON and the docs page here after each save")
    args = parser.parse_args(argv)
    if not args.tiny and not torch.cuda.is_available() and args.phase != ["docs"]:
        sys.exit("speed_levers.py needs a CUDA GPU (or --tiny for the CPU plumbing run)")
    results = json.loads(args.out.read_text()) if args.out.exists() else {}

    def save() -> None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=1) + "\n")
        write_docs(results, args.docs)
        copy_outputs(args.copy_to, args.out, args.docs)

    for name in args.phase:
        if name != "docs":
            PHASES[name][0](args, results, save)
    save()


if __name__ == "__main__":
    main()
