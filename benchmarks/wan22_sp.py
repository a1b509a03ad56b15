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
import json
import sys
import types
from pathlib import Path

import torch
import torch.distributed as dist

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.docs_table import replace_section  # noqa: E402
from benchmarks.forward_timing import agreement, init_parallel, time_variants, with_padding_mode  # noqa: E402
from benchmarks.sp_forward import CompiledBlocks, build_shared_models, switched_on, with_cuda_graphs  # noqa: E402
from vllm_omni.diffusion.models.wan22.transformer import WanTransformer3DModel  # noqa: E402
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward  # noqa: E402

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
MODES = {"trim": {}, "none": {"trim_sp_padding": False}, "mask": {"mask_sp_padding": True}}
DEFAULT = " default"  # suffix of the variants run as the engine runs them: compiled blocks, CUDA graphs


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
    keep = set(Reference._keep_in_fp32_modules)
    for model in models.values():  # as from_pretrained(dtype=bfloat16) loads them (same values in every copy)
        for name, param in model.named_parameters():
            if keep & set(name.split(".")):
                param.data = param.data.float()
    own_block_code(models["diffusers"])
    return models


def own_block_code(model: torch.nn.Module) -> None:
    """Gives diffusers' blocks a copy of `WanTransformerBlock.forward`'s code object (same bytecode).

    Our blocks are diffusers' `WanTransformerBlock` with our processors, and dynamo keeps compiled
    code per code object. Once ours compiled (a graph break at the attention layer, so its guards
    do not look at the processors), diffusers' compiled blocks ran that entry instead of compiling
    their own fullgraph code: eager speed, bitwise the eager output (seen on CPU, torch 2.14). With
    their own code object they compile as they would in a process of their own.
    """
    block_cls = type(model.blocks[0])
    forward = block_cls.forward
    copy = types.FunctionType(
        forward.__code__.replace(), forward.__globals__, forward.__name__, forward.__defaults__, forward.__closure__
    )
    copy.__kwdefaults__, copy.__qualname__ = forward.__kwdefaults__, forward.__qualname__
    # The same class name: compile_repeated_blocks finds blocks by it.
    own_cls = type(block_cls.__name__, (block_cls,), {"forward": copy, "__module__": block_cls.__module__})
    for block in model.blocks:
        block.__class__ = own_cls


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


def compiled_forwards(models: dict) -> dict:
    """Built once for every size, so compiled blocks and captured graphs persist across sizes."""
    ours_graphs = with_cuda_graphs(models["ours"])
    # with_cuda_graphs' CUDAGraphForward, read after a size: a failed capture makes it run eagerly from then on.
    cells = (cell.cell_contents for cell in ours_graphs.__closure__)
    wrapper = next(value for value in cells if isinstance(value, CUDAGraphForward))
    return {
        "ours": switched_on(CompiledBlocks(models["ours"], ours=True), ours_graphs),
        "diffusers": switched_on(CompiledBlocks(models["diffusers"], ours=False), models["diffusers"]),
        "graphs": wrapper,
    }


def variants(models: dict, compiled: dict | None, state, degree: int, simulated: bool, tokens: int) -> dict:
    """name -> (callable taking the forward's keyword arguments, parallel state for our model or None)."""
    out = {"ours U1": (models["ours"], None)}
    if compiled:
        out[f"ours U1{DEFAULT}"] = (compiled["ours"], None)
    for mode, flags in MODES.items() if degree > 1 else ():
        out[f"ours U{degree} {mode}"] = (models["ours"], with_padding_mode(state, **flags))
    if compiled and degree > 1 and not simulated:  # a simulated rank times the padding modes eagerly
        out[f"ours U{degree} trim{DEFAULT}"] = (compiled["ours"], with_padding_mode(state))
    out["diffusers U1"] = (models["diffusers"], None)
    if compiled:
        out["diffusers U1 compiled"] = (compiled["diffusers"], None)
    if "diffusers_ulysses" in models:
        # Plain Ulysses needs the tokens to divide by the degree (its sharder asserts, leaving NCCL corrupt).
        if tokens % 2 == 0:
            out["diffusers U2 ulysses"] = (models["diffusers_ulysses"], None)
        else:
            out["diffusers U2 ulysses_anything"] = (models["diffusers_anything"], None)
    return out


def ratios(degree: int) -> list[tuple[str, str, str]]:
    """(numerator, denominator, target) of the ratio table."""
    u = f"ours U{degree}"
    return [
        (f"ours U1{DEFAULT}", "diffusers U1 compiled", "at most 0.95"),
        ("ours U1", "diffusers U1", ""),
        (f"ours U1{DEFAULT}", "ours U1", ""),
        ("diffusers U1 compiled", "diffusers U1", ""),
        (f"{u} trim", f"{u} none", "at most 1.01"),
        (f"{u} mask", f"{u} none", "reported"),
        (f"{u} trim", "ours U1", ""),
        (f"{u} trim{DEFAULT}", f"ours U1{DEFAULT}", ""),
        ("ours U2 trim", "diffusers U2 ulysses", ""),
        ("ours U2 trim", "diffusers U2 ulysses_anything", ""),
        (f"ours U2 trim{DEFAULT}", "diffusers U2 ulysses", ""),
        (f"ours U2 trim{DEFAULT}", "diffusers U2 ulysses_anything", ""),
    ]


def write_docs(rows: list[dict], path: Path, setup: str, degree: int, simulated: bool) -> None:
    device, layers = rows[0]["device"], rows[0]["layers"]
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

    sizes = sorted({row["size"] for row in rows}, key=video_tokens, reverse=True)
    header = [f"{size} ({video_tokens(size)} tokens, pad {-video_tokens(size) % degree})" for size in sizes]
    lines = [
        f"## Wan2.2 A14B transformer, one forward (ours U1 / U{degree} vs diffusers)",
        "",
        f"Real dimensions ({layers} layers, 40 heads x 128, FFN 13824; 14.29B parameters at 40 layers), random "
        f"bf16 weights shared by every variant, text as WanPipeline passes it ({TEXT_LEN} UMT5 tokens, "
        f"{TEXT_VALID} valid, zeros after, no mask), batch 1, {device}; {setup}. `default`: compiled blocks and "
        "CUDA graphs, as the engine runs it; `compiled`: diffusers' `compile_repeated_blocks(fullgraph=True)`. "
        "Median ms over the run, variants interleaved"
        + (
            "; in brackets, bf16 agreement of the U1 variants with ours U1 (PSNR, max abs diff)."
            if simulated
            else "; in brackets, bf16 agreement with ours U1 (PSNR, max abs diff)."
        ),
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
    key = f"wan22_sp_{'simulated' if simulated else 'nccl'}_u{degree}"
    replace_section(path, key, "\n".join(lines), script="wan22_sp")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--simulate", action="store_true", help="one GPU: act as rank 0 of a simulated group")
    parser.add_argument("--degree", type=int, default=None, help="Ulysses degree (default: torchrun's world size; 2)")
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--layers", type=int, default=REAL_CONFIG["num_layers"], help="fewer layers for a smoke run")
    parser.add_argument("--sizes", nargs="+", type=size_label, default=SIZES, help="WIDTHxHEIGHTxFRAMES (%(default)s)")
    parser.add_argument(
        "--compile", action="store_true", help="add ours default (compiled blocks, CUDA graphs) and diffusers compiled"
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--docs", type=Path, default=ROOT / "docs/benchmarks.md")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("wan22_sp.py needs a CUDA GPU")

    parallel = init_parallel(args.simulate, args.degree)
    rank, device, degree = parallel.rank, parallel.device, parallel.state.config.ulysses_degree
    if degree > 1 and REAL_CONFIG["num_attention_heads"] % degree:
        sys.exit(f"Ulysses {degree} does not divide the {REAL_CONFIG['num_attention_heads']} heads")
    models = build_models(device, args.layers, diffusers_ulysses=not parallel.simulated and degree == 2)
    compiled = compiled_forwards(models) if args.compile else None
    rows = []
    for size in args.sizes:
        tokens = video_tokens(size)
        result, outputs = time_variants(
            variants(models, compiled, parallel.state, degree, parallel.simulated, tokens),
            make_inputs(size, device),
            args.iters,
            args.warmup,
            rank,
            keep_outputs=True,  # [1, 16, F, H, W]: megabytes
        )
        graphs_failed = compiled is not None and compiled["graphs"].disabled
        for variant, value in result.items():
            ms = value if isinstance(value, float) else None
            if ms is not None and variant.endswith(DEFAULT) and graphs_failed:
                ms, value = None, "CUDA graph capture failed: it ran eagerly (see the log), not as the engine does"
            row = {
                "size": size,
                "frames": latent_shape(size)[0],
                "video_tokens": tokens,
                "pad": -tokens % degree,
                "variant": variant,
                "ms": None if ms is None else round(ms, 3),
                "error": None if ms is not None else value,
                "setup": parallel.description,
                "device": torch.cuda.get_device_name(device),
                "layers": args.layers,
                "degree": degree,
            }
            # A simulated rank's U<N> outputs are not the model's: compared only on real ranks.
            real = not parallel.simulated or not variant.startswith(f"ours U{degree} ")
            if real and ms is not None and variant in outputs and "ours U1" in outputs:
                row.update(agreement(outputs[variant], outputs["ours U1"]))
            eager = variant.removesuffix(DEFAULT).removesuffix(" compiled")
            if eager != variant and eager in outputs and variant in outputs:
                if torch.equal(outputs[variant], outputs[eager]):
                    row["note"] = "bitwise equal to eager: did its blocks compile?"
            rows.append(row)
            if rank == 0:
                extra = f"  PSNR {row['psnr_db']:.1f} dB, max {row['max_abs_diff']:.3g}" if "psnr_db" in row else ""
                extra += f"  [{row['note']}]" if "note" in row else ""
                print(f"{size} {variant:24s} {value if ms is None else f'{ms:.1f} ms'}{extra}", flush=True)
        outputs.clear()
    if rank == 0:
        out = args.out or ROOT / "benchmarks/results/wan22_sp.json"
        # One file for every run: rows of other degrees, setups, layer counts and sizes are kept, this run's replaced.
        run = (degree, parallel.description, args.layers)
        kept = json.loads(out.read_text()) if out.exists() else []
        kept = [r for r in kept if (r["degree"], r["setup"], r["layers"]) != run or r["size"] not in args.sizes]
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(kept + rows, indent=1) + "\n")
        same_run = [r for r in kept if (r["degree"], r["setup"], r["layers"]) == run] + rows
        write_docs(same_run, args.docs, parallel.description, degree, parallel.simulated)
    if dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
