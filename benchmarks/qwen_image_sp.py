"""Qwen-Image transformer, one forward: our Ulysses SP against diffusers' context parallelism.

Real dimensions (60 layers, 24 heads x 128, joint_attention_dim 3584; 20.4B parameters) with
random bf16 weights built on the GPU; every variant shares the same weight tensors. At
1024x1024 (4096 image tokens) and 1328x1328 (6889, padded at U2) it times, interleaved:
ours U1, ours U2 in trim / none / mask, diffusers U1, diffusers Ulysses U2 and diffusers
Ulysses-anything U2, and our forwards replayed as CUDA graphs (what the engine runs on GPUs).
CUDA events on rank 0, median of --iters rounds, the variants in a new random order each round.

    torchrun --nproc_per_node 2 benchmarks/qwen_image_sp.py     # two GPUs, real NCCL all-to-alls
    python benchmarks/qwen_image_sp.py --simulate               # one GPU: rank 0 of a simulated U2

The simulated rank does a real U2 rank's compute (linear layers on half the tokens, attention
over the whole sequence with half the heads) but its all-to-alls are local copies: it omits
the communication cost, and diffusers' CP cannot run that way.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.docs_table import replace_section  # noqa: E402
from benchmarks.forward_timing import init_parallel, time_variants  # noqa: E402
from vllm_omni.diffusion.cuda_graphs import CUDAGraphForward  # noqa: E402
from vllm_omni.diffusion.data import DiffusionParallelConfig  # noqa: E402
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel  # noqa: E402

REAL_CONFIG = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=60,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=3584,
    axes_dims_rope=(16, 56, 56),
)
TEXT_LEN = 30
SIZES = {"1024x1024": 64, "1328x1328": 83}  # latent grid side (16 pixels a token)
MODES = {"trim": {}, "none": {"trim_sp_padding": False}, "mask": {"mask_sp_padding": True}}


def build_models(device: torch.device, simulate: bool, layers: int):
    from diffusers import QwenImageTransformer2DModel as Reference

    config = dict(REAL_CONFIG, num_layers=layers)
    torch.manual_seed(0)  # identical weights on every rank
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            reference = Reference(**config).eval()
    finally:
        torch.set_default_dtype(previous)

    def sharing(cls):
        with torch.device("meta"):
            model = cls(**config)
        model.load_state_dict(reference.state_dict(), assign=True)
        # Rotary tables are plain tensors (not parameters), left on meta: build them for real. Each
        # model gets its own module, since diffusers' CP hooks attach to it.
        model.pos_embed = type(reference.pos_embed)(
            theta=10000, axes_dim=list(config["axes_dims_rope"]), scale_rope=True
        )
        return model.eval()

    models = {"ours": sharing(QwenImageTransformer2DModel), "diffusers": reference}
    if not simulate:
        from diffusers import ContextParallelConfig

        models["diffusers_ulysses"] = sharing(Reference)
        models["diffusers_ulysses"].enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        models["diffusers_anything"] = sharing(Reference)
        models["diffusers_anything"].enable_parallelism(
            config=ContextParallelConfig(ulysses_degree=2, ulysses_anything=True)
        )
    return models


def make_inputs(side: int, device: torch.device) -> dict:
    gen = torch.Generator(device).manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, side * side, 64, generator=gen, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, TEXT_LEN, 3584, generator=gen, device=device, dtype=torch.bfloat16),
        timestep=torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),
        img_shapes=[[(1, side, side)]],
        return_dict=False,
    )


def variants(models: dict, u2_state, simulate: bool, graphs: bool) -> dict:
    """name -> (callable taking the forward's keyword arguments, parallel state for our model or None)."""
    ours = {"": models["ours"]}
    if graphs:
        ours[" graph"] = CUDAGraphForward(models["ours"].forward)
    out = {}
    for suffix, fn in ours.items():
        out[f"ours U1{suffix}"] = (fn, None)
        for mode, flags in MODES.items():
            config = DiffusionParallelConfig(ulysses_degree=2, **flags)
            out[f"ours U2 {mode}{suffix}"] = (fn, dataclasses.replace(u2_state, config=config))
    out["diffusers U1"] = (models["diffusers"], None)
    if not simulate:
        out["diffusers U2 ulysses"] = (models["diffusers_ulysses"], None)
        out["diffusers U2 ulysses_anything"] = (models["diffusers_anything"], None)
    return out


def write_docs(rows: list[dict], path: Path, setup: str) -> None:
    device = rows[0]["device"]
    table: dict[str, dict[str, object]] = {}
    for row in rows:
        table.setdefault(row["variant"], {})[row["size"]] = row["ms"] if row["ms"] is not None else row["error"]

    def cell(value):
        return f"{value:.1f}" if isinstance(value, float) else f"error: {value}"

    lines = [
        "## Qwen-Image transformer, one forward (ours vs diffusers context parallelism)",
        "",
        f"Real dimensions (60 layers, 24 heads x 128), random bf16 weights shared by every variant, "
        f"text {TEXT_LEN} tokens, batch 1, {device}; {setup}. Median ms over the run, variants interleaved.",
        "",
        "| variant | " + " | ".join(SIZES) + " |",
        "|---|" + "---|" * len(SIZES),
    ]
    for variant, by_size in table.items():
        lines.append(f"| {variant} | " + " | ".join(cell(by_size.get(size)) for size in SIZES) + " |")

    def ratio(a, b, size):
        x, y = table.get(a, {}).get(size), table.get(b, {}).get(size)
        return f"{x / y:.3f}" if isinstance(x, float) and isinstance(y, float) else "n/a"

    lines += ["", "| ratio | " + " | ".join(SIZES) + " |", "|---|" + "---|" * len(SIZES)]
    for a, b in [
        ("ours U2 trim", "ours U1"),
        ("ours U2 trim graph", "ours U1 graph"),
        ("ours U2 trim graph", "ours U1"),
        ("ours U2 trim", "ours U2 none"),
        ("ours U2 trim graph", "ours U2 none graph"),
        ("ours U2 mask", "ours U2 none"),
        ("ours U2 mask graph", "ours U2 none graph"),
        ("ours U2 trim graph", "diffusers U2 ulysses_anything"),
        ("ours U1", "diffusers U1"),
    ]:
        if a in table and b in table:
            lines.append(f"| {a} / {b} | " + " | ".join(ratio(a, b, size) for size in SIZES) + " |")
    replace_section(
        path,
        f"qwen_image_sp_{'simulated' if 'simulated' in setup else 'nccl'}",
        "\n".join(lines),
        script="qwen_image_sp",
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true", help="one GPU: act as rank 0 of a simulated U2 group")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=60, help="fewer layers for a quick check")
    parser.add_argument("--no-graphs", action="store_true", help="skip the CUDA-graph variants of our model")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--docs", type=Path, default=ROOT / "docs/benchmarks.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("qwen_image_sp.py needs a CUDA GPU")

    parallel = init_parallel(args.simulate, degree=2)
    rank, device, u2_state, setup = parallel.rank, parallel.device, parallel.state, parallel.description

    models = build_models(device, args.simulate, args.layers)
    rows = []
    for size, side in SIZES.items():
        result, _ = time_variants(
            variants(models, u2_state, args.simulate, not args.no_graphs),
            make_inputs(side, device),
            args.iters,
            args.warmup,
            rank,
        )
        for variant, value in result.items():
            ms = value if isinstance(value, float) else None
            if rank == 0:
                print(f"{size} {variant:32s} {value if ms is None else f'{ms:.2f} ms'}", flush=True)
            rows.append(
                {
                    "size": size,
                    "variant": variant,
                    "ms": None if ms is None else round(ms, 3),
                    "error": None if ms is not None else value,
                    "setup": setup,
                    "device": torch.cuda.get_device_name(device),
                    "layers": args.layers,
                }
            )
    if rank == 0:
        out = args.out or ROOT / f"benchmarks/results/qwen_image_sp{'_simulated' if args.simulate else ''}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(rows, indent=1) + "\n")
        write_docs(rows, args.docs, setup)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
