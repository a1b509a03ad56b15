"""FLUX.2-dev transformer, one forward: our Ulysses SP against diffusers' context parallelism.

Real dimensions (FLUX.2-dev's transformer/config.json, which are also diffusers' defaults for
`Flux2Transformer2DModel`: 8 double-stream + 48 single-stream blocks, 48 heads x 128 = 6144
wide, MLP ratio 3, joint_attention_dim 15360 = 3 stacked Mistral Small 3.1 layers of 5120,
128 input channels = 32 latent channels in 2x2 patches, rotary axes (32, 32, 32, 32) with
theta 2000, guidance embedding; 32.2B parameters) with random bf16 weights built on the GPU,
shared by every variant. The text stream is the pipeline's fixed 512 tokens. At 1024x1024
(4096 image tokens) and 1328x1328 (6889, padded at U2) it times, interleaved: ours U1, ours U2
in trim / none / mask, diffusers U1, diffusers Ulysses U2 and diffusers Ulysses-anything U2,
and our forwards replayed as CUDA graphs (what the engine runs on GPUs), and reports how
closely each output agrees with ours at U1. The driver is harness/sp_forward.py.

    torchrun --nproc_per_node 2 benchmarks/flux2_sp.py          # two GPUs, real NCCL all-to-alls
    python benchmarks/flux2_sp.py --simulate                    # one GPU: rank 0 of a simulated U2
    python benchmarks/flux2_sp.py --simulate --layers 1,2 --iters 2 --sizes 1024x1024   # smoke test

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
from vllm_omni.diffusion.models.flux2.transformer import Flux2Transformer2DModel  # noqa: E402

# black-forest-labs/FLUX.2-dev transformer/config.json (equal to the diffusers 0.42.1 defaults).
REAL_CONFIG = dict(
    patch_size=1,
    in_channels=128,
    out_channels=None,
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=True,
)
TEXT_LEN = 512  # Flux2Pipeline pads every prompt to max_sequence_length=512
GUIDANCE = 4.0  # the pipeline's default embedded guidance
SIZES = {"1024x1024": 64, "1328x1328": 83}  # latent grid side (16 pixels a token)


def parse_layers(text: str) -> tuple[dict[str, int], str]:
    """'D,S': D double-stream and S single-stream blocks; 'N': N of each."""
    double, _, single = text.partition(",")
    counts = {"num_layers": int(double), "num_single_layers": int(single or double)}
    return counts, f"{counts['num_layers']}+{counts['num_single_layers']}"


def build_models(device: torch.device, simulate: bool, overrides: dict[str, int]):
    from diffusers import Flux2Transformer2DModel as Reference

    # FLUX.2 has no non-parameter tensors (rotary tables are computed per forward): nothing to finish.
    return build_shared_models(Reference, Flux2Transformer2DModel, dict(REAL_CONFIG, **overrides), device, simulate)


def _position_ids(t: int, h: int, w: int, length: int, device: torch.device) -> torch.Tensor:
    """(T, H, W, L) ids as Flux2Pipeline builds them, [1, h * w * length, 4]."""
    ranges = [torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(length)]
    return torch.cartesian_prod(*ranges).unsqueeze(0).to(device)


def make_inputs(side: int, device: torch.device) -> dict:
    gen = torch.Generator(device).manual_seed(1)
    in_channels, text_dim = REAL_CONFIG["in_channels"], REAL_CONFIG["joint_attention_dim"]
    return dict(
        hidden_states=torch.randn(1, side * side, in_channels, generator=gen, device=device, dtype=torch.bfloat16),
        encoder_hidden_states=torch.randn(1, TEXT_LEN, text_dim, generator=gen, device=device, dtype=torch.bfloat16),
        timestep=torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),  # the pipeline passes t / 1000
        img_ids=_position_ids(0, side, side, 1, device),
        txt_ids=_position_ids(0, 1, 1, TEXT_LEN, device),
        guidance=torch.full((1,), GUIDANCE, device=device, dtype=torch.float32),
        return_dict=False,
    )


BENCHMARK = ForwardBenchmark(
    key="flux2_sp",
    title="FLUX.2-dev transformer, one forward (ours vs diffusers context parallelism)",
    dims=f"Real dimensions (8 double + 48 single blocks, 48 heads x 128), text {TEXT_LEN} tokens",
    sizes=SIZES,
    default_layers=f"{REAL_CONFIG['num_layers']},{REAL_CONFIG['num_single_layers']}",
    parse_layers=parse_layers,
    build_models=build_models,
    make_inputs=make_inputs,
)

if __name__ == "__main__":
    main(BENCHMARK, __doc__)
