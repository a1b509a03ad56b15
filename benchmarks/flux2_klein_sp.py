"""FLUX.2 klein transformer, one forward: ours as the engine runs it vs diffusers compiled; a U<N> rank's padding modes.

Real dimensions from Black Forest Labs' FLUX.2 klein parameter sets (`Klein4BParams` / `Klein9BParams` in
github.com/black-forest-labs/flux2, src/flux2/model.py, which the checkpoints' transformer/config.json
carry in diffusers' names); the rest are diffusers' `Flux2Transformer2DModel` defaults:

- 4B (FLUX.2-klein-4B): 5 double-stream + 20 single-stream blocks, 24 heads x 128 (3072 wide),
  joint_attention_dim 7680 = 3 stacked Qwen3-4B layers of 2560.
- 9B (FLUX.2-klein-9B, and the 9B KV checkpoint): 8 + 24 blocks, 32 heads x 128 (4096 wide),
  joint_attention_dim 12288 = 3 stacked Qwen3-8B layers of 4096.
- Both: 128 input channels (32 latent channels in 2x2 patches), MLP ratio 3, rotary axes (32, 32, 32, 32)
  with theta 2000, no guidance embedding.

Random bf16 weights built on the GPU, shared by every variant. The text stream is the pipeline's 512 tokens
(max_sequence_length). Sizes: 1024x1024 (4096 image tokens, no padding at U8) and 1328x1328 (6889 tokens,
7 pad tokens at U8). Variants, timed interleaved (CUDA events, median of --iters rounds after --warmup):
ours U1 (eager), ours U1 default (compiled blocks and CUDA graphs, as the engine runs it; a copy sharing
the weights, so the eager variant stays eager), diffusers U1 and diffusers U1 compiled (its own
`compile_repeated_blocks(fullgraph=True)`), and ours U<N> in trim / none / mask. Targets: ours U1 default /
diffusers U1 compiled at most 0.95; at the U8 rank trim / none at most 1.01 (mask / none reported).

    python benchmarks/flux2_klein_sp.py --simulate --degree 8               # one GPU: U1 vs diffusers, a U8 rank
    python benchmarks/flux2_klein_sp.py --simulate --degree 8 --model 9b
    torchrun --nproc_per_node 8 benchmarks/flux2_klein_sp.py               # eight GPUs, real NCCL all-to-alls
    python benchmarks/flux2_klein_sp.py --simulate --degree 8 --layers 1,1 --iters 1 --sizes 1024x1024 \\
        --out /tmp/klein.json --docs /tmp/benchmarks.md                    # smoke run (a GPU)

A simulated rank does a real U<N> rank's compute, but its all-to-alls are local copies: no communication
cost, and its outputs are not the model's (agreement with ours U1 is reported for the U1 variants only).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402
from benchmarks.harness.sp_forward import (  # noqa: E402
    DEFAULT,
    MODES,
    CompiledBlocks,
    add_rank_args,
    build_shared_models,
    check_heads,
    end_run,
    forward_tables,
    init_parallel,
    own_block_code,
    switched_on,
    time_sizes,
    with_cuda_graphs,
    with_padding_mode,
)
from vllm_omni.diffusion.models.flux2.transformer import Flux2Transformer2DModel  # noqa: E402
from vllm_omni.diffusion.worker.cuda_graphs import compile_repeated_blocks  # noqa: E402

COMMON = dict(
    patch_size=1,
    in_channels=128,
    out_channels=None,
    attention_head_dim=128,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=False,
)
CONFIGS = {
    "4b": dict(COMMON, num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680),
    "9b": dict(COMMON, num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288),
}
TEXT_LEN = 512  # Flux2KleinPipeline pads every prompt to max_sequence_length=512
SIZES = {"1024x1024": 64, "1328x1328": 83}  # latent grid side (16 pixels a token)


def _position_ids(t: int, h: int, w: int, length: int, device: torch.device) -> torch.Tensor:
    ranges = [torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(length)]
    return torch.cartesian_prod(*ranges).unsqueeze(0).to(device)


def make_inputs(config: dict, side: int, device: torch.device) -> dict:
    """The forward's arguments as Flux2KleinPipeline passes them (no guidance: klein embeds none)."""
    gen = torch.Generator(device).manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, side * side, config["in_channels"], generator=gen, device=device).bfloat16(),
        encoder_hidden_states=torch.randn(
            1, TEXT_LEN, config["joint_attention_dim"], generator=gen, device=device
        ).bfloat16(),
        timestep=torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),  # the pipeline passes t / 1000
        img_ids=_position_ids(0, side, side, 1, device),
        txt_ids=_position_ids(0, 1, 1, TEXT_LEN, device),
        guidance=None,
        return_dict=False,
    )


def build_models(config: dict, device: torch.device, compiled: bool) -> dict:
    """Ours (eager) and diffusers; `compiled` adds ours default (a copy sharing the weights) and diffusers compiled."""
    from diffusers import Flux2Transformer2DModel as Reference

    # FLUX.2 has no non-parameter tensors (rotary tables are computed per forward): nothing to finish.
    models = build_shared_models(Reference, Flux2Transformer2DModel, config, device, simulate=True)
    if compiled:
        with torch.device("meta"):
            default = Flux2Transformer2DModel(**config)
        default.load_state_dict(models["ours"].state_dict(), assign=True)
        compile_repeated_blocks(default.eval())  # compiles its blocks' forward for good: hence the copy
        models["ours_default"] = with_cuda_graphs(default)
        own_block_code(models["diffusers"].transformer_blocks, models["diffusers"].single_transformer_blocks)
        models["diffusers_compiled"] = switched_on(CompiledBlocks(models["diffusers"], ours=False), models["diffusers"])
    return models


def variants(models: dict, state, degree: int, simulated: bool) -> dict:
    """name -> (callable taking the forward's keyword arguments, parallel state for our model or None)."""
    out = {"ours U1": (models["ours"], None)}
    if "ours_default" in models:
        out[f"ours U1{DEFAULT}"] = (models["ours_default"], None)
    for mode, flags in MODES.items() if degree > 1 else ():
        out[f"ours U{degree} {mode}"] = (models["ours"], with_padding_mode(state, **flags))
    if "ours_default" in models and degree > 1 and not simulated:  # a simulated rank times the modes eagerly
        out[f"ours U{degree} trim{DEFAULT}"] = (models["ours_default"], with_padding_mode(state))
    out["diffusers U1"] = (models["diffusers"], None)
    if "diffusers_compiled" in models:
        out["diffusers U1 compiled"] = (models["diffusers_compiled"], None)
    return out


def ratios(degree: int) -> list[tuple[str, str, str]]:
    """(numerator, denominator, target) of the ratio table."""
    u = f"ours U{degree}"
    return [
        (f"ours U1{DEFAULT}", "diffusers U1 compiled", "at most 0.95"),
        ("ours U1", "diffusers U1", ""),
        (f"{u} trim", f"{u} none", "at most 1.01"),
        (f"{u} mask", f"{u} none", "reported"),
        (f"{u} trim{DEFAULT}", f"ours U1{DEFAULT}", ""),
    ]


def parse_layers(text: str | None, config: dict) -> dict:
    """'D,S': D double-stream and S single-stream blocks (a smoke run); None: the model's own."""
    if text is None:
        return config
    double, _, single = text.partition(",")
    return dict(config, num_layers=int(double), num_single_layers=int(single or double))


def write_docs(rows: list[dict], path: Path) -> None:
    first = rows[0]
    model, degree, simulated = first["model"], first["degree"], "simulated" in first["setup"]
    sizes = [size for size in SIZES if any(row["size"] == size for row in rows)]
    header = [f"{size} ({SIZES[size] ** 2} tokens, pad {-(SIZES[size] ** 2) % degree})" for size in sizes]
    lines = [
        f"## FLUX.2 klein {model.upper()} transformer, one forward (ours U1 / U{degree} vs diffusers)",
        "",
        f"Real dimensions ({first['layers']} blocks), random bf16 weights shared by every variant, text "
        f"{TEXT_LEN} tokens, batch 1, {first['device']}; {first['setup']}. `default`: compiled blocks and "
        "CUDA graphs, as the engine runs it; `compiled`: diffusers' `compile_repeated_blocks(fullgraph=True)`. "
        "Median ms, variants interleaved; in brackets, bf16 agreement with ours U1 (PSNR, max abs diff).",
        "",
        *forward_tables(rows, sizes, header, ratios(degree)),
    ]
    key = f"flux2_klein_sp_{model}_{'simulated' if simulated else 'nccl'}_u{degree}"
    replace_section(path, key, "\n".join(lines), script="flux2_klein_sp")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", choices=sorted(CONFIGS), default="4b")
    add_rank_args(parser, iters=10, warmup=2)
    parser.add_argument("--layers", default=None, help="D,S blocks for a smoke run (default: the model's)")
    parser.add_argument("--sizes", nargs="+", choices=list(SIZES), default=list(SIZES))
    parser.add_argument("--eager-only", action="store_true", help="skip ours default and diffusers compiled")
    parser.add_argument("--out", type=Path, default=None)
    add_docs_phase(parser)
    args = parser.parse_args(argv)
    out = args.out or ROOT / f"benchmarks/results/flux2_klein_sp_{args.model}.json"
    if args.phase == "docs":
        write_docs(load_json(out), args.docs)
        return
    if not torch.cuda.is_available():
        sys.exit("flux2_klein_sp.py needs a CUDA GPU")

    config = parse_layers(args.layers, CONFIGS[args.model])
    parallel = init_parallel(args.simulate, args.degree)
    device, degree = parallel.device, parallel.state.config.ulysses_degree
    check_heads(config["num_attention_heads"], degree)
    models = build_models(config, device, compiled=not args.eager_only)
    rows = time_sizes(
        parallel,
        args.sizes,
        lambda size: variants(models, parallel.state, degree, parallel.simulated),
        lambda size: make_inputs(config, SIZES[size], device),
        lambda size: dict(model=args.model, size=size),
        f"{config['num_layers']}+{config['num_single_layers']}",
        args.iters,
        args.warmup,
    )
    end_run(parallel, lambda: (save_json(out, rows), write_docs(rows, args.docs)))


if __name__ == "__main__":
    main()
