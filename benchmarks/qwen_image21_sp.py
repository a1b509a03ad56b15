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
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section  # noqa: E402
from benchmarks.harness.sp_forward import (  # noqa: E402
    ParallelSetup,
    build_shared_models,
    check_heads,
    compiled_forwards,
    compiled_ratios,
    compiled_variants,
    forward_tables,
    image_size_label,
    merge_rows,
    own_block_code,
    parallel_setup,
    time_sizes,
)
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
    own_block_code(models["diffusers"].transformer_blocks)  # see harness/sp_forward.py
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
    check_heads(config["num_attention_heads"], degree)
    models = build_models(config, device)
    compiled = compiled_forwards(models) if args.compile else None
    return time_sizes(
        parallel,
        args.sizes,
        lambda size: compiled_variants(
            models, compiled, parallel.state, degree, parallel.simulated, image_tokens(size)
        ),
        lambda size: make_inputs(size, config, device),
        lambda size: dict(
            size=size,
            image_tokens=image_tokens(size),
            text_tokens=TEXT_LEN,
            pad=-image_tokens(size) % degree,
            text_pad=-TEXT_LEN % degree,
        ),
        config["num_layers"],
        args.iters,
        args.warmup,
        compiled,
    )


def write_docs(rows: list[dict], path: Path) -> None:
    """The docs section: the rows of the latest run's setup and layer count."""
    latest = (rows[-1]["setup"], rows[-1]["layers"])
    rows = [row for row in rows if (row["setup"], row["layers"]) == latest]
    degree, first = rows[0]["degree"], rows[0]
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
        *forward_tables(rows, sizes, header, compiled_ratios(degree)),
    ]
    replace_section(path, "qwen_image21_sp", "\n".join(lines), script="qwen_image21_sp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help=f"{TINY}'s dimensions (a smoke run; CPU or GPU)")
    parser.add_argument("--degree", type=int, default=None, help="the simulated rank's Ulysses degree (8; --tiny: 3)")
    parser.add_argument("--compile", action="store_true", help="add ours default and diffusers compiled")
    parser.add_argument("--sizes", nargs="+", type=image_size_label, default=None, help=f"sizes (default {SIZES})")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (default: the model's)")
    parser.add_argument("--out", type=Path, default=None)
    add_docs_phase(parser, docs=None)
    args = parser.parse_args()
    out = args.out or (
        Path("/tmp/qwen_image21_sp_tiny.json") if args.tiny else ROOT / "benchmarks/results/qwen_image21_sp.json"
    )
    docs = args.docs or (Path("/tmp/qwen_image21_sp_tiny.md") if args.tiny else ROOT / "docs/benchmarks.md")
    if args.phase == "docs":
        write_docs(load_json(out), docs)
        return
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("qwen_image21_sp.py needs a CUDA GPU at real dimensions (--tiny runs anywhere)")
    args.sizes = args.sizes or (TINY_SIZES if args.tiny else SIZES)
    rows = run(args, parallel_setup(args.degree or (TINY_DEGREE if args.tiny else 8)))
    # One file for every run: rows of other setups, layer counts and sizes are kept, this run's replaced.
    write_docs(merge_rows(out, rows, ("setup", "layers", "size")), docs)
    print(f"results: {out}; docs: {docs}")


if __name__ == "__main__":
    main()
