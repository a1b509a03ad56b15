"""cuDNN's FP8 attention (the `cudnn_fp8` backend) against bf16 SDPA (the `sdpa` backend) at our shapes, one GPU.

For each case (U1, and one Ulysses-8 rank: the heads divided by 8): milliseconds of bf16 SDPA, of the FP8
backend's whole call (scales, quantization, kernel, dequantization) and of its kernel alone, between CUDA
events, median of --iters after --warmup; and the relative L2 error of each against an fp32 reference (SDPA in
float32, a few heads at a time), on Gaussian q, k, v. A second table sweeps the probabilities' scale `s_scale`
(cudnn_fp8.S_SCALE is the default) on the U8 cases. Hopper's FP8 SDPA takes one scale per tensor (per-head
or per-block scales are Blackwell's MXFP8), so there is no per-head variant to compare.

    python benchmarks/attention_fp8.py            # writes results/attention_fp8.json + docs table
"""

from __future__ import annotations

import argparse
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402
from vllm_omni.diffusion.attention import cudnn_fp8  # noqa: E402
from vllm_omni.diffusion.attention.backends import BACKENDS  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    name: str
    tokens: int
    heads: int
    head_dim: int = 128


# Joint tokens of one forward: Qwen-Image 1328x1328 (83x83 image + ~30 text), HunyuanVideo 1.5 848x480x121
# (31x30x53 video + 360 text), Wan2.2 A14B 1280x720x81 (21x45x80 video; its text is cross-attention).
MODELS = [
    ("Qwen-Image 1328x1328", 6889 + 30, 24),
    ("HunyuanVideo 1.5 848x480x121", 49290 + 360, 16),
    ("Wan2.2 A14B 1280x720x81", 75600, 40),
]
CASES = [Case(f"{name} U{degree}", tokens, heads // degree) for name, tokens, heads in MODELS for degree in (1, 8)]


def _qkv(case: Case, seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator("cuda").manual_seed(seed)
    shape = (1, case.tokens, case.heads, case.head_dim)
    return [torch.randn(shape, generator=gen, device="cuda", dtype=torch.bfloat16) for _ in range(3)]


def _reference(q, k, v, heads_per_call: int = 4) -> torch.Tensor:
    """fp32 SDPA, a few heads at a time (fp32 copies of every head at once would not fit at U1)."""
    out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
    for start in range(0, q.shape[2], heads_per_call):
        part = [t[:, :, start : start + heads_per_call].float().transpose(1, 2) for t in (q, k, v)]
        out[:, :, start : start + heads_per_call] = F.scaled_dot_product_attention(*part).transpose(1, 2)
    return out


def _relative_l2(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def _median_ms(fn, iters: int, warmup: int) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        times.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in times)


def bench_case(case: Case, iters: int, warmup: int, s_scales: list[float]) -> dict:
    q, k, v = _qkv(case)
    sdpa, fp8 = BACKENDS["sdpa"], BACKENDS["cudnn_fp8"]
    ref = _reference(q, k, v)
    row = {"case": case.name, "tokens": case.tokens, "heads": case.heads, "head_dim": case.head_dim}
    row["error_bf16"] = _relative_l2(sdpa(q, k, v), ref)
    row["error_fp8"] = _relative_l2(fp8(q, k, v), ref)
    if "U8" in case.name:
        row["error_fp8_by_s_scale"] = {
            str(s): _relative_l2(cudnn_fp8.attention(q, k, v, s_scale=s), ref) for s in s_scales
        }
    del ref
    inputs = cudnn_fp8.quantize_inputs(q, k, v)
    out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    constants = cudnn_fp8._constants(q.device, cudnn_fp8.S_SCALE)
    row["ms_bf16"] = _median_ms(lambda: sdpa(q, k, v), iters, warmup)
    row["ms_fp8"] = _median_ms(lambda: fp8(q, k, v), iters, warmup)
    row["ms_fp8_kernel"] = _median_ms(lambda: cudnn_fp8._run_row(inputs, 0, out, constants), iters, warmup)
    flops = 4 * case.tokens**2 * case.heads * case.head_dim
    row["tflops_bf16"] = flops / row["ms_bf16"] / 1e9
    row["tflops_fp8_kernel"] = flops / row["ms_fp8_kernel"] / 1e9
    return row


def write_docs(rows: list[dict], device: str, path: Path) -> None:
    lines = [
        "## FP8 attention (cuDNN) against bf16 SDPA",
        "",
        f"One attention call, {device}, Gaussian bf16 q, k, v, head_dim 128 (benchmarks/attention_fp8.py). `fp8` is",
        "the `cudnn_fp8` backend's whole call (scales, quantization, kernel, output back to bf16), `kernel` cuDNN's",
        "FP8 SDPA alone; milliseconds between CUDA events, median of the run. Errors are relative L2 against SDPA",
        "in float32.",
        "",
        "| case | tokens | heads | bf16 ms | fp8 ms | fp8 / bf16 | kernel ms | kernel / bf16 | kernel TFLOP/s "
        "| error bf16 | error fp8 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['case']} | {r['tokens']} | {r['heads']} | {r['ms_bf16']:.3f} | {r['ms_fp8']:.3f} | "
            f"{r['ms_fp8'] / r['ms_bf16']:.3f} | {r['ms_fp8_kernel']:.3f} | {r['ms_fp8_kernel'] / r['ms_bf16']:.3f} | "
            f"{r['tflops_fp8_kernel']:.0f} | {r['error_bf16']:.4f} | {r['error_fp8']:.4f} |"
        )
    swept = [r for r in rows if "error_fp8_by_s_scale" in r]
    if swept:
        scales = list(swept[0]["error_fp8_by_s_scale"])
        lines += [
            "",
            f"Relative L2 of the FP8 backend by the probabilities' scale `s_scale` (default {cudnn_fp8.S_SCALE:g}):",
            "",
            "| case | " + " | ".join(f"s_scale {float(s):g}" for s in scales) + " |",
            "|---|" + "---|" * len(scales),
        ]
        for r in swept:
            errors = r["error_fp8_by_s_scale"]
            lines.append(f"| {r['case']} | " + " | ".join(f"{errors[s]:.4f}" for s in scales) + " |")
    replace_section(path, "attention_fp8", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--s-scales", default="448,1792,7168", help="the probabilities' scales to sweep (U8 cases)")
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/attention_fp8.json")
    add_docs_phase(parser)
    args = parser.parse_args()
    if args.phase == "docs":
        rows = load_json(args.out)
        write_docs(rows, rows[0]["device"], args.docs)
        return
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() < (9, 0):
        sys.exit("attention_fp8.py needs a CUDA GPU of compute capability 9.0 (Hopper) or newer")
    wanted = [w for w in args.cases.split(",") if w]
    cases = [c for c in CASES if not wanted or any(w in c.name for w in wanted)]
    s_scales = [float(s) for s in args.s_scales.split(",")]
    device = torch.cuda.get_device_name()
    rows = []
    for case in cases:
        row = bench_case(case, args.iters, args.warmup, s_scales)
        print(
            f"{case.name:36s} bf16={row['ms_bf16']:.3f} fp8={row['ms_fp8']:.3f} kernel={row['ms_fp8_kernel']:.3f} ms "
            f"fp8/bf16={row['ms_fp8'] / row['ms_bf16']:.3f} err bf16={row['error_bf16']:.4f} "
            f"fp8={row['error_fp8']:.4f} {row.get('error_fp8_by_s_scale', '')}",
            flush=True,
        )
        rows.append(dict(row, device=device))
        torch.cuda.empty_cache()
    save_json(args.out, rows)
    write_docs(rows, device, args.docs)


if __name__ == "__main__":
    main()
