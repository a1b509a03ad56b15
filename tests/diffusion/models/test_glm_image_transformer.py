"""Our GLM-Image DiT against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32. The
pipeline's two passes: cond (the glyph embeddings of the prompt's quoted text, prior tokens kept)
and uncond (the glyph text "": one token, every prior token dropped). Their text lengths differ,
so at Ulysses 2 and 3 they pad differently.
"""

from __future__ import annotations

import dataclasses

import conformance
import pytest
import torch
from diffusers import GlmImageTransformer2DModel as ReferenceTransformer
from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache
from sp_cases import sp_mode, worker_model

from vllm_omni.diffusion.models.glm_image.transformer import GlmImageTransformer2DModel

TEXT_DIM, CODEBOOK, LATENT_CHANNELS = 32, 128, 16
CONFIG = dict(
    patch_size=2,
    in_channels=LATENT_CHANNELS,
    out_channels=LATENT_CHANNELS,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=6,
    text_embed_dim=TEXT_DIM,
    time_embed_dim=32,
    condition_dim=16,
    prior_vq_quantizer_codebook_size=CODEBOOK,
)


@dataclasses.dataclass(frozen=True)
class Case:
    """One DiT call: latent grid (H/8, W/8), glyph text length, uncond (every prior token dropped), batch,
    and the prior ids' shape."""

    latent: tuple[int, int] = (8, 8)  # 64x64 pixels: 16 image tokens, padded at Ulysses 3
    text_len: int = 5  # 'OPEN' (4 bytes and </s>): padded at 2 and 3
    uncond: bool = False
    batch: int = 1
    # "per_token" [B, N] (the pipeline's); shapes the reference broadcasts over the image tokens:
    # "single" [1] (diffusers' own model tests), "per_sample" [B, 1].
    prior: str = "per_token"


COND = Case()
UNCOND = Case(text_len=1, uncond=True)  # the glyph text "": one token, padded at 2 and 3
DIVISIBLE = Case(latent=(8, 12), text_len=6)  # 24 image and 6 text tokens: 2 and 3 divide both
PER_SAMPLE_PRIOR = Case(prior="per_sample", batch=2)


def make_inputs(case: Case, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    height, width = case.latent
    tokens = (height // 2) * (width // 2)
    prior_shape = {"per_token": (case.batch, tokens), "single": (1,), "per_sample": (case.batch, 1)}[case.prior]
    return dict(
        hidden_states=torch.randn(case.batch, LATENT_CHANNELS, height, width, generator=gen),
        encoder_hidden_states=torch.randn(case.batch, case.text_len, TEXT_DIM, generator=gen),
        prior_token_id=torch.randint(0, CODEBOOK, prior_shape, generator=gen),
        prior_token_drop=torch.full(prior_shape, case.uncond),
        timestep=torch.rand(case.batch, generator=gen) * 1000,
        target_size=torch.tensor([[height * 8.0, width * 8.0]] * case.batch),
        crop_coords=torch.zeros(case.batch, 2),
        # The pipeline passes a cache every time; text-to-image never sets its mode.
        kv_caches=GlmImageKVCache(num_layers=CONFIG["num_layers"]),
        return_dict=False,
    )


def run(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        return model(**inputs)[0]


checkpoint = conformance.checkpoint_fixture(ReferenceTransformer, CONFIG, "glm_image_dit")
models = conformance.models_fixture(ReferenceTransformer, GlmImageTransformer2DModel)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("case", [COND, UNCOND], ids=["cond", "uncond"])
def test_matches_diffusers_reference(models, case, batch):
    ref, ours = models
    inputs = make_inputs(dataclasses.replace(case, batch=batch))
    expected = run(ref, inputs)
    assert expected.shape == inputs["hidden_states"].shape
    torch.testing.assert_close(run(ours, inputs), expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    "case",
    [Case(prior="single"), PER_SAMPLE_PRIOR, dataclasses.replace(UNCOND, prior="per_sample", batch=2)],
    ids=["single", "per_sample", "per_sample_dropped"],
)
def test_prior_ids_that_broadcast_over_the_image_match_the_reference(models, case):
    """diffusers' model tests pass one prior id ([1]); the reference adds its embedding to every image token."""
    ref, ours = models
    inputs = make_inputs(case)
    torch.testing.assert_close(run(ours, inputs), run(ref, inputs), rtol=0, atol=1e-5)


def test_dropped_prior_tokens_change_the_output(models):
    """The uncond pass differs from the cond pass through the prior tokens alone (same text)."""
    _, ours = models
    inputs = make_inputs(COND)
    dropped = dict(inputs, prior_token_drop=torch.ones_like(inputs["prior_token_drop"]))
    assert (run(ours, inputs) - run(ours, dropped)).abs().max() > 1e-3


def test_parameter_names_and_config_are_the_checkpoints(models):
    conformance.assert_parameter_names_are_the_checkpoints(*models, config="public")


def test_a_text_mask_is_refused(models):
    _, ours = models
    inputs = make_inputs(COND)
    with pytest.raises(ValueError, match="attention_mask"):
        run(ours, dict(inputs, attention_mask=torch.ones(1, COND.text_len)))


# ---- image-to-image: the condition images' K/V cache ------------------------------------------

# Condition latent grids: 1 x 7 tokens (padded at Ulysses 2 and 3), 2 x 3 (divisible by both).
CONDITIONS = ((2, 14), (4, 6))


def condition_inputs(latent: tuple[int, int], seed: int) -> dict:
    """The pipeline's write pass for one condition image: no text, its AR tokens ([N], one row), timestep 0."""
    gen = torch.Generator().manual_seed(seed)
    height, width = latent
    tokens = (height // 2) * (width // 2)
    ids = torch.randint(0, CODEBOOK, (tokens,), generator=gen)
    return dict(
        hidden_states=torch.randn(1, LATENT_CHANNELS, height, width, generator=gen),
        encoder_hidden_states=torch.zeros(1, 0, TEXT_DIM),
        prior_token_id=ids,
        prior_token_drop=torch.zeros_like(ids, dtype=torch.bool),
        timestep=torch.zeros(1),
        target_size=torch.tensor([[height * 8.0, width * 8.0]]),
        crop_coords=torch.zeros(1, 2),
    )


def run_with_conditions(model, conditions=CONDITIONS, batch: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """As the pipeline runs a step of image-to-image: write the conditions, then cond ("read") and uncond ("skip")."""
    caches = GlmImageKVCache(num_layers=CONFIG["num_layers"])
    caches.set_mode("write")
    for i, latent in enumerate(conditions):
        run(model, dict(condition_inputs(latent, 10 + i), kv_caches=caches))
    caches.set_mode("read")
    cond = run(model, dict(make_inputs(dataclasses.replace(COND, batch=batch)), kv_caches=caches))
    caches.set_mode("skip")
    uncond = run(model, dict(make_inputs(dataclasses.replace(UNCOND, batch=batch)), kv_caches=caches))
    return cond, uncond


@pytest.mark.parametrize("batch", [1, 2])
def test_image_to_image_matches_diffusers_reference(models, batch):
    """Two condition images cached, then read by a cond pass (batch 2: the one cached sample serves both)."""
    ref, ours = models
    expected = run_with_conditions(ref, batch=batch)
    for actual, wanted in zip(run_with_conditions(ours, batch=batch), expected):
        torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-5)
    # The condition reaches the cond pass only.
    assert (expected[0] - run(ref, make_inputs(dataclasses.replace(COND, batch=batch)))).abs().max() > 1e-3


# ---- under SP (gloo workers) ----------------------------------------------------------------


def sp_forward(folder: str, case: Case, mode: str, random_padding: bool = False) -> tuple[torch.Tensor, list[str]]:
    """Worker side: our forward under the worker's SP group in `mode`; the output and the warnings logged.

    With `random_padding`, every padded row is random: image tokens, rotary rows, prior token ids
    and drop flags, glyph text."""
    model = worker_model(GlmImageTransformer2DModel.from_pretrained, folder)
    with sp_mode(mode, random_padding, reset_warnings=True) as warnings:
        return run(model, make_inputs(case)), warnings


def sp_image_to_image(folder: str, mode: str, random_padding: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Worker side: `run_with_conditions` under the worker's SP group in `mode` (random padding in every pass)."""
    model = worker_model(GlmImageTransformer2DModel.from_pretrained, folder)
    with sp_mode(mode, random_padding):
        return run_with_conditions(model)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_image_to_image_matches_single_process_whatever_the_padding(sp_pool, models, checkpoint, mode):
    """Each rank caches its shard of the conditions' keys and values, padding included; read back, the
    padding stays out of every real token (random padding gives the same bits)."""
    expected = run_with_conditions(models[1])
    clean = sp_pool.run(sp_image_to_image, checkpoint, mode)
    for outs in clean:
        for actual, wanted in zip(outs, expected):
            torch.testing.assert_close(actual, wanted, rtol=0, atol=1e-5)
    noisy = sp_pool.run(sp_image_to_image, checkpoint, mode, True)
    for a, b in zip(clean, noisy):
        assert all(torch.equal(x, y) for x, y in zip(a, b))


SP_CASES = {
    "cond": COND,
    "uncond_batch2": dataclasses.replace(UNCOND, batch=2),
    "per_sample_prior_batch2": PER_SAMPLE_PRIOR,  # broadcast to the image stream, then sharded with it
}


def on_pool(sp_pool, checkpoint: str, case: Case):
    """`sp_forward` on the pool's ranks as conformance's checks call it."""
    return lambda mode, random_padding: sp_pool.run(sp_forward, checkpoint, case, mode, random_padding)


@pytest.mark.parametrize("name", list(SP_CASES))
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoint, name):
    case = SP_CASES[name]
    conformance.assert_sp_exact_modes_match(on_pool(sp_pool, checkpoint, case), run(models[1], make_inputs(case)))


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoint, mode):
    for case in (COND, UNCOND, PER_SAMPLE_PRIOR):
        conformance.assert_sp_padding_content_never_reaches_real_tokens(on_pool(sp_pool, checkpoint, case), mode)


def test_sp_unmasked_padding_is_close_but_not_equal_and_warns(sp_pool, models, checkpoint):
    expected = run(models[1], make_inputs(COND))
    conformance.assert_sp_unmasked_padding_is_close_but_not_equal(
        on_pool(sp_pool, checkpoint, COND), expected, sp_pool.world_size
    )
    # Divisible streams have no padding: none mode is exact and silent.
    expected = run(models[1], make_inputs(DIVISIBLE))
    conformance.assert_sp_none_mode_exact_without_padding(
        on_pool(sp_pool, checkpoint, DIVISIBLE), expected, silent=True
    )
