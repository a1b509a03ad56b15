"""Per-rank cost of SP padding in Ulysses attention: mask vs trim vs none vs unpadded.

Times what one rank does between the two all-to-alls (joining the streams, the kernel, and
the layout copy that feeds the reverse all-to-all) at real model shapes, bf16, one GPU.
Modes are interleaved in a new random order each round, each timed as a CUDA-graph replay between CUDA events, median of
--iters runs after warm-up. A reference row `slice_pad` shows the naive trim (slice each
stream, dense kernel, F.pad the output back) that the library avoids.

    python benchmarks/attention_padding.py            # writes results/attention_padding.json + docs table
    python benchmarks/attention_padding.py --cases LTX-2   # those cases only; the file keeps the others' rows
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402
from vllm_omni.diffusion.attention.backends import resolve_attention_backend  # noqa: E402
from vllm_omni.diffusion.attention.layer import attend_joint  # noqa: E402
from vllm_omni.diffusion.distributed.sequence_parallel import IMAGE, TEXT, SequenceParallelContext  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Case:
    name: str
    image_len: int
    text_len: int
    heads: int
    degree: int
    text_position: str = "front"
    head_dim: int = 128


# Token counts from ../shared/CONTEXT.md; text lengths are typical prompts (Edit: ~1.4k vision-language tokens).
CASES = [
    Case("Qwen-Image 1328x1328 U8", 83 * 83, 30, 24, 8),
    Case("Qwen-Image 1328x1328 U4", 83 * 83, 30, 24, 4),
    Case("Qwen-Image 1776x1776 U4", 111 * 111, 30, 24, 4),
    Case("Qwen-Image-Edit 2048 out, 1024x704 in U8", 20596, 1403, 24, 8),
    Case("FLUX.2 1328x1328 U8", 83 * 83, 512, 48, 8),
    Case("FLUX.2 1776x1776 U4", 111 * 111, 512, 48, 4),
    Case("HunyuanVideo-1.5 848x480x121 U8", 53 * 30 * 31, 120, 16, 8, text_position="rear"),
    # LTX-2's self-attentions are over one stream each (text 0): 800x480x113's 15 x 15 x 25 video tokens (pad 7)
    # and 121 frames' 126 audio tokens at 64 per head (pad 2). Trim's kernels see 5625 and 126 keys, none's 5632
    # (44 x 128) and 128: whether a partial last tile costs more than the padded keys it saves.
    Case("LTX-2 video 800x480x113 U8", 15 * 15 * 25, 0, 32, 8),
    Case("LTX-2 audio 121 frames U8", 126, 0, 32, 8, head_dim=64),
]
MODES = ["none", "trim", "mask", "unpadded", "slice_pad"]


def _context(mode: str, case: Case, image_len: int, text_len: int) -> SequenceParallelContext:
    ctx = SequenceParallelContext(None, case.degree, 0, case.degree, 1, mode)
    if case.text_len:
        ctx.record_stream(TEXT, text_len)
    ctx.record_stream(IMAGE, image_len)
    return ctx


def _order(case: Case) -> list[str]:
    if not case.text_len:
        return [IMAGE]
    return [TEXT, IMAGE] if case.text_position == "front" else [IMAGE, TEXT]


def _slice_pad(recv: torch.Tensor, layout, backend) -> torch.Tensor:
    """Naive trim: join the true tokens, dense kernel, F.pad back to the padded layout, layout copy."""
    world, _, batch, _, heads, head_dim = recv.shape
    parts = []
    for slot in layout.slots:
        n = slot.shard.local_seq_len
        block = recv[:, :, :, slot.local_start : slot.local_start + n].permute(1, 2, 0, 3, 4, 5)
        parts.append(block.flatten(2, 3)[:, :, : slot.shard.original_seq_len])
    joint = torch.cat(parts, dim=2)
    out = backend(joint[0], joint[1], joint[2])
    padded, start = [], 0
    for slot in layout.slots:
        piece = out[:, start : start + slot.shard.original_seq_len]
        padded.append(F.pad(piece, (0, 0, 0, 0, 0, slot.shard.pad_size)))
        start += slot.shard.original_seq_len
    out = torch.cat(padded, dim=1)
    send = out.new_empty(world, batch, layout.local_len, heads, head_dim)
    offset = 0
    for slot in layout.slots:
        n = slot.shard.local_seq_len
        send[:, :, slot.local_start : slot.local_start + n].copy_(
            out[:, offset : offset + world * n].unflatten(1, (world, n)).permute(1, 0, 2, 3, 4)
        )
        offset += world * n
    return send


def _make_runner(mode: str, case: Case, device, dtype):
    image_len, text_len = case.image_len, case.text_len
    if mode == "unpadded":
        image_len, text_len = (x // case.degree * case.degree for x in (image_len, text_len))
    ctx = _context({"unpadded": "none", "slice_pad": "trim"}.get(mode, mode), case, image_len, text_len)
    layout = ctx.joint_layout(_order(case), device, dtype)
    backend = resolve_attention_backend(needs_mask=layout.key_mask is not None)
    heads = case.heads // case.degree
    recv = torch.randn(case.degree, 3, 1, layout.local_len, heads, case.head_dim, device=device, dtype=dtype)
    fn = _slice_pad if mode == "slice_pad" else attend_joint
    return lambda: fn(recv, layout, backend)


def _graph(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def bench_case(case: Case, iters: int, warmup: int, device, dtype) -> dict[tuple[str, str], float]:
    """Median ms per (timing, mode); timing is "graph" (GPU time alone) or "eager" (as a server runs it)."""
    runners = {mode: _make_runner(mode, case, device, dtype) for mode in MODES}
    graphs = {mode: _graph(fn) for mode, fn in runners.items()}
    calls = {("graph", mode): graph.replay for mode, graph in graphs.items()}
    calls.update({("eager", mode): fn for mode, fn in runners.items()})
    for _ in range(warmup):
        for call in calls.values():
            call()
    keys = list(calls)
    events = {key: [] for key in keys}
    order = random.Random(0)
    for _ in range(iters):
        order.shuffle(keys)  # a new order each round: no mode always follows the same one
        for key in keys:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            calls[key]()
            end.record()
            events[key].append((start, end))
    torch.cuda.synchronize()
    return {key: statistics.median(s.elapsed_time(e) for s, e in pairs) for key, pairs in events.items()}


def write_docs(rows: list[dict], path: Path) -> None:
    device = rows[0]["device"]
    by_case: dict[str, dict[str, float]] = {}
    for row in rows:
        by_case.setdefault(row["case"], {})[(row["timing"], row["mode"])] = row["ms"]
    lines = [
        "## SP padding in attention (per rank)",
        "",
        f"One rank's work between the two all-to-alls (join, kernel, layout copy), bf16, {device}.",
        "Milliseconds are CUDA-graph replays (GPU time alone), median of the run; the last column is the",
        "trim/none ratio timed eagerly (launches included, as a server runs it). `unpadded` rounds both",
        "streams down to a multiple of the degree; `slice_pad` is the naive trim (slice, dense, `F.pad`",
        "back) that the library does not use.",
        "",
        "| case | tokens (image + text) | none | trim | mask | unpadded | slice_pad | trim/none | mask/none "
        "| slice_pad/none | trim/none eager |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for case in (case for case in CASES if case.name in by_case):
        t = {mode: by_case[case.name][("graph", mode)] for mode in MODES}
        eager = {mode: by_case[case.name][("eager", mode)] for mode in MODES}
        lines.append(
            f"| {case.name} | {case.image_len} + {case.text_len} | {t['none']:.3f} | {t['trim']:.3f} | "
            f"{t['mask']:.3f} | {t['unpadded']:.3f} | {t['slice_pad']:.3f} | {t['trim'] / t['none']:.3f} | "
            f"{t['mask'] / t['none']:.3f} | {t['slice_pad'] / t['none']:.3f} | {eager['trim'] / eager['none']:.3f} |"
        )
    replace_section(path, "attention_padding", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/attention_padding.json")
    parser.add_argument("--cases", nargs="+", default=None, help="run the cases whose name has one of these strings")
    add_docs_phase(parser)
    args = parser.parse_args()
    if args.phase == "docs":
        write_docs(load_json(args.out), args.docs)
        return
    if not torch.cuda.is_available():
        sys.exit("attention_padding.py needs a CUDA GPU")
    device, dtype = torch.device("cuda"), torch.bfloat16
    name = torch.cuda.get_device_name()
    # Rows of the cases not run are kept (one file for every case).
    cases = [case for case in CASES if args.cases is None or any(text in case.name for text in args.cases)]
    rows = [row for row in load_json(args.out, []) if row["case"] not in {case.name for case in cases}]
    for case in cases:
        times = bench_case(case, args.iters, args.warmup, device, dtype)
        pad = math.ceil(case.image_len / case.degree) * case.degree - case.image_len
        for timing in ("graph", "eager"):
            t = {mode: times[(timing, mode)] for mode in MODES}
            print(
                f"{case.name:42s} {timing} pad={pad} "
                + " ".join(f"{m}={v:.4f}" for m, v in t.items())
                + f" trim/none={t['trim'] / t['none']:.4f} mask/none={t['mask'] / t['none']:.3f}",
                flush=True,
            )
        rows += [
            {"case": case.name, "mode": mode, "timing": timing, "ms": round(ms, 5), "device": name}
            for (timing, mode), ms in times.items()
        ]
    save_json(args.out, rows)
    write_docs(rows, args.docs)


if __name__ == "__main__":
    main()
