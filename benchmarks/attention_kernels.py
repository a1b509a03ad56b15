"""The exact attention kernels at our shapes, one GPU (issue 46: pick the kernel per shape from what runs on Hopper).

Kernels, all bf16 in, fp32 softmax and accumulation, bf16 out:

    cudnn      torch SDPA forced to cuDNN's flash kernel (what the `sdpa` backend runs on an H100 today)
    flash2     torch SDPA forced to its own FlashAttention-2 kernel
    sdpa       torch SDPA as it chooses (the `sdpa` backend)
    fa4        the `flash_attn_4` backend: FlashAttention 4's CuTe kernel for the card (needs flash-attn-4)

For each case (Ulysses U1, and one U8 rank: the heads divided by 8): the median milliseconds of --iters calls
between CUDA events after --warmup, and of a call replayed from a CUDA graph of ten (as the engine runs
attention: no launch overhead, which a short call launched from Python can be bound by); the TFLOP/s of the
launched call (4 x L^2 x head dim a head); the ratios to cuDNN's times; the relative L2 error against an fp32
reference on four of the heads (the tolerance: a kernel is exact where its error is within 1.25x cuDNN's); and
the largest difference from cuDNN's output. For fa4 also: the first call's time (its JIT compile), a CUDA
graph's replay against the eager call (bit for bit), and its log-sum-exp against `attention_with_lse` (what
ring attention merges).

    python3 benchmarks/attention_kernels.py                 # on the GPU machine (about 2 minutes)
    python3 benchmarks/attention_kernels.py --phase docs    # the docs section from the JSON, no GPU
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.attention_fp8 import Case, _median_ms, _qkv, _reference_heads, _relative_l2  # noqa: E402
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402
from vllm_omni.diffusion.attention.backends import BACKENDS, _installed, attention_with_lse  # noqa: E402
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphs  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
KEY = "attention_kernels"
RESULTS = ROOT / f"benchmarks/results/{KEY}.json"
DOCS = ROOT / "docs/performance.md"
TOLERANCE = 1.25  # exact: a relative L2 error within this factor of cuDNN's

# Joint tokens of one forward (image or video tokens + text where the text is in the joint attention).
MODELS = [
    ("Qwen-Image 1024x1024", 4096 + 30, 24),
    ("Qwen-Image 1328x1328", 6889 + 30, 24),
    ("Wan2.2 A14B 832x480x81", 32760, 40),
    ("HunyuanVideo 1.5 848x480x121", 49290 + 360, 16),
    ("Wan2.2 A14B 1280x720x81", 75600, 40),
]
CASES = [Case(f"{name} U{degree}", tokens, heads // degree) for name, tokens, heads in MODELS for degree in (1, 8)]


def _sdpa(backend: SDPBackend | None):
    def call(q, k, v):
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        if backend is None:
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)
        with sdpa_kernel(backend):
            return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)

    return call


def kernels(with_fa4: bool) -> dict:
    found = {
        "cudnn": _sdpa(SDPBackend.CUDNN_ATTENTION),
        "flash2": _sdpa(SDPBackend.FLASH_ATTENTION),
        "sdpa": _sdpa(None),
    }
    if with_fa4:
        found["fa4"] = BACKENDS["flash_attn_4"]
    return found


def graph_ms(fn, q, k, v, calls: int = 10, iters: int = 5) -> float:
    """Milliseconds a call replayed from a CUDA graph of `calls` calls (what the engine runs: no launch overhead)."""
    graph, _ = CUDAGraphs().capture(lambda q, k, v: [fn(q, k, v) for _ in range(calls)], dict(q=q, k=k, v=v), 1, None)
    return _median_ms(graph.replay, iters, 1) / calls


def graph_replay_equal(fn, q, k, v) -> bool:
    """Whether a CUDA graph of `fn`, captured as the engine captures a forward, replays the eager call's output."""
    eager = fn(q, k, v)
    graph, captured = CUDAGraphs().capture(fn, dict(q=q, k=k, v=v), 1, None)
    graph.replay()
    torch.cuda.synchronize()
    return torch.equal(captured, eager)


def bench_case(case: Case, found: dict, iters: int, warmup: int) -> dict:
    q, k, v = _qkv(case)
    heads, ref = _reference_heads(q, k, v)
    flop = 4 * case.tokens * case.tokens * case.head_dim * case.heads
    row: dict = {"case": case.name, "tokens": case.tokens, "heads": case.heads, "head_dim": case.head_dim}
    cudnn_out = None
    for name, fn in found.items():
        try:
            if name == "fa4":
                torch.cuda.synchronize()
                start = time.perf_counter()
                fn(q, k, v)
                torch.cuda.synchronize()
                row["fa4_first_call_s"] = round(time.perf_counter() - start, 2)
            out = fn(q, k, v)
            ms = _median_ms(lambda fn=fn: fn(q, k, v), iters, warmup)
        except Exception as exc:  # a kernel that does not run here: its row says why
            row[f"error_{name}"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
            print(f"{case.name}: {name} failed: {row[f'error_{name}']}", flush=True)
            continue
        row[f"ms_{name}"] = round(ms, 4)
        row[f"graph_ms_{name}"] = round(graph_ms(fn, q, k, v), 4)
        row[f"tflops_{name}"] = round(flop / ms / 1e9, 1)
        row[f"rel_l2_{name}"] = round(_relative_l2(out[:, :, heads], ref), 5)
        if name == "cudnn":
            cudnn_out = out
        elif cudnn_out is not None:
            row[f"max_diff_{name}"] = (out.float() - cudnn_out.float()).abs().max().item()
        if name == "fa4":
            row["fa4_graph_equal"] = graph_replay_equal(fn, q, k, v)
            out_lse, lse = fn.with_lse(q, k, v)
            ref_out, ref_lse = attention_with_lse(q, k, v)
            row["fa4_lse_max_diff"] = (lse.float() - ref_lse.float()).abs().max().item()
            row["fa4_with_lse_equal"] = torch.equal(out_lse, out)
    base, graph_base = row.get("ms_cudnn"), row.get("graph_ms_cudnn")
    for name in found:
        if base and f"ms_{name}" in row:
            row[f"ratio_{name}"] = round(row[f"ms_{name}"] / base, 3)
            row[f"graph_ratio_{name}"] = round(row[f"graph_ms_{name}"] / graph_base, 3)
    base_error = row.get("rel_l2_cudnn")
    exact = [n for n in found if f"ms_{n}" in row and base_error and row[f"rel_l2_{n}"] <= TOLERANCE * base_error]
    row["fastest_exact"] = min(exact, key=lambda n: row[f"graph_ms_{n}"]) if exact else None
    return row


def _cell(row: dict, name: str) -> str:
    if f"ms_{name}" not in row:
        return "failed" if f"error_{name}" in row else "n/a"
    cell = f"{row[f'ms_{name}']:.3f} ({row.get(f'ratio_{name}', float('nan')):.3f}x)"
    if f"graph_ms_{name}" in row:
        cell += f" / {row[f'graph_ms_{name}']:.3f} ({row.get(f'graph_ratio_{name}', float('nan')):.3f}x)"
    return cell + f", {row[f'tflops_{name}']:.0f}, {row[f'rel_l2_{name}']:.4f}"


def docs_section(rows: list[dict]) -> str:
    device = rows[0]["device"] if rows else "?"
    names = [n for n in ("cudnn", "flash2", "sdpa", "fa4") if any(f"ms_{n}" in r or f"error_{n}" in r for r in rows)]
    lines = [
        "## The exact attention kernels per shape (one GPU)",
        "",
        f"`python3 benchmarks/attention_kernels.py` on one {device}: bf16 q, k, v of one forward's joint attention "
        "(Gaussian), head dim 128; U8 is one Ulysses-8 rank's heads. Each cell: milliseconds a call launched from "
        "Python (median) and its ratio to cuDNN's, then the same replayed from a CUDA graph (as the engine runs "
        "it: no launch overhead), the TFLOP/s of the launched call, and the relative L2 error against fp32 on four "
        "heads. cudnn and flash2: torch SDPA forced to that kernel; sdpa: as torch chooses; fa4: the `flash_attn_4` "
        f"backend (FlashAttention 4's CuTe kernels). Exact: an error within {TOLERANCE}x cuDNN's; the fastest "
        "exact kernel is chosen by the graph replay's time where there is one.",
        "",
        "| case | tokens | heads | "
        + " | ".join(f"{n}: ms (ratio) / graph ms (ratio), TFLOP/s, error" for n in names)
        + " | fastest exact |",
        "|---|---|---|" + "---|" * len(names) + "---|",
    ]
    for row in rows:
        head = f"| {row['case']} | {row['tokens']} | {row['heads']} | "
        lines.append(head + " | ".join(_cell(row, n) for n in names) + f" | {row['fastest_exact']} |")
    fa4 = [r for r in rows if "fa4_graph_equal" in r]
    if fa4:
        lines += [
            "",
            f"fa4's first call (its JIT compile, once a process per kernel configuration): "
            f"{max(r['fa4_first_call_s'] for r in fa4):.1f} s at most; its CUDA graph replay equals the eager call "
            f"bit for bit in {sum(r['fa4_graph_equal'] for r in fa4)} of {len(fa4)} cases; its log-sum-exp is within "
            f"{max(r['fa4_lse_max_diff'] for r in fa4):.2g} of `attention_with_lse`'s.",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--cases", default="", help="comma-separated substrings of case names (default: all)")
    parser.add_argument("--out", type=Path, help="also copy the JSON and the docs page into this folder")
    add_docs_phase(parser, DOCS)
    args = parser.parse_args()
    if args.phase == "docs":
        replace_section(args.docs, KEY, docs_section(load_json(RESULTS, [])))
        return
    if not torch.cuda.is_available():
        sys.exit("attention_kernels.py needs a CUDA GPU")
    with_fa4 = _installed("flash_attn.cute") and torch.cuda.get_device_capability() >= (9, 0)
    if not with_fa4:
        print("flash-attn-4 is not installed (or the card is older than Hopper): no fa4 column", flush=True)
    found = kernels(with_fa4)
    wanted = [w for w in args.cases.split(",") if w]
    device = torch.cuda.get_device_name()
    rows = []
    with torch.inference_mode():
        for case in [c for c in CASES if not wanted or any(w in c.name for w in wanted)]:
            row = dict(bench_case(case, found, args.iters, args.warmup), device=device)
            fa4 = (
                f" [fa4 graph {row['fa4_graph_equal']}, lse {row['fa4_lse_max_diff']:.2g}]"
                if "fa4_graph_equal" in row
                else ""
            )
            print(
                f"{case.name:34s} "
                + " ".join(
                    f"{n} {row[f'ms_{n}']:.3f} ms ({row.get(f'ratio_{n}', 0):.3f}x; "
                    f"graph {row[f'graph_ms_{n}']:.3f} ms, "
                    f"{row.get(f'graph_ratio_{n}', 0):.3f}x; {row[f'rel_l2_{n}']:.4f})"
                    for n in found
                    if f"ms_{n}" in row
                )
                + f" -> {row['fastest_exact']}"
                + fa4,
                flush=True,
            )
            rows.append(row)
            torch.cuda.empty_cache()
    save_json(RESULTS, rows)
    replace_section(args.docs, KEY, docs_section(rows))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / RESULTS.name).write_text(RESULTS.read_text())
        (args.out / args.docs.name).write_text(args.docs.read_text())


if __name__ == "__main__":
    main()
