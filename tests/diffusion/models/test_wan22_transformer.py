"""Our Wan2.2 transformer against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32. Three
shapes: A14B text-to-video (16 latent channels in), A14B image-to-video (36: latents, the
first-frame mask, the condition latents) and TI2V-5B (48 channels, one timestep per token, as
`expand_timesteps` passes). Text is always 512 tokens, as the pipelines pad it.
"""

from __future__ import annotations

import dataclasses

import conformance
import pytest
import torch
from diffusers import WanTransformer3DModel as ReferenceTransformer
from sp_cases import sp_mode, worker_model

from vllm_omni.diffusion.models.wan22.transformer import WanTransformer3DModel

TEXT_DIM, TEXT_LEN = 32, 512
BASE = dict(
    patch_size=(1, 2, 2),
    num_attention_heads=6,
    attention_head_dim=16,
    text_dim=TEXT_DIM,
    freq_dim=32,
    ffn_dim=64,
    num_layers=2,
    cross_attn_norm=True,
    qk_norm="rms_norm_across_heads",
    rope_max_seq_len=64,
)
CONFIGS = {
    "a14b": dict(BASE, in_channels=16, out_channels=16),
    "a14b_i2v": dict(BASE, in_channels=36, out_channels=16),
    "5b": dict(BASE, in_channels=48, out_channels=48),
}
# Latent grids (frames, height, width) and their tokens after 1x2x2 patches.
GRIDS = {
    "pad23": (5, 10, 14),  # 175 tokens: 2 and 3 ranks pad
    "pad2": (3, 10, 14),  # 105: 2 ranks pad
    "divisible": (2, 6, 6),  # 18
}


@dataclasses.dataclass(frozen=True)
class Case:
    config: str = "a14b"
    grid: tuple[int, int, int] = GRIDS["pad23"]
    batch: int = 1


def make_inputs(case: Case, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    frames, height, width = case.grid
    channels = CONFIGS[case.config]["in_channels"]
    if case.config == "5b":
        # One timestep per token, the first frame's tokens at 0 (what image-to-video passes), the rest apart.
        tokens = frames * (height // 2) * (width // 2)
        timestep = torch.rand(case.batch, tokens, generator=gen) * 1000
        timestep[:, : (height // 2) * (width // 2)] = 0
    else:
        timestep = torch.rand(case.batch, generator=gen) * 1000
    text = torch.randn(case.batch, TEXT_LEN, TEXT_DIM, generator=gen)
    text[:, 9:] = 0  # the pipeline's zero padding after the prompt's tokens; it still counts
    return dict(
        hidden_states=torch.randn(case.batch, channels, frames, height, width, generator=gen),
        timestep=timestep,
        encoder_hidden_states=text,
        return_dict=False,
    )


def make_models(config: str, folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = conformance.save_reference(ReferenceTransformer(**CONFIGS[config]).eval(), folder)
    return ref, WanTransformer3DModel.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {config: str(tmp_path_factory.mktemp(f"wan22_{config}")) for config in CONFIGS}


@pytest.fixture(scope="module")
def models(checkpoints):
    return {config: make_models(config, folder) for config, folder in checkpoints.items()}


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


PARITY_CASES = {
    "a14b": Case(),
    "a14b_batch2": Case(batch=2),
    "a14b_i2v": Case("a14b_i2v"),
    "5b_per_token_timestep": Case("5b"),
    "5b_batch2": Case("5b", GRIDS["pad2"], batch=2),
}


@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_matches_diffusers_reference(models, name):
    case = PARITY_CASES[name]
    ref, ours = models[case.config]
    inputs = make_inputs(case)
    torch.testing.assert_close(run(ours, inputs), run(ref, inputs), rtol=0, atol=1e-5)


def test_parameter_names_and_config_are_the_checkpoints(models):
    conformance.assert_parameter_names_are_the_checkpoints(*models["a14b"], config="public")


def test_attention_kinds_are_declared(models):
    """Self-attention is joint (one stream, through the Ulysses layer); text enters by cross-attention."""
    _, ours = models["a14b"]
    for block in ours.blocks:
        assert block.attn1.processor.attention.kind == "joint"
        assert block.attn2.processor.attention.kind == "cross"


def fused_model(folder: str) -> WanTransformer3DModel:
    """Ours from `folder`, its attention projections fused by diffusers' `fuse_qkv_projections`."""
    model = WanTransformer3DModel.from_pretrained(folder).eval()
    model.fuse_qkv_projections()
    return model


def test_fused_projections_match_unfused(models, checkpoints):
    """diffusers' fused projections (to_qkv in self-attention, to_kv in cross-attention) and back."""
    ref, _ = models["a14b"]
    model = fused_model(checkpoints["a14b"])
    assert all(hasattr(b.attn1, "to_qkv") and hasattr(b.attn2, "to_kv") for b in model.blocks)
    inputs = make_inputs(Case())
    expected = run(ref, inputs)
    torch.testing.assert_close(run(model, inputs), expected, rtol=0, atol=1e-5)
    model.unfuse_qkv_projections()
    assert not any(b.attn1.fused_projections or b.attn2.fused_projections for b in model.blocks)
    torch.testing.assert_close(run(model, inputs), expected, rtol=0, atol=1e-5)


def test_wan21_image_conditioning_is_refused():
    with pytest.raises(ValueError, match="image_dim"):
        WanTransformer3DModel(**dict(CONFIGS["a14b_i2v"], image_dim=32, added_kv_proj_dim=96))


# ---- under SP (gloo workers) ----------------------------------------------------------------

SP_CASES = {
    "a14b": Case(),  # 175 tokens: pads at 2 and 3
    "a14b_i2v_batch2": Case("a14b_i2v", GRIDS["pad2"], batch=2),  # 105: pads at 2
    "5b": Case("5b"),  # per-token timestep sharded with the video
}


def sp_forward(
    folder: str, case: Case, mode: str, random_padding: bool = False, fused: bool = False
) -> tuple[torch.Tensor, list[str]]:
    """Worker side: our forward under the worker's SP group in `mode` (`fused`: projections fused); the output
    and the warnings logged."""
    model = worker_model(fused_model if fused else WanTransformer3DModel.from_pretrained, folder)
    with sp_mode(mode, random_padding, reset_warnings=True) as warnings:
        return run(model, make_inputs(case)), warnings


def on_pool(sp_pool, checkpoints: dict[str, str], case: Case):
    """`sp_forward` on the pool's ranks, with the checkpoint of `case`'s config, as conformance's checks call it."""
    return lambda mode, random_padding: sp_pool.run(sp_forward, checkpoints[case.config], case, mode, random_padding)


@pytest.mark.parametrize("case", list(SP_CASES))
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoints, case):
    config = SP_CASES[case].config
    expected = run(models[config][1], make_inputs(SP_CASES[case]))
    conformance.assert_sp_exact_modes_match(on_pool(sp_pool, checkpoints, SP_CASES[case]), expected)


def test_sp_fused_projections_match_single_process(sp_pool, models, checkpoints):
    case = SP_CASES["a14b"]
    expected = run(models["a14b"][1], make_inputs(case))
    for out, _ in sp_pool.run(sp_forward, checkpoints["a14b"], case, "trim", fused=True):
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoints, mode):
    """Random values in the padded video rows, rotary rows and (5B) per-token timesteps."""
    for case in ("a14b", "5b"):
        conformance.assert_sp_padding_content_never_reaches_real_tokens(
            on_pool(sp_pool, checkpoints, SP_CASES[case]), mode
        )


def test_sp_unmasked_padding_is_close_but_not_equal_and_warns(sp_pool, models, checkpoints):
    case = SP_CASES["a14b"]
    expected = run(models["a14b"][1], make_inputs(case))
    conformance.assert_sp_unmasked_padding_is_close_but_not_equal(
        on_pool(sp_pool, checkpoints, case), expected, sp_pool.world_size
    )
    # A divisible grid has no padding: none mode is exact and silent.
    case = Case(grid=GRIDS["divisible"])
    expected = run(models["a14b"][1], make_inputs(case))
    conformance.assert_sp_none_mode_exact_without_padding(on_pool(sp_pool, checkpoints, case), expected, silent=True)


# ---- under ring attention (USP: ring_pool) ------------------------------------------------------------


def test_ring_matches_single_process_at_padded_sizes(ring_pool, models, checkpoints):
    """175 video tokens pad inside a ring block at ring 2, ring 3 and Ulysses 2 x ring 2: self-attention goes
    around the ring, cross-attention keeps the rank's query rows against the whole text; the 5B's per-token
    timesteps travel with the video."""
    case = SP_CASES["a14b"]
    expected = run(models["a14b"][1], make_inputs(case))
    conformance.assert_ring_conformance(on_pool(ring_pool, checkpoints, case), expected, ring_pool.ring_degree)
    case = SP_CASES["5b"]
    expected = run(models["5b"][1], make_inputs(case))
    for out, _ in ring_pool.run(sp_forward, checkpoints["5b"], case, "trim"):
        conformance.assert_close(out, expected)
