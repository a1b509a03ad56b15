"""Where one denoiser forward's time goes (issue 46): the torch profiler's kernels, by kind, against the roofline.

Real dimensions with random bf16 weights built on the GPU (no checkpoint): Qwen-Image's transformer (60 layers,
24 heads x 128) at 1024x1024 and 1328x1328, with one row (a CFG step's two forwards, each) and two rows (CFG in
one pass), and one Wan2.2 A14B expert (40 layers, 40 heads x 128) at 832x480x81, one row. Each runs as the engine runs
it: compiled blocks, the forward chain, and (after the profile) its CUDA graph replay timed. Per forward:

- the wall time of the eager-launched compiled forward and of its graph replay (median of --iters);
- the profiled forward's GPU time by kind: GEMMs, attention, norms, other elementwise (inductor's fused
  kernels, copies), FP8 quantisation, communication, and the idle gap (wall less the kernels: launches and
  host work, which the graph replay removes);
- the roofline: GEMM and attention FLOPs from the model's shape (a linear layer 2 x in x out a token, attention
  4 x L^2 x head dim a head), the time each would take at the card's dense peak, and the achieved fraction.

    python3 benchmarks/profile_forward.py --out $OUT                       # on the GPU machine (~4 minutes)
    python3 benchmarks/profile_forward.py --phase docs                     # the docs section from the JSON
    python3 benchmarks/profile_forward.py --layers 2 --out /tmp            # smoke run: 2 layers (a GPU still)
    python3 benchmarks/profile_forward.py --unfused-gelu --out $OUT        # bias + GELU after the GEMM, as before
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import replace_section  # noqa: E402

KEY = "profile_forward"
RESULTS = ROOT / f"benchmarks/results/{KEY}.json"
DOCS = ROOT / "docs/performance.md"
# Dense peaks (TFLOP/s) of the cards the device lends, from their data sheets (SXM, without sparsity).
PEAK_TFLOPS = {"H100": {"bf16": 989.0, "fp8": 1979.0}, "H200": {"bf16": 989.0, "fp8": 1979.0}}

QWEN = dict(
    patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128, num_attention_heads=24,
    joint_attention_dim=3584, axes_dims_rope=(16, 56, 56),
)  # fmt: skip
WAN = dict(
    patch_size=(1, 2, 2), num_attention_heads=40, attention_head_dim=128, in_channels=16, out_channels=16,
    text_dim=4096, freq_dim=256, ffn_dim=13824, num_layers=40, cross_attn_norm=True,
    qk_norm="rms_norm_across_heads", eps=1e-6, image_dim=None, added_kv_proj_dim=None, rope_max_seq_len=1024,
)  # fmt: skip
QWEN_TEXT = (30, 12)  # a prompt's and a negative prompt's valid tokens (Qwen2.5-VL, after the template's drop)
WAN_TEXT = 512  # WanPipeline pads every prompt to 512 tokens
CASES = [  # (model, size, rows)
    ("qwen-image", "1024x1024", 1),
    ("qwen-image", "1024x1024", 2),
    ("qwen-image", "1328x1328", 1),
    ("qwen-image", "1328x1328", 2),
    ("wan2.2", "832x480x81", 1),  # true CFG as two forwards of a row (the default where the weights fit)
]

KINDS = ("gemm", "attention", "norm", "elementwise", "fp8 quant", "communication")


def kind_of(kernel: str) -> str:
    """A kernel's kind, by its name (cuBLAS / CUTLASS GEMMs, cuDNN / flash attention, inductor's fused kernels)."""
    name = kernel.lower()
    if "nccl" in name:
        return "communication"
    if any(k in name for k in ("fmha", "flash", "sdpa", "attention", "attn")):
        return "attention"
    if any(k in name for k in ("gemm", "nvjet", "cutlass", "xmma", "matmul", "scaled_mm", "splitk")):
        return "gemm"
    if any(k in name for k in ("float8", "fp8", "e4m3", "amax", "quant")):
        return "fp8 quant"
    if any(k in name for k in ("norm", "rsqrt", "var_mean")):
        return "norm"
    return "elementwise"


def build(model: str, layers: int | None, device: torch.device, fused_gelu: bool = True) -> torch.nn.Module:
    """Our transformer at real dimensions, random bf16 weights made on the GPU, compiled as the engine does (the MLP's
    bias + GELU in its GEMM's epilogue unless not `fused_gelu`)."""
    from vllm_omni.diffusion import diffusers_compat
    from vllm_omni.diffusion.worker.cuda_graphs import compile_repeated_blocks
    from vllm_omni.diffusion.worker.fused_gelu import fuse_gelu_epilogues

    if model == "qwen-image":
        from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel as cls

        config = dict(QWEN)
    else:
        from vllm_omni.diffusion.models.wan22.transformer import WanTransformer3DModel as cls

        config = dict(WAN)
    if layers:
        config["num_layers"] = layers
    torch.manual_seed(0)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # the weights are made in bf16, on the GPU: 20 GB-scale, seconds
    try:
        with device:
            net = cls(**config)
    finally:
        torch.set_default_dtype(default)
    keep = diffusers_compat.keep_in_fp32_modules(cls)
    for name, param in net.named_parameters():  # as from_pretrained(dtype=bfloat16) keeps them
        if keep & set(name.split(".")):
            param.data = param.data.float()
    net.eval().requires_grad_(False)
    if fused_gelu:
        print(f"{model}: bias+GELU fused into {fuse_gelu_epilogues(net)} MLP GEMMs", flush=True)
    compile_repeated_blocks(net)
    return net


def inputs(model: str, size: str, rows: int, device: torch.device) -> dict[str, Any]:
    gen = torch.Generator(device).manual_seed(1)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    if model == "qwen-image":
        side = int(size.split("x")[0]) // 16
        text = max(QWEN_TEXT)
        mask = torch.zeros(rows, text, dtype=torch.long, device=device)
        for row in range(rows):  # a prompt, then a shorter negative prompt (padded: per-row text)
            mask[row, : QWEN_TEXT[row % 2]] = 1
        return dict(
            hidden_states=randn(rows, side * side, 64),
            encoder_hidden_states=randn(rows, text, 3584),
            encoder_hidden_states_mask=mask if rows > 1 else None,
            timestep=torch.full((rows,), 0.5, device=device, dtype=torch.bfloat16),
            img_shapes=[[(1, side, side)]] * rows,
            return_dict=False,
        )
    width, height, frames = (int(part) for part in size.split("x"))
    text = randn(rows, WAN_TEXT, 4096)
    text[:, 30:] = 0
    return dict(
        hidden_states=randn(rows, 16, (frames - 1) // 4 + 1, height // 8, width // 8),
        timestep=torch.full((rows,), 500, device=device, dtype=torch.int64),
        encoder_hidden_states=text,
        return_dict=False,
    )


def flops(model: str, size: str, rows: int, layers: int) -> dict[str, float]:
    """GEMM and attention FLOPs of one forward (the blocks; embeddings and the final projection are small)."""
    if model == "qwen-image":
        side = int(size.split("x")[0]) // 16
        d, image = 3072, side * side
        text = [QWEN_TEXT[row % 2] for row in range(rows)]
        # Each stream: QKV + out (4 d^2) and a 4x MLP (8 d^2) a token.
        gemm = sum(2 * 12 * d * d * (image + t) for t in text)
        attention = sum(4 * (image + t) ** 2 * d for t in text)
    else:
        width, height, frames = (int(part) for part in size.split("x"))
        d, ffn = 5120, 13824
        tokens = ((frames - 1) // 4 + 1) * (height // 16) * (width // 16)
        # Self-attention QKV + out (4 d^2), cross-attention Q + out (2 d^2), the FFN (2 d ffn) a token; the
        # cross-attention's K and V over the 512 text tokens.
        gemm = rows * (2 * (6 * d * d + 2 * d * ffn) * tokens + 2 * 2 * 4096 * d * WAN_TEXT)
        attention = rows * (4 * tokens * tokens * d + 4 * tokens * WAN_TEXT * d)
    return {"gemm": gemm * layers, "attention": attention * layers}


def wall_ms(fn, iters: int) -> float:
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def profile_case(net: torch.nn.Module, model: str, size: str, rows: int, layers: int, iters: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    device = next(net.parameters()).device
    kwargs = inputs(model, size, rows, device)
    with torch.inference_mode():
        for _ in range(2):  # compile for this shape
            net(**kwargs)
        eager = wall_ms(lambda: net(**kwargs), iters)
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]):
            net(**kwargs)  # the profiler's first use in a process starts CUPTI: keep it out of the measured gap
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            torch.cuda.synchronize()
            start = time.perf_counter()
            net(**kwargs)
            torch.cuda.synchronize()
            profiled = (time.perf_counter() - start) * 1e3
    by_kind: dict[str, float] = defaultdict(float)
    kernels: Counter = Counter()
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            us = event.time_range.elapsed_us()
            by_kind[kind_of(event.name)] += us / 1e3
            kernels[event.name[:90]] += us / 1e3
    # The ops that launched them (eager aten ops, and inductor's kernels by name): which part of the model an
    # elementwise kernel belongs to; an op's own GPU time, not its children's.
    ops: Counter = Counter()
    for event in prof.key_averages():
        if event.self_device_time_total > 0 and event.device_type == torch.autograd.DeviceType.CPU:
            ops[event.key[:90]] += event.self_device_time_total / 1e3
    busy = sum(by_kind.values())
    work = flops(model, size, rows, layers)
    return {
        "model": model,
        "size": size,
        "rows": rows,
        "eager_ms": round(eager, 2),
        "profiled_ms": round(profiled, 2),
        "kernels_ms": {kind: round(by_kind.get(kind, 0.0), 2) for kind in KINDS},
        "gap_ms": round(max(0.0, profiled - busy), 2),
        "tflop": {kind: round(value / 1e12, 2) for kind, value in work.items()},
        "top_kernels": [(name, round(ms, 2)) for name, ms in kernels.most_common(16)],
        "top_ops": [(name, round(ms, 2)) for name, ms in ops.most_common(16)],
    }


def install_graphs(net: torch.nn.Module) -> list[str]:
    """The engine's CUDA graph replay on `net` (forward_chain's CUDAGraphForward); the capture failures it reports."""
    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphs
    from vllm_omni.diffusion.worker.forward_chain import install_denoiser_chain

    failures: list[str] = []
    graphs = dict(on_failure=failures.append, backend=CUDAGraphs())
    install_denoiser_chain(net, graphs, None, Counter(), "transformer")
    return failures


def graphed_ms(net: torch.nn.Module, model: str, size: str, rows: int, iters: int, failures: list[str]) -> float | None:
    kwargs = inputs(model, size, rows, next(net.parameters()).device)
    with torch.inference_mode():
        for _ in range(2):  # capture, then a replay
            net(**kwargs)
        return None if failures else round(wall_ms(lambda: net(**kwargs), iters), 2)


def card() -> tuple[str, str]:
    name = torch.cuda.get_device_name()
    short = next((key for key in PEAK_TFLOPS if key in name), "H100")
    return name, short


def docs_section(results: dict) -> str:
    rows = results.get("cases", [])
    device = results.get("device", "?")
    short = next((key for key in PEAK_TFLOPS if key in device), "H100")
    peak = PEAK_TFLOPS[short]["bf16"]
    lines = [
        "## Where a forward's time goes (one GPU, bf16)",
        "",
        f"`python3 benchmarks/profile_forward.py` on one {device}; {results.get('layers')} layers, random weights, "
        "compiled blocks. GELU: the MLP's bias + GELU in its GEMM's epilogue (fused, the engine's default on CUDA) "
        "or a pass after it (unfused: rows measured before the fusion). Eager: the compiled forward launched from "
        "Python; graph: its CUDA graph replay (what the engine runs). The kinds are the profiled forward's kernel "
        "time; gap: its wall time less its kernels (launches and host work). Roofline: the FLOPs at the card's "
        f"dense bf16 peak ({peak:.0f} TFLOP/s).",
        "",
        "| model | size | rows | GELU | eager ms | graph ms | GEMM ms | attention ms | norm ms | elementwise ms | "
        "gap ms | GEMM TFLOP | attention TFLOP | roofline ms | graph / roofline |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        k = row["kernels_ms"]
        total = sum(row["tflop"].values())
        roof = total / peak * 1e3
        graph = row.get("graph_ms")
        lines.append(
            f"| {row['model']} | {row['size']} | {row['rows']} | {'fused' if row.get('fused_gelu') else 'unfused'} | "
            f"{row['eager_ms']} | {graph or 'n/a'} | "
            f"{k['gemm']} | {k['attention']} | {k['norm']} | {k['elementwise'] + k['fp8 quant']:.2f} | "
            f"{row['gap_ms']} | {row['tflop']['gemm']} | {row['tflop']['attention']} | {roof:.0f} | "
            f"{graph / roof if graph else float('nan'):.2f} |"
        )
    lines += ["", "Achieved throughput by kind (kernel time against its FLOPs):", ""]
    lines += [
        "| model | size | rows | GEMM TFLOP/s | % of peak | attention TFLOP/s | % of peak |",
        "|---|---|---|---|---|---|---|",
    ]  # noqa: E501
    for row in rows:
        k, t = row["kernels_ms"], row["tflop"]
        gemm = t["gemm"] / k["gemm"] * 1e3 if k["gemm"] else 0.0
        attention = t["attention"] / k["attention"] * 1e3 if k["attention"] else 0.0
        lines.append(
            f"| {row['model']} | {row['size']} | {row['rows']} | {gemm:.0f} | {gemm / peak:.0%} | "
            f"{attention:.0f} | {attention / peak:.0%} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", choices=["run", "docs"], default="run")
    parser.add_argument("--layers", type=int, help="fewer layers (a smoke run); default: the real count")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--models", nargs="+", default=["qwen-image", "wan2.2"])
    parser.add_argument("--sizes", nargs="+", help="only these sizes (default: every case of the models)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2], help="only these row counts")
    parser.add_argument("--out", type=Path, help="also copy the JSON and the docs page into this folder")
    parser.add_argument(
        "--attention-backend", help="profile with this attention backend (a run of its own: profile_forward_NAME.json)"
    )
    parser.add_argument(
        "--unfused-gelu",
        action="store_true",
        help="the MLP's bias + GELU as inductor's pass after the GEMM, as before the epilogue fusion (a run of its "
        "own: profile_forward_unfused_gelu.json)",
    )
    args = parser.parse_args(argv)
    if args.phase == "docs":
        replace_section(DOCS, KEY, docs_section(json.loads(RESULTS.read_text())), KEY)
        return
    device = torch.device("cuda", 0)
    name, _ = card()
    results: dict[str, Any] = {"device": name, "torch": torch.__version__, "layers": args.layers or "all", "cases": []}
    if args.attention_backend:
        from vllm_omni.diffusion.attention.backends import configure_attention_backend

        configure_attention_backend(args.attention_backend, device=device)
        results["attention_backend"] = args.attention_backend
    for model in args.models:
        net = build(model, args.layers, device, fused_gelu=not args.unfused_gelu)
        layers = args.layers or (QWEN if model == "qwen-image" else WAN)["num_layers"]
        for case_model, size, rows in CASES:
            if case_model != model or (args.sizes and size not in args.sizes) or rows not in args.rows:
                continue
            row = dict(profile_case(net, model, size, rows, layers, args.iters), fused_gelu=not args.unfused_gelu)
            print(json.dumps(row), flush=True)
            results["cases"].append(row)
        failures = install_graphs(net)  # graphs last: the captures hold their memory from then on
        for row in results["cases"]:
            if row["model"] == model:
                row["graph_ms"] = graphed_ms(net, model, row["size"], row["rows"], args.iters, failures)
                print(f"{model} {row['size']} rows {row['rows']}: graph {row['graph_ms']} ms", flush=True)
        del net
        torch.cuda.empty_cache()
    variant = [args.attention_backend] if args.attention_backend else []
    variant += ["unfused_gelu"] if args.unfused_gelu else []
    if variant:  # another kernel's profile, or the unfused GELU's: beside the table, which stays as it was
        other = RESULTS.with_name("_".join([RESULTS.stem, *variant]) + ".json")
        other.write_text(json.dumps(results, indent=1) + "\n")
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            (args.out / other.name).write_text(other.read_text())
        return
    # A run of some cases replaces those rows of the table and keeps the others (measured on the same card; each row
    # says whether its GELU was fused: rows from before the fusion have no `fused_gelu`, and were not).
    before = json.loads(RESULTS.read_text()) if RESULTS.is_file() else {}
    if before.get("device") == name and before.get("layers") == results["layers"]:
        measured = {(row["model"], row["size"], row["rows"]) for row in results["cases"]}
        kept = [row for row in before["cases"] if (row["model"], row["size"], row["rows"]) not in measured]
        order = {case: i for i, case in enumerate(CASES)}
        results["cases"] = sorted(
            kept + results["cases"], key=lambda row: order.get((row["model"], row["size"], row["rows"]), len(order))
        )
    RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    replace_section(DOCS, KEY, docs_section(results), KEY)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULTS.name).write_text(RESULTS.read_text())
        (args.out / DOCS.name).write_text(DOCS.read_text())
    print(docs_section(results))


if __name__ == "__main__":
    main()
