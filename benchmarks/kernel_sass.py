"""The Triton attention kernels' machine code for Hopper, read without a GPU: what one key tile costs a thread.

Where device time is scarce, the instruction mix of the kernel's main loop is the proxy to iterate on between
device calls: these kernels issue more instructions per key tile than the tensor cores need time for (see
docs/performance.md), so every instruction the loop loses is time. For each P.V format of
`vllm_omni/diffusion/attention/triton_int8.py` at its default tile configuration, `_attn_kernel` is compiled for
sm_90 by this machine's Triton (its bundled ptxas), specialised as the launcher specialises it at the video
shapes (16-byte-aligned pointers; strides and padded lengths divisible by 16), and disassembled with the
bundled nvdisasm. The main loop is the largest body that a backward branch closes. Reported per format:
registers, spilled stack bytes, shared memory, and the loop's instructions per thread by kind, with the
multi-function-unit exponentials (a quarter of the FMA rate) and the tensor-core instructions apart.

    python benchmarks/kernel_sass.py                 # all formats; results JSON and docs/performance.md
    python benchmarks/kernel_sass.py --phase docs    # the docs section from the JSON

The machine code depends on the Triton version (the row records it): the device may run another, so compare
rows of one version, and confirm a change on the device (`benchmarks/attention_fp8.py --kernels triton`).
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results" / "kernel_sass.json"
DOCS = ROOT / "docs" / "performance.md"
TARGET = ("cuda", 90, 32)  # Hopper, 32 threads a warp
V_TYPE = {"16bit": "*bf16", "fp8": "*fp8e4nv", "int8": "*i8"}
# Always multiples of 16 at the launch (the launcher specialises them): strides over whole heads and tokens of
# a 128-wide head, and the lengths padded to the quantisation blocks.
DIVISIBLE = ("stride_vb", "stride_vl", "stride_vh", "stride_ob", "stride_ol", "stride_oh", "Lq_pad", "Lk_pad")
INTS = ("stride_vb", "stride_vl", "stride_vh", "stride_ob", "stride_ol", "stride_oh", "H", "Lq", "Lk", "Lq_pad",
        "Lk_pad")  # fmt: skip
KINDS = (  # (kind, opcode prefixes), first match wins
    ("tensor core", ("HGMMA", "IGMMA", "QGMMA", "WARPGROUP")),
    ("exp2 (MUFU)", ("MUFU",)),
    ("float", ("FADD", "FFMA", "FMUL", "FMNMX", "FSEL", "FSETP", "FCHK")),
    ("convert, pack", ("F2FP", "PRMT", "I2F", "F2I", "I2I", "F2F")),
    ("move", ("MOV", "IMAD.MOV", "UMOV")),
    ("spill", ("STL", "LDL")),
    ("memory", ("LDG", "LDS", "STS", "STG", "LDSM")),
    ("shuffle, barrier", ("SHFL", "BAR", "SYNCS", "DEPBAR")),
)
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[0-9T]\s+)?([A-Z][A-Z0-9_.]*)")


def kind_of(opcode: str) -> str:
    for kind, prefixes in KINDS:
        if opcode.startswith(prefixes):
            return kind
    return "integer, other"


def main_loop(sass: str) -> tuple[list[str], list[str]]:
    """The opcodes of the largest body closed by a backward branch (the key-tile loop): all of them, and those
    on its usual path, without the blocks a forward branch inside the loop skips (lazy rescaling's rare
    rescale: the branch skips it wherever no row's maximum grew past LAZY_LOG2)."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\.L_x_\d+):", line))}
    branches = [(i, m.group(1)) for i, line in enumerate(lines) if (m := re.search(r"\bBRA\s+`?\(?(\.L_x_\d+)", line))]
    start, end = max(
        ((labels[target], i) for i, target in branches if labels.get(target, i) < i),
        key=lambda span: span[1] - span[0],
        default=(0, -1),
    )
    skipped = {
        j for i, target in branches if start < i < labels.get(target, -1) <= end for j in range(i + 1, labels[target])
    }
    body = [(j, m.group(1)) for j in range(start, end + 1) if (m := INSTRUCTION.match(lines[j]))]
    return [op for _, op in body], [op for j, op in body if j not in skipped]


def compile_kernel(pv: str, tools: Path, config: Any = None) -> dict[str, Any]:
    """`config`: a KernelConfig (default: the format's DEFAULT_CONFIG)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from vllm_omni.diffusion.attention import triton_int8 as t
    from vllm_omni.diffusion.attention.backends import TRITON_PV

    cfg = config or t.DEFAULT_CONFIG[pv]
    signature = {"Q": "*i8", "QS": "*fp32", "K": "*i8", "KS": "*fp32", "V": V_TYPE[pv], "VS": "*fp32",
                 "VSUM": "*i32", "Out": "*bf16", **dict.fromkeys(INTS, "i32")}  # fmt: skip
    constants = t.kernel_constants(cfg, pv, 128)
    signature.update(dict.fromkeys(constants, "constexpr"))
    names = list(signature)
    aligned = [n for n in names if signature[n].startswith("*")] + list(DIVISIBLE)
    source = ASTSource(
        t._attn_kernel,
        signature,
        constexprs={(names.index(n),): v for n, v in constants.items()},
        attrs={(names.index(n),): [["tt.divisibility", 16]] for n in aligned},
    )
    kernel = triton.compile(
        source, target=GPUTarget(*TARGET), options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    )
    with tempfile.TemporaryDirectory() as scratch:
        cubin = Path(scratch) / "kernel.cubin"
        cubin.write_bytes(kernel.asm["cubin"])
        usage = subprocess.run([tools / "cuobjdump", "--dump-resource-usage", cubin], capture_output=True, text=True)
        sass = subprocess.run([tools / "nvdisasm", "-c", cubin], capture_output=True, text=True).stdout
    found = re.search(r"REG:(\d+) STACK:(\d+)", usage.stdout)
    loop, usual = main_loop(sass)
    kinds = Counter(kind_of(op) for op in usual)
    elements = cfg.block_m * cfg.block_n // (32 * cfg.num_warps)  # P elements a thread holds per key tile
    return {
        "pv": pv,
        "backend": next(name for name, fmt in TRITON_PV.items() if fmt == pv) + (" (lazy)" if cfg.lazy else ""),
        "config": str(cfg),
        "triton": triton.__version__,
        "target": f"sm_{TARGET[1]}",
        "registers": int(found.group(1)) if found else None,
        "stack_bytes": int(found.group(2)) if found else None,
        "shared_bytes": kernel.metadata.shared,
        "loop_instructions": len(usual),  # the usual path's
        "loop_instructions_all": len(loop),  # with the blocks it skips
        "p_elements_per_thread": elements,
        "by_kind": dict(kinds.most_common()),
        "top_opcodes": Counter(usual).most_common(12),
        "mma_opcodes": dict(Counter(op for op in usual if op.split(".")[0].endswith("GMMA"))),
    }


def docs_section(rows: list[dict[str, Any]]) -> str:
    kinds = [k for k, _ in KINDS] + ["integer, other"]
    lines = [
        "## The attention kernels' main loop, instruction by instruction (no GPU)",
        "",
        f"`python benchmarks/kernel_sass.py`: `_attn_kernel` of each P.V format at its default tiles, compiled for "
        f"{rows[0]['target']} by Triton {rows[0]['triton']} (the device ran Triton 3.6: compare within one version) "
        "and disassembled; the key-tile loop's instructions per thread, per tile and per element of P the thread "
        "holds (on the usual path: without the rescale that lazy rescaling's branch skips unless a row's maximum "
        "grew past LAZY_LOG2). On an H100 an SM issues 4 warp instructions a clock and 16 exponentials (MUFU) a "
        "clock, so with the 8-bit MMAs at about 8,192 operations a clock the loop is issue-bound where its "
        "instructions outweigh the tile's MMA time.",
        "",
        "| backend | config | registers | spilled bytes | loop instructions | per P element | "
        + " | ".join(kinds)
        + " |",
        "|---|---|---|---|---|---|" + "---|" * len(kinds),
    ]
    for row in rows:
        per = row["loop_instructions"] / row["p_elements_per_thread"]
        cells = " | ".join(str(row["by_kind"].get(k, 0)) for k in kinds)
        config = row["config"].replace("KernelConfig", "").replace("block_", "").replace("num_", "")
        lines.append(
            f"| `{row['backend']}` | {config} | {row['registers']} | {row['stack_bytes']} | "
            f"{row['loop_instructions']} | {per:.1f} | {cells} |"
        )
    lines += ["", "Most frequent opcodes in the loop:", ""]
    for row in rows:
        lines.append(f"- `{row['backend']}`: " + ", ".join(f"{op} {n}" for op, n in row["top_opcodes"]))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--formats", nargs="+", default=["16bit", "fp8", "int8"], choices=list(V_TYPE))
    parser.add_argument("--out", type=Path, default=RESULTS)
    add_docs_phase(parser, DOCS)
    args = parser.parse_args()
    if args.phase == "run":
        import triton

        tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
        from vllm_omni.diffusion.attention import triton_int8 as t

        rows = []
        # each format at its default tiles; 16-bit P.V also with lazy rescaling (KernelConfig.lazy, opt-in)
        variants = [(pv, None) for pv in args.formats]
        if "16bit" in args.formats:
            variants.insert(1, ("16bit", dataclasses.replace(t.DEFAULT_CONFIG["16bit"], lazy=True)))
        for pv, config in variants:
            row = compile_kernel(pv, tools, config)
            print(
                f"{row['backend']:20s} {row['config']}: {row['registers']} registers, {row['stack_bytes']} "
                f"bytes spilled, loop {row['loop_instructions']} instructions {row['by_kind']}",
                flush=True,
            )
            rows.append(row)
        save_json(args.out, rows)
    rows = load_json(args.out)
    replace_section(args.docs, "kernel_sass", docs_section(rows))
    print(f"results: {args.out}\ndocs: {args.docs}", flush=True)


if __name__ == "__main__":
    main()
