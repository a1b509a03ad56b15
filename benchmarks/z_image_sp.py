"""Z-Image (Turbo) transformer, one forward: ours against diffusers, and a simulated Ulysses rank's padding modes.

Real dimensions: diffusers 0.42.1's `ZImageTransformer2DModel` defaults, which are Z-Image(-Turbo)'s
transformer/config.json (30 main + 2 x 2 refiner blocks, 30 heads x 128 = 3840 wide, FFN 10240,
cap_feat_dim 2560 = Qwen3-4B's hidden size, 16 latent channels in 2x2 patches, rotary axes
(32, 48, 48) with theta 256; 6.2B parameters), random bf16 weights built on the GPU, shared by
every variant. The caption is 100 tokens (the pipeline passes only a prompt's valid tokens; the
model pads them to 128). The model pads both streams to multiples of 32 itself, so Ulysses 2, 4
and 8 never pad; and Ulysses 8 does not divide 30 heads (nor does 4). The nearest degree on an
8-GPU node is 6: at 1024x1024 (4096 image tokens) it pads 2 image and 4 caption tokens, at
1264x1264 (6241 tokens, 6272 with the model's padding) 4 and 4. The driver is harness/sp_forward.py.

    python benchmarks/z_image_sp.py --simulate --degree 6 --compile     # one GPU: U1 vs diffusers, U6 rank
    python benchmarks/z_image_sp.py --simulate --degree 6 --layers 2 --iters 2 --sizes 1024x1024  # smoke test

Targets: `ours U1 compiled graph` / `diffusers U1 compiled` (ours default against diffusers compiled)
at most 0.95; at the simulated U6 rank, trim / none at most 1.01. Only simulated runs: diffusers
0.42.1 has no context-parallel plan for Z-Image to compare real ranks with.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.sp_forward import ForwardBenchmark, build_shared_models, main  # noqa: E402
from vllm_omni.diffusion.models.z_image.transformer import ZImageTransformer2DModel  # noqa: E402

# diffusers 0.42.1 ZImageTransformer2DModel.__init__ defaults (Tongyi-MAI/Z-Image-Turbo's transformer).
REAL_CONFIG = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=16,
    dim=3840,
    n_layers=30,
    n_refiner_layers=2,
    n_heads=30,
    n_kv_heads=30,
    norm_eps=1e-5,
    qk_norm=True,
    cap_feat_dim=2560,
    rope_theta=256.0,
    t_scale=1000.0,
    axes_dims=[32, 48, 48],
    axes_lens=[1024, 512, 512],
)
TEXT_LEN = 100  # valid caption tokens (chat template included); the model pads them to 128
SIZES = {"1024x1024": 64, "1264x1264": 79}  # image token grid side (16 pixels a token)


def parse_layers(text: str) -> tuple[dict[str, int], str]:
    """'N': N main blocks (the 2 + 2 refiner blocks stay)."""
    return {"n_layers": int(text)}, text


def build_models(device: torch.device, simulate: bool, overrides: dict[str, int]):
    from diffusers import ZImageTransformer2DModel as Reference

    # The rotary tables are built on first use, on the forward's device: nothing to finish on the copies.
    return build_shared_models(Reference, ZImageTransformer2DModel, dict(REAL_CONFIG, **overrides), device, simulate)


def make_inputs(side: int, device: torch.device) -> dict:
    gen = torch.Generator(device).manual_seed(1)
    latent = 2 * side  # 2x2 patches of the VAE's latent grid
    return dict(
        x=[torch.randn(16, 1, latent, latent, generator=gen, device=device, dtype=torch.bfloat16)],
        t=torch.full((1,), 0.5, device=device, dtype=torch.bfloat16),  # the pipeline passes (1000 - t) / 1000
        cap_feats=[
            torch.randn(TEXT_LEN, REAL_CONFIG["cap_feat_dim"], generator=gen, device=device, dtype=torch.bfloat16)
        ],
        return_dict=False,
    )


BENCHMARK = ForwardBenchmark(
    key="z_image_sp",
    title="Z-Image(-Turbo) transformer, one forward (ours vs diffusers, simulated Ulysses rank)",
    dims=f"Real dimensions (30 + 2 x 2 refiner blocks, 30 heads x 128), caption {TEXT_LEN} tokens",
    sizes=SIZES,
    default_layers=str(REAL_CONFIG["n_layers"]),
    parse_layers=parse_layers,
    build_models=build_models,
    make_inputs=make_inputs,
)

if __name__ == "__main__":
    if "--simulate" not in sys.argv[1:] and not {"-h", "--help"} & set(sys.argv[1:]):
        sys.exit("z_image_sp.py runs --simulate only: diffusers has no context-parallel plan for Z-Image")
    main(BENCHMARK, __doc__)
