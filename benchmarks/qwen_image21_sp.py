"""Qwen-Image 2.1 transformer, one forward: ours U1 / a simulated U8 rank against diffusers (one GPU).

Real dimensions (`REAL_CONFIG`): diffusers 0.42.1's `QwenImage21Transformer2DModel` defaults, which its
docstring describes as Qwen-Image 2.1's (no checkpoint config could be read here): 32 single-stream
blocks, 32 heads x 128 (width 4096), SwiGLU MLP ratio 3, Qwen3-VL text 4096, 64 latent channels
unpatched (16x VAE: one token per 16x16 pixels), rotary axes (16, 56, 56), causal_condition. Random
bf16 weights shared by every variant. Inputs as QwenImage21Pipeline's text-to-image call passes them
with `use_kv_cache=False` (what the family runs): a prompt of TEXT_LEN Qwen3-VL tokens after the
system prompt is dropped (5 pad at U8), the target's vision slots after it, no mask. Sizes:

- 1024x1024: 64 x 64 = 4096 image tokens, divisible by 8.
- 1056x1056: 66 x 66 = 4356 image tokens, 4 pad at U8.

Variants, as benchmarks/wan22_sp.py's (its variant table, compiled forwards and ratios): ours U1, ours U8
trim / none / mask on a simulated rank (one GPU: the all-to-alls are local copies), diffusers U1 (its
default `QwenImage21AttnProcessor`: one causal SDPA for the text, one for the target); with --compile,
ours U1 default (compiled blocks and CUDA graphs: what the engine runs) and diffusers U1 compiled
(`compile_repeated_blocks(fullgraph=True)`). Not timed: diffusers' prefix KV cache (its later steps skip
the text's tokens: about 1% of a step's tokens at this prompt length) and its flex-attention processor.

Targets: ours U1 default / diffusers U1 compiled at most 0.95; trim / none at the simulated U8 rank at
most 1.01 (mask / none reported).

    python benchmarks/qwen_image21_sp.py --compile           # one H200 (a few minutes: it compiles)
    python benchmarks/qwen_image21_sp.py --tiny --compile    # CPU or GPU smoke run: tiny/qwen-image-2.1's
                                                             # dimensions at a simulated U3 rank, results in /tmp
"""

from __future__ import annotations

import argparse
import json
import sys
import types
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.docs_table import replace_section  # noqa: E402
from benchmarks.forward_timing import ParallelSetup, agreement, time_variants  # noqa: E402
from benchmarks.glm_image import device_name, host_timing, parallel_setup, size_label  # noqa: E402
from benchmarks.sp_forward import build_shared_models  # noqa: E402
from benchmarks.wan22_sp import DEFAULT, compiled_forwards, own_block_code, ratios, variants  # noqa: E402
from vllm_omni.diffusion.models.qwen_image21.transformer import QwenImage21Transformer2DModel  # noqa: E402

# diffusers 0.42.1 QwenImage21Transformer2DModel.__init__ defaults (its docstring: "The single-stream
# Transformer used by Qwen-Image 2.1").
REAL_CONFIG = dict(
    patch_size=1,
    in_channels=64,
    out_channels=64,
    num_layers=32,
    attention_head_dim=128,
    num_attention_heads=32,
    context_in_dim=4096,
    mlp_ratio=3,
    axes_dims_rope=(16, 56, 56),
    eps=1e-6,
    causal_condition=True,
)
TEXT_LEN = 37  # a prompt of about 28 tokens and the chat template's closing 9
TIMESTEP = 0.5  # the pipeline passes t / 1000
SIZES = ["1024x1024", "1056x1056"]
# The tiny transformer has 6 heads: its simulated rank is U3's; 64x64 is 16 image tokens (2 pad), 96x96 36.
TINY_SIZES, TINY_DEGREE = ["64x64", "96x96"], 3
TINY = "tiny/qwen-image-2.1"


def image_tokens(size: str) -> int:
    width, height = (int(part) for part in size.split("x"))
    return (width // 16) * (height // 16)  # 16x VAE, unpatched latents


def model_config(tiny: bool, layers: int | None) -> dict[str, Any]:
    if tiny:
        from vllm_omni.diffusion.models.qwen_image21.tiny import tiny_model_path

        stored = QwenImage21Transformer2DModel.load_config(tiny_model_path(TINY), subfolder="transformer")
        config = {key: value for key, value in stored.items() if not key.startswith("_")}
    else:
        config = dict(REAL_CONFIG)
    return config if layers is None else dict(config, num_layers=layers)


def build_models(config: dict[str, Any], device: torch.device) -> dict:
    from diffusers import QwenImage21Transformer2DModel as Reference

    def non_parameters(model, reference):
        # What the meta-device copy lacks: the rotary tables (plain tensors) and the timestep frequencies
        # (a non-persistent buffer): the reference's.
        model.pos_embed = reference.pos_embed
        for name, buffer in reference.named_buffers():
            module, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(module), leaf, buffer)

    models = build_shared_models(Reference, QwenImage21Transformer2DModel, config, device, True, non_parameters)
    own_block_code(types.SimpleNamespace(blocks=models["diffusers"].transformer_blocks))  # see wan22_sp.py
    return models


def make_inputs(size: str, config: dict[str, Any], device: torch.device) -> dict:
    width, height = (int(part) for part in size.split("x"))
    tokens = image_tokens(size)
    gen = torch.Generator(device).manual_seed(1)
    bf16 = torch.bfloat16
    slots = torch.cat([torch.zeros(TEXT_LEN, dtype=torch.bool), torch.ones(tokens // 4, dtype=torch.bool)])
    return dict(
        hidden_states=torch.randn(1, tokens, config["in_channels"], generator=gen, device=device, dtype=bf16),
        encoder_hidden_states=torch.randn(
            1, TEXT_LEN, config["context_in_dim"], generator=gen, device=device, dtype=bf16
        ),
        timestep=torch.full((1,), TIMESTEP, device=device, dtype=bf16),
        img_shapes=[[(1, height // 16, width // 16)]],
        img_mask=slots[None].to(device),
        return_dict=False,
    )


def run(args, parallel: ParallelSetup) -> list[dict]:
    device, degree = parallel.device, parallel.state.config.ulysses_degree
    config = model_config(args.tiny, args.layers)
    if config["num_attention_heads"] % degree:
        sys.exit(f"Ulysses {degree} does not divide the {config['num_attention_heads']} heads")
    models = build_models(config, device)
    compiled = compiled_forwards(models) if args.compile else None
    rows = []
    for size in args.sizes:
        tokens = image_tokens(size)
        with host_timing(device):
            result, outputs = time_variants(
                variants(models, compiled, parallel.state, degree, parallel.simulated, tokens),
                make_inputs(size, config, device),
                args.iters,
                args.warmup,
                parallel.rank,
                keep_outputs=True,
            )
        graphs_failed = compiled is not None and compiled["graphs"].disabled
        for variant, value in result.items():
            ms = value if isinstance(value, float) else None
            if ms is not None and variant.endswith(DEFAULT) and graphs_failed:
                ms, value = None, "CUDA graph capture failed: it ran eagerly (see the log), not as the engine does"
            row = {
                "size": size,
                "image_tokens": tokens,
                "text_tokens": TEXT_LEN,
                "pad": -tokens % degree,
                "text_pad": -TEXT_LEN % degree,
                "variant": variant,
                "ms": None if ms is None else round(ms, 3),
                "error": None if ms is not None else value,
                "setup": parallel.description,
                "device": device_name(device),
                "layers": config["num_layers"],
                "degree": degree,
            }
            # A simulated rank's U<N> outputs are not the model's: only the U1 variants are compared.
            if not variant.startswith(f"ours U{degree} ") and ms is not None and variant in outputs:
                row.update(agreement(outputs[variant], outputs["ours U1"]))
            eager = variant.removesuffix(DEFAULT).removesuffix(" compiled")
            if eager != variant and eager in outputs and variant in outputs:
                if torch.equal(outputs[variant], outputs[eager]):
                    row["note"] = "bitwise equal to eager: did its blocks compile?"
            rows.append(row)
            extra = f"  PSNR {row['psnr_db']:.1f} dB, max {row['max_abs_diff']:.3g}" if "psnr_db" in row else ""
            extra += f"  [{row['note']}]" if "note" in row else ""
            print(f"{size} {variant:24s} {value if ms is None else f'{ms:.1f} ms'}{extra}", flush=True)
        outputs.clear()
    return rows


def write_docs(rows: list[dict], path: Path) -> None:
    """The docs section: the rows of the latest run's setup and layer count."""
    latest = (rows[-1]["setup"], rows[-1]["layers"])
    rows = [row for row in rows if (row["setup"], row["layers"]) == latest]
    degree, first = rows[0]["degree"], rows[0]
    table: dict[str, dict[str, dict]] = {}
    for row in rows:
        table.setdefault(row["variant"], {})[row["size"]] = row

    def cell(row: dict | None) -> str:
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

    sizes = sorted({row["size"] for row in rows}, key=image_tokens)
    header = [f"{size} ({image_tokens(size)} tokens, pad {-image_tokens(size) % degree})" for size in sizes]
    lines = [
        "## Qwen-Image 2.1 transformer, one forward (ours U1 / U8 rank vs diffusers)",
        "",
        f"{first['layers']} layers (real: 32), 32 heads x 128 at real dimensions, random bf16 weights shared by "
        f"every variant, text-to-image inputs ({first['text_tokens']} prompt tokens, {first['text_pad']} pad at "
        f"U{degree}), batch 1, {first['device']}; {first['setup']}. `default`: compiled blocks and CUDA graphs, "
        "as the engine runs it; `compiled`: diffusers' `compile_repeated_blocks(fullgraph=True)`. Median ms, "
        "variants interleaved; in brackets, bf16 agreement of the U1 variants with ours U1.",
        "",
        "| variant | " + " | ".join(header) + " |",
        "|---|" + "---|" * len(header),
    ]
    for variant, by_size in table.items():
        lines.append(f"| {variant} | " + " | ".join(cell(by_size.get(size)) for size in sizes) + " |")

    def ratio(a: str, b: str, size: str) -> str:
        x, y = table.get(a, {}).get(size, {}).get("ms"), table.get(b, {}).get(size, {}).get("ms")
        return f"{x / y:.3f}" if x and y else "n/a"

    lines += ["", "| ratio | " + " | ".join(sizes) + " | target |", "|---|" + "---|" * (len(sizes) + 1)]
    for a, b, target in ratios(degree):
        cells = [ratio(a, b, size) for size in sizes]
        if any(cell != "n/a" for cell in cells):  # a run without those variants leaves the row out
            lines.append(f"| {a} / {b} | " + " | ".join(cells) + f" | {target} |")
    replace_section(path, "qwen_image21_sp", "\n".join(lines), script="qwen_image21_sp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help=f"{TINY}'s dimensions (a smoke run; CPU or GPU)")
    parser.add_argument("--degree", type=int, default=None, help="the simulated rank's Ulysses degree (8; --tiny: 3)")
    parser.add_argument("--compile", action="store_true", help="add ours default and diffusers compiled")
    parser.add_argument("--sizes", nargs="+", type=size_label, default=None, help=f"sizes (default {SIZES})")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (default: the model's)")
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--docs", type=Path, default=None)
    args = parser.parse_args()
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("qwen_image21_sp.py needs a CUDA GPU at real dimensions (--tiny runs anywhere)")
    args.sizes = args.sizes or (TINY_SIZES if args.tiny else SIZES)
    out = args.out or (
        Path("/tmp/qwen_image21_sp_tiny.json") if args.tiny else ROOT / "benchmarks/results/qwen_image21_sp.json"
    )
    docs = args.docs or (Path("/tmp/qwen_image21_sp_tiny.md") if args.tiny else ROOT / "docs/benchmarks.md")

    rows = run(args, parallel_setup(args.degree or (TINY_DEGREE if args.tiny else 8)))
    # One file for every run: rows of other setups, layer counts and sizes are kept, this run's replaced.
    kept = json.loads(out.read_text()) if out.exists() else []
    ran = {(row["setup"], row["layers"], row["size"]) for row in rows}
    kept = [row for row in kept if (row["setup"], row["layers"], row["size"]) not in ran]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(kept + rows, indent=1) + "\n")
    write_docs(kept + rows, docs)
    print(f"results: {out}; docs: {docs}")


if __name__ == "__main__":
    main()
