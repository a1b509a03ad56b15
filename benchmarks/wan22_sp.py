"""Wan2.2 A14B transformer, one forward: our Ulysses SP (trim / none / mask) against diffusers.

Real dimensions of one A14B expert (T2V and I2V, high- and low-noise, all have them), which are
diffusers' `WanTransformer3DModel` defaults: 40 layers, 40 heads x 128 (width 5120), FFN 13824,
UMT5 text 4096, 16 latent channels in and out, patches 1x2x2, q/k RMSNorm across heads; 14.29B
parameters. Random bf16 weights built on the GPU, shared by every variant; the modules diffusers
keeps in fp32 when it loads a checkpoint (`_keep_in_fp32_modules`: time embedder, modulation
tables, cross-attention norm) are fp32 here too.

Inputs as WanPipeline passes them: the prompt padded to 512 UMT5 tokens, 30 valid (random rows)
and zeros after, no mask (ours and diffusers both attend to all 512, as the pipeline does); an
int64 timestep, as the UniPC scheduler's. Sizes, 81 frames (Wan2.1 VAE: 4x temporal, 8x spatial,
then 1x2x2 patches; `--sizes WxHxF` for others):

- 1280x720x81: 21 x 45 x 80 = 75600 video tokens; no padding at U2 or U8.
- 848x480x81: 21 x 30 x 53 = 33390 video tokens; pads 2 at U8, none at U2.

Variants, timed interleaved (CUDA events, median of --iters rounds after --warmup): ours U1,
ours U<N> in trim / none / mask, diffusers U1; with --compile also ours U1 default (compiled
blocks and CUDA graphs: what the engine runs on GPUs), diffusers U1 compiled (its own
`compile_repeated_blocks(fullgraph=True)`, on its own copy of the block's code: `own_block_code`)
and, on real GPUs, ours U<N> trim default. On two GPUs, diffusers' own Ulysses U2
(`ContextParallelConfig(ulysses_degree=2)`; Ulysses-anything where the video tokens do not divide
by 2). A compiled variant whose output is bitwise its eager variant's is flagged (its blocks did
not compile); a default variant whose graph capture failed (it then ran eagerly) is an error.
On real GPUs (torchrun) rank 0 also reports the bf16 agreement of every variant with ours U1
(max abs diff, PSNR with the U1 output's peak); a simulated rank computes its U<N> variants with
its own values only, so it reports agreement for the U1 variants alone.

Targets: ours U1 default / diffusers U1 compiled at most 0.95; at the simulated U8 rank, trim /
none at most 1.01; mask / none is reported.

    python benchmarks/wan22_sp.py --simulate --degree 8 --compile   # one GPU: U1 against diffusers, U8 rank
    torchrun --nproc_per_node 2 benchmarks/wan22_sp.py --compile    # U2 on two GPUs, NCCL, diffusers' Ulysses
    python benchmarks/wan22_sp.py --simulate --degree 8 --compile --sizes 1280x720x81   # one size a run
    python benchmarks/wan22_sp.py --simulate --degree 8 --compile --layers 2 --sizes 160x96x9 --iters 1 \\
        --out /tmp/wan22_sp.json --docs /tmp/benchmarks.md                             # smoke run (a GPU)

Rows of earlier runs are kept in the results file unless this run repeats their degree, setup,
layer count and size, so sizes can be run one call each; the docs section shows them all.
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
from vllm_omni.diffusion import diffusers_compat  # noqa: E402
from vllm_omni.diffusion.models.wan22.transformer import WanTransformer3DModel  # noqa: E402

# Wan-AI/Wan2.2-T2V-A14B-Diffusers transformer/config.json (equal to the diffusers 0.42.1 defaults).
REAL_CONFIG = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=40,
    attention_head_dim=128,
    in_channels=16,
    out_channels=16,
    text_dim=4096,
    freq_dim=256,
    ffn_dim=13824,
    num_layers=40,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    eps=1e-6,
    image_dim=None,
    added_kv_proj_dim=None,
    rope_max_seq_len=1024,
)
TEXT_LEN, TEXT_VALID = 512, 30  # WanPipeline pads every prompt to max_sequence_length=512 with zeros
TIMESTEP = 500
SIZES = ["1280x720x81", "848x480x81"]  # width x height x frames


def size_label(text: str) -> str:
    """'WxHxF' with W and H multiples of 16 (8x VAE, 2x2 patches) and F = 4k + 1 (the pipeline's rule)."""
    try:
        width, height, frames = (int(part) for part in text.split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"size {text!r} is not WIDTHxHEIGHTxFRAMES") from None
    if width <= 0 or height <= 0 or width % 16 or height % 16 or frames < 1 or (frames - 1) % 4:
        raise argparse.ArgumentTypeError(f"size {text!r}: width and height multiples of 16, frames 4k + 1")
    return text


def latent_shape(size: str) -> tuple[int, int, int]:
    """(frames, height, width) of the Wan2.1 VAE latent: 4x temporal, 8x spatial compression."""
    width, height, frames = (int(part) for part in size.split("x"))
    return (frames - 1) // 4 + 1, height // 8, width // 8


def video_tokens(size: str) -> int:
    frames, height, width = latent_shape(size)
    _, p_h, p_w = REAL_CONFIG["patch_size"]
    return frames * (height // p_h) * (width // p_w)


def build_models(device: torch.device, layers: int, diffusers_ulysses: bool) -> dict:
    """Ours and diffusers' model (and, for two GPUs, diffusers' Ulysses copies), one set of weights."""
    from diffusers import WanTransformer3DModel as Reference

    def rotary_tables(model, reference):
        # The rotary tables are non-persistent buffers, left on meta by the copy: the reference's tensors.
        model.rope.freqs_cos, model.rope.freqs_sin = reference.rope.freqs_cos, reference.rope.freqs_sin

    config = dict(REAL_CONFIG, num_layers=layers)
    models = build_shared_models(
        Reference, WanTransformer3DModel, config, device, not diffusers_ulysses, finish=rotary_tables
    )
    keep = diffusers_compat.keep_in_fp32_modules(Reference)
    for model in models.values():  # as from_pretrained(dtype=bfloat16) loads them (same values in every copy)
        for name, param in model.named_parameters():
            if keep & set(name.split(".")):
                param.data = param.data.float()
    own_block_code(models["diffusers"].blocks)
    return models


def make_inputs(size: str, device: torch.device) -> dict:
    gen = torch.Generator(device).manual_seed(1)
    text = torch.randn(1, TEXT_LEN, REAL_CONFIG["text_dim"], generator=gen, device=device, dtype=torch.bfloat16)
    text[:, TEXT_VALID:] = 0
    latents = (1, REAL_CONFIG["in_channels"], *latent_shape(size))
    return dict(
        hidden_states=torch.randn(*latents, generator=gen, device=device, dtype=torch.bfloat16),
        timestep=torch.full((1,), TIMESTEP, device=device, dtype=torch.int64),
        encoder_hidden_states=text,
        return_dict=False,
    )


def write_docs(rows: list[dict], path: Path) -> None:
    """The docs section of the rows' run (their degree, setup and layer count)."""
    first = rows[0]
    degree, simulated = first["degree"], "simulated" in first["setup"]
    sizes = sorted({row["size"] for row in rows}, key=video_tokens, reverse=True)
    header = [f"{size} ({video_tokens(size)} tokens, pad {-video_tokens(size) % degree})" for size in sizes]
    lines = [
        f"## Wan2.2 A14B transformer, one forward (ours U1 / U{degree} vs diffusers)",
        "",
        f"Real dimensions ({first['layers']} layers, 40 heads x 128, FFN 13824; 14.29B parameters at 40 layers), "
        f"random bf16 weights shared by every variant, text as WanPipeline passes it ({TEXT_LEN} UMT5 tokens, "
        f"{TEXT_VALID} valid, zeros after, no mask), batch 1, {first['device']}; {first['setup']}. `default`: "
        "compiled blocks and CUDA graphs, as the engine runs it; `compiled`: diffusers' "
        "`compile_repeated_blocks(fullgraph=True)`. Median ms over the run, variants interleaved"
        + (
            "; in brackets, bf16 agreement of the U1 variants with ours U1 (PSNR, max abs diff)."
            if simulated
            else "; in brackets, bf16 agreement with ours U1 (PSNR, max abs diff)."
        ),
        "",
        *forward_tables(rows, sizes, header, compiled_ratios(degree)),
    ]
    key = f"wan22_sp_{'simulated' if simulated else 'nccl'}_u{degree}"
    replace_section(path, key, "\n".join(lines), script="wan22_sp")


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
    out = args.out or ROOT / "benchmarks/results/wan22_sp.json"
    run_keys = ("degree", "setup", "layers")
    if args.phase == "docs":  # a section per run the file holds
        for run in runs_of(load_json(out), run_keys):
            write_docs(run, args.docs)
        return
    if not torch.cuda.is_available():
        sys.exit("wan22_sp.py needs a CUDA GPU")

    parallel = init_parallel(args.simulate, args.degree)
    device, degree = parallel.device, parallel.state.config.ulysses_degree
    check_heads(REAL_CONFIG["num_attention_heads"], degree)
    models = build_models(device, args.layers, diffusers_ulysses=not parallel.simulated and degree == 2)
    compiled = compiled_forwards(models) if args.compile else None
    rows = time_sizes(
        parallel,
        args.sizes,
        lambda size: compiled_variants(
            models, compiled, parallel.state, degree, parallel.simulated, video_tokens(size)
        ),
        lambda size: make_inputs(size, device),  # outputs [1, 16, F, H, W]: megabytes
        lambda size: dict(
            size=size, frames=latent_shape(size)[0], video_tokens=video_tokens(size), pad=-video_tokens(size) % degree
        ),
        args.layers,
        args.iters,
        args.warmup,
        compiled,
    )
    end_run(parallel, lambda: save_run(out, rows, run_keys, write_docs, args.docs))


if __name__ == "__main__":
    main()
