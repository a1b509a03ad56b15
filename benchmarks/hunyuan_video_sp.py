"""HunyuanVideo 1.5 transformer, one forward: our Ulysses SP (trim / none / mask) against diffusers.

Real dimensions of the 480p text-to-video checkpoint, which are diffusers'
`HunyuanVideo15Transformer3DModel` defaults: 54 double-stream layers, 16 heads x 128 (width 2048),
MLP ratio 4, a 2-layer token refiner, patch 1x1x1, 65 input / 32 output channels, Qwen2.5-VL text
3584, ByT5 glyphs 1472 (projected through a 2048-wide MLP), SigLIP image 1152, rotary axes
(16, 56, 56); 8.33B parameters. Random bf16 weights built on the GPU, shared by every variant.

Inputs as the text-to-video pipeline passes them: 1000 Qwen2.5-VL prompt tokens of which 30 are
valid, 256 ByT5 tokens (no quoted text: none valid), 729 all-zero image tokens (masked). Ours
keeps the 30 valid tokens (bucketed to 64, the filler dropped by the padding policy); diffusers
attends over [video, 1985 text tokens] with its full mask. Sizes, 121 frames (31 latent frames):

- 848x480: 31 x 30 x 53 = 49290 video tokens; pads 6 at U8, none at U2.
- 848x464: 31 x 29 x 53 = 47647 video tokens; pads 1 at U2 (and at U8).

Variants, timed interleaved (CUDA events, median of --iters rounds after --warmup): ours U1,
ours U<N> in trim / none / mask, diffusers U1. On real GPUs (torchrun) rank 0 also reports the bf16
agreement of every variant with ours U1 (max abs diff, PSNR with the U1 output's peak); a
simulated rank computes with its own values only, so it reports timings alone.

    torchrun --nproc_per_node 2 benchmarks/hunyuan_video_sp.py      # U2 on two GPUs, NCCL
    torchrun --nproc_per_node 8 benchmarks/hunyuan_video_sp.py      # U8
    python benchmarks/hunyuan_video_sp.py --simulate --degree 8     # one GPU: rank 0 of a simulated U8
    python benchmarks/hunyuan_video_sp.py --simulate --layers 2     # smoke run
    torchrun --nproc_per_node 1 benchmarks/hunyuan_video_sp.py --compile --sizes 848x480
                                   # one GPU: ours and diffusers, eager and with compiled blocks
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section  # noqa: E402
from benchmarks.harness.sp_forward import (  # noqa: E402
    MODES,
    CompiledBlocks,
    add_rank_args,
    build_shared_models,
    end_run,
    forward_tables,
    init_parallel,
    runs_of,
    save_run,
    switched_on,
    time_sizes,
    with_padding_mode,
)
from vllm_omni.diffusion.models.hunyuan_video_15.transformer import HunyuanVideo15Transformer3DModel  # noqa: E402

REAL_CONFIG = dict(
    in_channels=65,
    out_channels=32,
    num_attention_heads=16,
    attention_head_dim=128,
    num_layers=54,
    num_refiner_layers=2,
    mlp_ratio=4.0,
    patch_size=1,
    patch_size_t=1,
    text_embed_dim=3584,
    text_embed_2_dim=1472,
    image_embed_dim=1152,
    rope_axes_dim=(16, 56, 56),
    target_size=640,
    task_type="t2v",
)
PROMPT_LEN, PROMPT_VALID, GLYPH_LEN, IMAGE_LEN = 1000, 30, 256, 729
FRAMES = 121
SIZES = {"848x480": (480, 848), "848x464": (464, 848)}  # name -> (height, width)


def latent_grid(height: int, width: int) -> tuple[int, int, int]:
    """16x spatial and 4x temporal VAE compression, 1x1x1 patches."""
    return (FRAMES - 1) // 4 + 1, height // 16, width // 16


def video_tokens(size: str) -> int:
    frames, rows, cols = latent_grid(*SIZES[size])
    return frames * rows * cols


def build_models(device: torch.device, layers: int) -> dict:
    from diffusers import HunyuanVideo15Transformer3DModel as Reference

    config = dict(REAL_CONFIG, num_layers=layers)
    return build_shared_models(Reference, HunyuanVideo15Transformer3DModel, config, device, simulate=True)


def make_inputs(height: int, width: int, device: torch.device) -> dict:
    gen = torch.Generator(device).manual_seed(1)
    frames, rows, cols = latent_grid(height, width)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    prompt_mask = torch.zeros(1, PROMPT_LEN, device=device, dtype=torch.bfloat16)
    prompt_mask[:, :PROMPT_VALID] = 1
    return dict(
        hidden_states=randn(1, REAL_CONFIG["in_channels"], frames, rows, cols),
        timestep=torch.full((1,), 500.0, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=randn(1, PROMPT_LEN, REAL_CONFIG["text_embed_dim"]),
        encoder_attention_mask=prompt_mask,
        encoder_hidden_states_2=torch.zeros(1, GLYPH_LEN, REAL_CONFIG["text_embed_2_dim"], device=device).bfloat16(),
        encoder_attention_mask_2=torch.zeros(1, GLYPH_LEN, device=device, dtype=torch.bfloat16),
        image_embeds=torch.zeros(1, IMAGE_LEN, REAL_CONFIG["image_embed_dim"], device=device, dtype=torch.bfloat16),
        return_dict=False,
    )


def variants(models: dict, state, degree: int, compiled: bool = False) -> dict:
    """name -> (callable taking the forward's keyword arguments, parallel state for our model or None)."""
    out = {"ours U1": (models["ours"], None)}
    if compiled:  # as the engine would compile them; no CUDA graphs (the text plan is an object: eager by rule)
        out["ours U1 compiled"] = (switched_on(CompiledBlocks(models["ours"], ours=True), models["ours"]), None)
    for mode, flags in MODES.items() if degree > 1 else ():
        out[f"ours U{degree} {mode}"] = (models["ours"], with_padding_mode(state, **flags))
    out["diffusers U1"] = (models["diffusers"], None)
    if compiled:
        blocks = CompiledBlocks(models["diffusers"], ours=False)
        out["diffusers U1 compiled"] = (switched_on(blocks, models["diffusers"]), None)
    return out


def write_docs(rows: list[dict], path: Path) -> None:
    """The docs section of the rows' run (their degree and setup)."""
    first = rows[0]
    degree, setup, simulated = first["degree"], first["setup"], "simulated" in first["setup"]
    sizes = [size for size in SIZES if any(row["size"] == size for row in rows)]
    header = [f"{size}x{FRAMES} ({video_tokens(size)} tokens, pad {-video_tokens(size) % degree})" for size in sizes]
    lines = [
        f"## HunyuanVideo 1.5 transformer, one forward (ours U1 / U{degree} vs diffusers)",
        "",
        f"Real dimensions ({first['layers']} layers, 16 heads x 128; 8.33B parameters at 54 layers), random bf16 "
        f"weights shared by every variant, text as the t2v pipeline passes it ({PROMPT_LEN} prompt tokens, "
        f"{PROMPT_VALID} valid; {GLYPH_LEN} glyph and {IMAGE_LEN} image tokens, all masked), batch 1, "
        f"{first['device']}; {setup}. Median ms over the run, variants interleaved"
        + ("." if simulated else "; in brackets, bf16 agreement with ours U1 (PSNR, max abs diff)."),
        "",
    ]
    ratios = [
        (f"ours U{degree} trim", "ours U1"),
        (f"ours U{degree} trim", f"ours U{degree} none"),
        (f"ours U{degree} mask", f"ours U{degree} none"),
        ("ours U1", "diffusers U1"),
        ("ours U1 compiled", "ours U1"),
        ("ours U1 compiled", "diffusers U1 compiled"),
    ]
    lines += forward_tables(rows, sizes, header, ratios)
    key = f"hunyuan_video_sp_{'simulated' if simulated else 'nccl'}_u{degree}"
    replace_section(path, key, "\n".join(lines), script="hunyuan_video_sp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rank_args(parser, iters=3, warmup=1)
    parser.add_argument("--layers", type=int, default=REAL_CONFIG["num_layers"], help="fewer layers for a smoke run")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--compile", action="store_true", help="add compiled-block variants (ours, diffusers' own)")
    parser.add_argument("--out", type=Path, default=None)
    add_docs_phase(parser)
    args = parser.parse_args()
    out = args.out or ROOT / "benchmarks/results/hunyuan_video_sp.json"
    run_keys = ("degree", "setup")
    if args.phase == "docs":  # a section per run (degree and setup) the file holds
        for run in runs_of(load_json(out), run_keys):
            write_docs(run, args.docs)
        return
    if not torch.cuda.is_available():
        sys.exit("hunyuan_video_sp.py needs a CUDA GPU")

    parallel = init_parallel(args.simulate, args.degree)
    device, degree = parallel.device, parallel.state.config.ulysses_degree
    models = build_models(device, args.layers)
    rows = time_sizes(
        parallel,
        args.sizes,
        lambda size: variants(models, parallel.state, degree, args.compile),
        lambda size: make_inputs(*SIZES[size], device),
        lambda size: dict(size=size, frames=FRAMES, video_tokens=video_tokens(size), pad=-video_tokens(size) % degree),
        args.layers,
        args.iters,
        args.warmup,
        keep_outputs=not parallel.simulated,
    )
    end_run(parallel, lambda: save_run(out, rows, run_keys, write_docs, args.docs))


if __name__ == "__main__":
    main()
