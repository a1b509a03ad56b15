"""LTX-2 transformer, one forward: our Ulysses SP (trim / none / mask) against diffusers.

Real dimensions of the LTX-2 (2.0) transformer, the released config as diffusers' conversion script writes it
(scripts/convert_ltx2_to_diffusers.py, version "2.0"): 48 layers; video stream 32 heads x 128 (width 4096),
audio stream 32 heads x 64 (width 2048), 128 latent channels in and out of each, the prompt projected from
Gemma 3's 3840; "split" RoPE; 18.9B parameters. Random bf16 weights built on the GPU, shared by every variant.

Inputs as LTX2Pipeline passes them at its defaults, one row (the prompt's; the CFG forward has two): the
connectors' 1024 prompt tokens for each stream, all valid (their registers fill the padding, so the mask masks
nothing), a timestep per row, `sigma`, `use_cross_timestep`, the pipeline's RoPE coordinates at 24 fps. Sizes
(`--sizes WxHxF`; 32x spatial, 8x temporal VAE, 1x1 patches; 25 audio tokens a second):

- 768x512x121, the released default: 16 x 16 x 24 = 6144 video tokens (no padding at U8) and 126 audio tokens
  (pad 2 at U8): the audio stream pads;
- 800x480x113: 15 x 15 x 25 = 5625 video tokens (pad 7 at U8) and 118 audio tokens (pad 2): both pad.

Variants, timed interleaved (CUDA events, median of --iters rounds after --warmup): ours U1, ours U<N> in
trim / none / mask (one simulated rank: its shards' compute, local all-to-alls), diffusers U1; with
--compile also ours U1 default (compiled blocks and CUDA graphs) and diffusers U1 compiled. Targets: at the
simulated U8 rank, trim / none at most 1.01; mask / none is reported.

    python benchmarks/ltx2_sp.py --simulate --degree 8                     # one GPU: U1 against diffusers, U8 rank
    python benchmarks/ltx2_sp.py --simulate --degree 8 --layers 2 --sizes 256x160x17 --iters 1 \\
        --out /tmp/ltx2_sp.json --docs /tmp/benchmarks.md                  # smoke run (a GPU)

Rows of earlier runs are kept in the results file unless this run repeats their degree, setup, layer count and
size; the docs section shows them all.
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
    add_rank_args,
    build_shared_models,
    check_heads,
    compiled_forwards,
    compiled_ratios,
    compiled_variants,
    end_run,
    forward_tables,
    init_parallel,
    own_block_code,
    runs_of,
    save_run,
    time_sizes,
)
from vllm_omni.diffusion.models.ltx2.transformer import LTX2VideoTransformer3DModel  # noqa: E402

# Lightricks/LTX-2's transformer/config.json (diffusers' conversion script, version "2.0").
REAL_CONFIG = dict(
    in_channels=128,
    out_channels=128,
    patch_size=1,
    patch_size_t=1,
    num_attention_heads=32,
    attention_head_dim=128,
    cross_attention_dim=4096,
    vae_scale_factors=(8, 32, 32),
    pos_embed_max_pos=20,
    base_height=2048,
    base_width=2048,
    gated_attn=False,
    cross_attn_mod=False,
    audio_in_channels=128,
    audio_out_channels=128,
    audio_patch_size=1,
    audio_patch_size_t=1,
    audio_num_attention_heads=32,
    audio_attention_head_dim=64,
    audio_cross_attention_dim=2048,
    audio_scale_factor=4,
    audio_pos_embed_max_pos=20,
    audio_sampling_rate=16000,
    audio_hop_length=160,
    audio_gated_attn=False,
    audio_cross_attn_mod=False,
    num_layers=48,
    activation_fn="gelu-approximate",
    qk_norm="rms_norm_across_heads",
    norm_elementwise_affine=False,
    norm_eps=1e-6,
    caption_channels=3840,
    attention_bias=True,
    attention_out_bias=True,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_offset=1,
    timestep_scale_multiplier=1000,
    cross_attn_timestep_scale_multiplier=1000,
    rope_type="split",
    use_prompt_embeddings=True,
    perturbed_attn=False,
)
TEXT_LEN, FPS, TIMESTEP = 1024, 24.0, 500.0
AUDIO_TOKENS_PER_SECOND = 16000 / 160 / 4
SIZES = ["768x512x121", "800x480x113"]  # width x height x frames


def size_label(text: str) -> str:
    """'WxHxF' with W and H multiples of 32 (32x VAE, 1x1 patches) and F = 8k + 1 (the pipeline's rule)."""
    try:
        width, height, frames = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not WIDTHxHEIGHTxFRAMES") from None
    if width <= 0 or height <= 0 or width % 32 or height % 32 or frames < 1 or (frames - 1) % 8:
        raise argparse.ArgumentTypeError(f"size {text!r}: width and height multiples of 32, frames 8k + 1")
    return text


def latent_shape(size: str) -> tuple[int, int, int]:
    """(frames, height, width) of the video latent: 8x temporal, 32x spatial compression."""
    width, height, frames = (int(part) for part in size.split("x"))
    return (frames - 1) // 8 + 1, height // 32, width // 32


def video_tokens(size: str) -> int:
    frames, height, width = latent_shape(size)
    return frames * height * width


def audio_tokens(size: str) -> int:
    """LTX2Pipeline's audio_num_frames: the video's duration at 24 fps, 25 latent frames a second, rounded."""
    frames = int(size.split("x")[2])
    return round(frames / FPS * AUDIO_TOKENS_PER_SECOND)


def build_models(device: torch.device, layers: int) -> dict:
    """Ours and diffusers' model, one set of weights."""
    models = build_shared_models(
        __import__("diffusers").LTX2VideoTransformer3DModel,
        LTX2VideoTransformer3DModel,
        dict(REAL_CONFIG, num_layers=layers),
        device,
        simulate=True,  # diffusers' own Ulysses is not compared here
    )
    own_block_code(models["diffusers"].transformer_blocks)
    return models


def make_inputs(size: str, device: torch.device, model: torch.nn.Module) -> dict:
    gen = torch.Generator(device).manual_seed(1)
    frames, height, width = latent_shape(size)
    n_audio = audio_tokens(size)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)

    timestep = torch.full((1,), TIMESTEP, device=device, dtype=torch.bfloat16)
    return dict(
        hidden_states=randn(1, video_tokens(size), REAL_CONFIG["in_channels"]),
        audio_hidden_states=randn(1, n_audio, REAL_CONFIG["audio_in_channels"]),
        encoder_hidden_states=randn(1, TEXT_LEN, REAL_CONFIG["caption_channels"]),
        audio_encoder_hidden_states=randn(1, TEXT_LEN, REAL_CONFIG["caption_channels"]),
        timestep=timestep,
        sigma=timestep,
        encoder_attention_mask=torch.ones(1, TEXT_LEN, device=device, dtype=torch.int64),
        audio_encoder_attention_mask=torch.ones(1, TEXT_LEN, device=device, dtype=torch.int64),
        video_coords=model.rope.prepare_video_coords(1, frames, height, width, device, fps=FPS),
        audio_coords=model.audio_rope.prepare_audio_coords(1, n_audio, device),
        use_cross_timestep=True,
        return_dict=False,
    )


def write_docs(rows: list[dict], path: Path) -> None:
    """The docs section of the rows' run (their degree, setup and layer count)."""
    first = rows[0]
    degree = first["degree"]
    sizes = sorted({row["size"] for row in rows}, key=video_tokens, reverse=True)
    header = [
        f"{size} ({video_tokens(size)} + {audio_tokens(size)} tokens, pad {-video_tokens(size) % degree} + "
        f"{-audio_tokens(size) % degree})"
        for size in sizes
    ]
    lines = [
        f"## LTX-2 transformer, one forward (ours U1 / U{degree} vs diffusers)",
        "",
        f"Real dimensions ({first['layers']} layers; video 32 heads x 128, audio 32 heads x 64; 18.9B parameters at "
        f"48 layers), random bf16 weights shared by every variant, one row as LTX2Pipeline passes it ({TEXT_LEN} "
        "prompt tokens a stream from the connectors, all valid), video and audio tokens in the header (their "
        f"padding at U{degree}: video + audio), {first['device']}; {first['setup']}. `default`: compiled blocks and "
        "CUDA graphs, as the engine runs it; `compiled`: diffusers' `compile_repeated_blocks(fullgraph=True)`. "
        "Median ms over the run, variants interleaved; in brackets, bf16 agreement of the U1 variants' video "
        "output with ours U1 (PSNR, max abs diff).",
        "",
        *forward_tables(rows, sizes, header, compiled_ratios(degree)),
    ]
    key = f"ltx2_sp_{'simulated' if 'simulated' in first['setup'] else 'nccl'}_u{degree}"
    replace_section(path, key, "\n".join(lines), script="ltx2_sp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_rank_args(parser, iters=3, warmup=1)
    parser.add_argument("--layers", type=int, default=REAL_CONFIG["num_layers"], help="fewer layers for a smoke run")
    parser.add_argument("--sizes", nargs="+", type=size_label, default=SIZES, help="WIDTHxHEIGHTxFRAMES (%(default)s)")
    parser.add_argument(
        "--compile", action="store_true", help="add ours default (compiled blocks, CUDA graphs) and diffusers compiled"
    )
    parser.add_argument("--out", type=Path, default=None)
    add_docs_phase(parser)
    args = parser.parse_args()
    out = args.out or ROOT / "benchmarks/results/ltx2_sp.json"
    run_keys = ("degree", "setup", "layers")
    if args.phase == "docs":
        for run in runs_of(load_json(out), run_keys):
            write_docs(run, args.docs)
        return
    if not torch.cuda.is_available():
        sys.exit("ltx2_sp.py needs a CUDA GPU")
    if not args.simulate:
        sys.exit("ltx2_sp.py runs one simulated rank (--simulate)")

    parallel = init_parallel(args.simulate, args.degree)
    device, degree = parallel.device, parallel.state.config.ulysses_degree
    check_heads(REAL_CONFIG["num_attention_heads"], degree)
    models = build_models(device, args.layers)
    compiled = compiled_forwards(models) if args.compile else None
    rows = time_sizes(
        parallel,
        args.sizes,
        lambda size: compiled_variants(
            models, compiled, parallel.state, degree, parallel.simulated, video_tokens(size)
        ),
        lambda size: make_inputs(size, device, models["ours"]),
        lambda size: dict(
            size=size,
            frames=latent_shape(size)[0],
            video_tokens=video_tokens(size),
            audio_tokens=audio_tokens(size),
            pad=-video_tokens(size) % degree,
            audio_pad=-audio_tokens(size) % degree,
        ),
        args.layers,
        args.iters,
        args.warmup,
        compiled,
    )
    end_run(parallel, lambda: save_run(out, rows, run_keys, write_docs, args.docs))


if __name__ == "__main__":
    main()
