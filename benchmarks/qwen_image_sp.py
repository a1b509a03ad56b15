"""Qwen-Image transformer, one forward: our Ulysses SP against diffusers' context parallelism.

Real dimensions (60 layers, 24 heads x 128, joint_attention_dim 3584; 20.4B parameters) with
random bf16 weights built on the GPU; every variant shares the same weight tensors. At
1024x1024 (4096 image tokens) and 1328x1328 (6889, padded at U2) it times, interleaved:
ours U1, ours U2 in trim / none / mask, diffusers U1, diffusers Ulysses U2 and diffusers
Ulysses-anything U2, and our forwards replayed as CUDA graphs (what the engine runs on GPUs),
and reports how closely each output agrees with ours at U1. The driver is harness/sp_forward.py.

    torchrun --nproc_per_node 2 benchmarks/qwen_image_sp.py     # two GPUs, real NCCL all-to-alls
    python benchmarks/qwen_image_sp.py --simulate               # one GPU: rank 0 of a simulated U2

The simulated rank does a real U2 rank's compute (linear layers on half the tokens, attention
over the whole sequence with half the heads) but its all-to-alls are local copies: it omits
the communication cost, and diffusers' CP cannot run that way.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.sp_forward import ForwardBenchmark, build_shared_models, main  # noqa: E402
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


def parse_layers(text: str) -> tuple[dict[str, int], int]:
    return {"num_layers": int(text)}, int(text)


def build_models(device: torch.device, simulate: bool, overrides: dict[str, int]):
    from diffusers import QwenImageTransformer2DModel as Reference

    config = dict(REAL_CONFIG, **overrides)

    def rotary_for_real(model, reference):
        # Rotary tables are plain tensors (not parameters), left on meta: build them for real.
        model.pos_embed = type(reference.pos_embed)(
            theta=10000, axes_dim=list(config["axes_dims_rope"]), scale_rope=True
        )

    return build_shared_models(Reference, QwenImageTransformer2DModel, config, device, simulate, rotary_for_real)


def make_inputs(side: int, device: torch.device) -> dict:
    gen = torch.Generator(device).manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, side * side, 64, generator=gen, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, TEXT_LEN, 3584, generator=gen, device=device, dtype=torch.bfloat16),
        timestep=torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),
        img_shapes=[[(1, side, side)]],
        return_dict=False,
    )


BENCHMARK = ForwardBenchmark(
    key="qwen_image_sp",
    title="Qwen-Image transformer, one forward (ours vs diffusers context parallelism)",
    dims=f"Real dimensions (60 layers, 24 heads x 128), text {TEXT_LEN} tokens",
    sizes=SIZES,
    default_layers=str(REAL_CONFIG["num_layers"]),
    parse_layers=parse_layers,
    build_models=build_models,
    make_inputs=make_inputs,
)

if __name__ == "__main__":
    main(BENCHMARK, __doc__)
