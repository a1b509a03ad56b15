"""Per-rank cost of SP padding under ring attention (USP): trimmed blocks vs an unpadded size vs masked blocks.

One rank of a ring is simulated on one GPU, as the Ulysses benchmarks simulate a Ulysses rank
(comm.SimulatedGroup): the rank runs `attend_ring` (its joint buffer, then one dense kernel per ring
block with the log-sum-exp, merged in fp32) at the real shapes, bf16, and each ring step's send/recv is a
device copy of the block (the bytes a real step moves, at device speed rather than a link's). The rank is
the last of the ring, whose own block holds the padding; every rank runs every block once, so all do the
same work. Variants:

- ``trim``: at the padded size, each block's kernel on its valid rows (the default mode);
- ``unpadded``: the nearest smaller token counts the SP degree divides (no block holds padding): the
  target is trim / unpadded <= 1.01;
- ``mask``: at the padded size, the block that holds padding through the masked kernel (mask_sp_padding);
- ``none``: at the padded size, the padding unmasked (trim_sp_padding=False);
- ``trim_compute``: trim without the ring's copies: the kernels and the merge alone, from which a block's
  compute time and the link speed that would hide a step's send/recv behind it are worked out, on paper,
  for NVLink (900 GB/s, 450 GB/s each way) and a 400 Gb/s network (50 GB/s).

Each variant is timed as a CUDA-graph replay between CUDA events, in a new random order each round, median
of --iters runs after warm-up.

    python benchmarks/ring_attention.py        # one GPU: results/ring_attention.json + docs/benchmarks.md
    python benchmarks/ring_attention.py --phase docs   # the docs section from the JSON alone

On a machine without CUDA it says so and exits cleanly (exit code 0), writing nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402
from vllm_omni.diffusion.attention import layer  # noqa: E402
from vllm_omni.diffusion.attention.backends import resolve_attention_backend  # noqa: E402
from vllm_omni.diffusion.distributed.comm import RingPass, SimulatedGroup  # noqa: E402
from vllm_omni.diffusion.distributed.sequence_parallel import IMAGE, TEXT, SequenceParallelContext  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NVLINK_GBS, NETWORK_GBS = 450.0, 50.0  # one direction: NVLink 4 (900 GB/s both ways), 400 Gb/s


@dataclass(frozen=True)
class Case:
    name: str
    image_len: int
    text_len: int
    heads: int
    ulysses: int
    ring: int
    text_position: str = "front"
    head_dim: int = 128

    @property
    def degree(self) -> int:
        return self.ulysses * self.ring


QWEN, HUNYUAN = 83 * 83, 53 * 30 * 31  # Qwen-Image 1328x1328; HunyuanVideo 1.5 848x480x121 (../shared/CONTEXT.md)
CASES = [
    Case("Qwen-Image 1328x1328 R2", QWEN, 30, 24, 1, 2),
    Case("Qwen-Image 1328x1328 R4", QWEN, 30, 24, 1, 4),
    Case("Qwen-Image 1328x1328 U2xR4", QWEN, 30, 24, 2, 4),
    Case("HunyuanVideo-1.5 848x480x121 R2", HUNYUAN, 120, 16, 1, 2, "rear"),
    Case("HunyuanVideo-1.5 848x480x121 R4", HUNYUAN, 120, 16, 1, 4, "rear"),
    Case("HunyuanVideo-1.5 848x480x121 U2xR4", HUNYUAN, 120, 16, 2, 4, "rear"),
]
MODES = ["trim", "unpadded", "mask", "none", "trim_compute"]


def _no_pass(send, recv, group, rank) -> RingPass:
    return RingPass([])


def _make_runner(mode: str, case: Case, device, dtype):
    image_len, text_len = case.image_len, case.text_len
    if mode == "unpadded":
        image_len, text_len = (x // case.degree * case.degree for x in (image_len, text_len))
    padding = {"unpadded": "trim", "trim_compute": "trim"}.get(mode, mode)
    rank = case.degree - 1  # the last ring rank (Ulysses rank 0 of its group): its block holds the padding
    ring_group = SimulatedGroup(case.ring)
    ctx = SequenceParallelContext(
        SimulatedGroup(case.degree), case.degree, rank - case.ulysses + 1, case.ulysses, case.ring, padding,
        SimulatedGroup(case.ulysses) if case.ulysses > 1 else None, ring_group,
    )  # fmt: skip
    ctx.record_stream(TEXT, text_len)
    ctx.record_stream(IMAGE, image_len)
    order = [TEXT, IMAGE] if case.text_position == "front" else [IMAGE, TEXT]
    ring = ctx.ring_layout(order, device, dtype)
    backend = resolve_attention_backend(needs_mask=ring.needs_mask)
    heads = case.heads // case.ulysses
    recv = torch.randn(case.ulysses, 3, 1, ring.own.local_len, heads, case.head_dim, device=device, dtype=dtype)

    def run():
        if mode != "trim_compute":
            return layer.attend_ring(recv, ring, backend, ring_group)
        original, layer.ring_pass = layer.ring_pass, _no_pass
        try:
            return layer.attend_ring(recv, ring, backend, ring_group)
        finally:
            layer.ring_pass = original

    step_bytes = 2 * ring.buffer_len * heads * case.head_dim * dtype.itemsize  # K and V of one block, batch 1
    return run, step_bytes


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


def bench_case(case: Case, iters: int, warmup: int, device, dtype) -> tuple[dict[str, float], int]:
    """Median ms per mode (CUDA-graph replays), and the bytes of one ring step."""
    made = {mode: _make_runner(mode, case, device, dtype) for mode in MODES}
    graphs = {mode: _graph(fn) for mode, (fn, _) in made.items()}
    for _ in range(warmup):
        for graph in graphs.values():
            graph.replay()
    keys, events = list(graphs), {mode: [] for mode in graphs}
    order = random.Random(0)
    for _ in range(iters):
        order.shuffle(keys)
        for key in keys:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            graphs[key].replay()
            end.record()
            events[key].append((start, end))
    torch.cuda.synchronize()
    times = {key: statistics.median(s.elapsed_time(e) for s, e in pairs) for key, pairs in events.items()}
    return times, made["trim"][1]


def write_docs(rows: list[dict], path: Path) -> None:
    device = rows[0]["device"]
    lines = [
        "## Ring attention (USP) with SP padding, per rank",
        "",
        "One simulated ring rank's work between the Ulysses all-to-alls (`attend_ring`: the joint buffer, one",
        "dense kernel per ring block with its log-sum-exp, the fp32 merge; each ring step's send/recv a device",
        f"copy), bf16, batch 1, CUDA-graph replays, median; {device}. `trim` runs each block on its valid rows",
        "(the default), `unpadded` is the nearest smaller size the SP degree divides (no padding anywhere),",
        "`mask` the masked kernel on the block that holds padding, `none` the padding unmasked. `block ms` is",
        "one ring step's compute (`trim` without the copies, over the ring degree); `MB/step` the K/V block",
        "a step sends; the last two columns are the link speed that hides a step's send/recv behind its",
        "block, against NVLink (450 GB/s each way) and a 400 Gb/s network (50 GB/s).",
        "",
        "| case | tokens (image + text) | padding | trim | unpadded | mask | none | trim/unpadded | mask/trim "
        "| block ms | MB/step | GB/s to hide | NVLink / 400G |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    degrees = {case.name: case.degree for case in CASES}
    for row in rows:
        t = row["ms"]
        need = row["step_bytes"] / 1e9 / (row["block_ms"] / 1e3)
        degree = degrees[row["case"]]
        pads = " + ".join(str(-int(n) % degree) for n in row["tokens"].split(" + "))
        lines.append(
            f"| {row['case']} | {row['tokens']} | {pads} | {t['trim']:.3f} | {t['unpadded']:.3f} | {t['mask']:.3f} | "
            f"{t['none']:.3f} | {t['trim'] / t['unpadded']:.4f} | {t['mask'] / t['trim']:.3f} | "
            f"{row['block_ms']:.3f} | {row['step_bytes'] / 1e6:.1f} | {need:.0f} | "
            f"{'yes' if need <= NVLINK_GBS else 'no'} / {'yes' if need <= NETWORK_GBS else 'no'} |"
        )
    lines += [
        "",
        "`padding`: the pad tokens of each stream at that SP degree (none: `mask` runs no masked kernel, as in",
        "HunyuanVideo 1.5 at R2). `unpadded` is a slightly smaller problem (up to 7 fewer keys and 4 fewer query",
        "rows a rank at degree 8); `none` runs the padded blocks whole, at the same size as trim. Differences of",
        "about 1% between variants that do the same work are within this run's noise (20 rounds).",
        "",
        "Needs more than one GPU, not run here (no machine of several GPUs was lent): the real ring (NCCL",
        "send/recv between GPUs, the overlap measured rather than worked out on paper), the Ulysses all-to-alls",
        "across GPUs, and a ring inside a captured CUDA graph.",
    ]
    replace_section(path, "ring_attention", "\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/ring_attention.json")
    add_docs_phase(parser)
    args = parser.parse_args()
    if args.phase == "docs":
        write_docs(load_json(args.out), args.docs)
        return
    if not torch.cuda.is_available():
        print("ring_attention.py needs a CUDA GPU: nothing measured")
        return
    device, dtype = torch.device("cuda"), torch.bfloat16
    name = torch.cuda.get_device_name()
    rows = []
    for case in CASES:
        times, step_bytes = bench_case(case, args.iters, args.warmup, device, dtype)
        row = {
            "case": case.name,
            "tokens": f"{case.image_len} + {case.text_len}",
            "ms": {mode: round(ms, 5) for mode, ms in times.items()},
            "block_ms": round(times["trim_compute"] / case.ring, 5),
            "step_bytes": step_bytes,
            "device": name,
        }
        rows.append(row)
        save_json(args.out, rows)  # after each case: a run cut short keeps what it measured
        print(
            f"{case.name:38s} "
            + " ".join(f"{m}={v:.4f}" for m, v in times.items())
            + f" trim/unpadded={times['trim'] / times['unpadded']:.4f} mask/trim={times['mask'] / times['trim']:.3f}",
            flush=True,
        )
    save_json(args.out, rows)
    write_docs(rows, args.docs)


if __name__ == "__main__":
    main()
