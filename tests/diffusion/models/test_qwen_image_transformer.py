"""Our Qwen-Image transformer against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32.
"""

from __future__ import annotations

import contextlib

import conformance
import pytest
import torch
from diffusers import QwenImageTransformer2DModel as ReferenceTransformer
from sp_cases import sp_mode, worker_model

from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel
from vllm_omni.logger import reset_warning_once

CONFIG = dict(
    patch_size=2,
    in_channels=64,
    out_channels=16,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=6,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)
# Grids whose token counts 2 and 3 do not divide (35, 35 + 24, 35 + 24 + 9), and a divisible one.
CASES = {
    "generate": ([(1, 5, 7)], False),
    "edit": ([(1, 5, 7), (1, 4, 6)], False),
    "edit_plus": ([(1, 5, 7), (1, 4, 6), (1, 3, 3)], True),
    "divisible": ([(1, 6, 6)], False),
}


def make_models(zero_cond_t: bool, folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = ReferenceTransformer(**CONFIG, zero_cond_t=zero_cond_t).eval()
    # Random modulation/output weights: diffusers zero-initialises nothing here, but be explicit.
    conformance.save_reference(ref, folder)
    ours = QwenImageTransformer2DModel.from_pretrained(folder).eval()
    return ref, ours


def make_inputs(img_shapes, batch: int, text_len: int, seed: int = 1):
    gen = torch.Generator().manual_seed(seed)
    image_len = sum(f * h * w for f, h, w in img_shapes)
    return dict(
        hidden_states=torch.randn(batch, image_len, CONFIG["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, text_len, CONFIG["joint_attention_dim"], generator=gen),
        timestep=torch.rand(batch, generator=gen),
        img_shapes=[img_shapes] * batch,
        return_dict=False,
    )


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {zero: make_models(zero, tmp_path_factory.mktemp(f"qwen_zero{int(zero)}")) for zero in (False, True)}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("batch", [1, 2])
def test_matches_diffusers_reference(models, case, batch):
    img_shapes, zero_cond_t = CASES[case]
    ref, ours = models[zero_cond_t]
    inputs = make_inputs(img_shapes, batch, text_len=11)
    with torch.no_grad():
        expected = ref(**inputs)[0]
        actual = ours(**inputs)[0]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_parameter_names_are_the_checkpoints(models):
    conformance.assert_parameter_names_are_the_checkpoints(*models[False], config=None)


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_text_mask_with_padding_matches_reference(models, zero_cond_t):
    img_shapes = CASES["edit_plus" if zero_cond_t else "generate"][0]
    ref, ours = models[zero_cond_t]
    inputs = make_inputs(img_shapes, 2, text_len=11)
    # Same padding in both rows (compacted together), then different padding per row.
    for mask_rows in ([[1] * 8 + [0] * 3] * 2, [[1] * 8 + [0] * 3, [1] * 5 + [0] * 6]):
        mask = torch.tensor(mask_rows)
        with torch.no_grad():
            expected = ref(**inputs, encoder_hidden_states_mask=mask)[0]
            actual = ours(**inputs, encoder_hidden_states_mask=mask)[0]
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


# ---- under SP (gloo workers) ----------------------------------------------------------------


def sp_forward(folder: str, case: str, mode: str, batch: int, text_len: int, mask_rows=None, random_padding=False):
    """Worker side: our transformer's forward under the worker's SP group in the given padding mode."""
    model = worker_model(QwenImageTransformer2DModel.from_pretrained, folder)
    inputs = make_inputs(CASES[case][0], batch, text_len)
    if mask_rows is not None:
        inputs["encoder_hidden_states_mask"] = torch.tensor(mask_rows)
    with sp_mode(mode, random_padding), torch.no_grad():
        return model(**inputs)[0]


@pytest.fixture(scope="module")
def checkpoints(models, tmp_path_factory):
    folders = {}
    for zero, (ref, _) in models.items():
        folder = tmp_path_factory.mktemp(f"ckpt{int(zero)}")
        ref.save_pretrained(folder)
        folders[zero] = str(folder)
    return folders


def on_pool(sp_pool, folder: str, case: str, batch: int, text_len: int):
    """`sp_forward` on the pool's ranks as conformance's checks call it (it records no warnings: None)."""
    return lambda mode, random_padding: [
        (out, None) for out in sp_pool.run(sp_forward, folder, case, mode, batch, text_len, None, random_padding)
    ]


@pytest.mark.parametrize("case", ["generate", "edit", "edit_plus"])
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoints, case):
    zero = CASES[case][1]
    _, ours = models[zero]
    for batch, text_len in ((1, 11), (2, 7)):
        inputs = make_inputs(CASES[case][0], batch, text_len)
        with torch.no_grad():
            expected = ours(**inputs)[0]
        sp = on_pool(sp_pool, checkpoints[zero], case, batch, text_len)
        conformance.assert_sp_exact_modes_match(sp, expected, silent=False)


def test_sp_with_text_mask_matches_reference(sp_pool, models, checkpoints):
    ref, _ = models[False]
    inputs = make_inputs(CASES["generate"][0], 2, 11)
    for rows in ([[1] * 8 + [0] * 3] * 2, [[1] * 8 + [0] * 3, [1] * 5 + [0] * 6]):
        with torch.no_grad():
            expected = ref(**inputs, encoder_hidden_states_mask=torch.tensor(rows))[0]
        for out in sp_pool.run(sp_forward, checkpoints[False], "generate", "trim", 2, 11, mask_rows=rows):
            torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


# Prompts of 8 and 5 tokens padded to 11: rows of different lengths in one batch (request batching).
RAGGED_MASK = [[1] * 8 + [0] * 3, [1] * 5 + [0] * 6]


def batched_and_alone(model: torch.nn.Module, mode: str | None = None) -> tuple[torch.Tensor, torch.Tensor, int]:
    """The two rows of RAGGED_MASK run as one batch and each alone (in SP `mode` on a worker), and how many
    transformer forwards the batch ran."""
    inputs = make_inputs(CASES["generate"][0], 2, 11)
    mask = torch.tensor(RAGGED_MASK)
    forwards = []
    hook = model.img_in.register_forward_hook(lambda *_: forwards.append(1))
    with sp_mode(mode) if mode else contextlib.nullcontext(), torch.no_grad():
        batched = model(**inputs, encoder_hidden_states_mask=mask)[0]
        count = len(forwards)
        alone = [model(**row_inputs(inputs, i), encoder_hidden_states_mask=mask[i : i + 1])[0] for i in range(2)]
    hook.remove()
    return batched, torch.cat(alone), count


def row_inputs(inputs: dict, i: int) -> dict:
    return {k: v[i : i + 1] if isinstance(v, (torch.Tensor, list)) else v for k, v in inputs.items()}


def sp_batched_and_alone(folder: str, mode: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    return batched_and_alone(worker_model(QwenImageTransformer2DModel.from_pretrained, folder), mode)


def test_rows_of_different_prompt_lengths_share_one_forward_and_equal_their_rows_alone(sp_pool, models, checkpoints):
    """fp32 to a few ulps, not bit for bit: the batch's GEMMs have other shapes (rows x tokens, the longest
    row's text bucket), so the BLAS may sum in another order; attention sees each row's exact keys."""
    results = [batched_and_alone(models[False][1])]
    for mode in ("mask", "trim"):
        results += sp_pool.run(sp_batched_and_alone, checkpoints[False], mode)
    for batched, alone, forwards in results:
        assert forwards == 1
        torch.testing.assert_close(batched, alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoints, mode):
    for case in ("edit", "edit_plus"):
        sp = on_pool(sp_pool, checkpoints[CASES[case][1]], case, 1, 7)
        conformance.assert_sp_padding_content_never_reaches_real_tokens(sp, mode)


def test_sp_unmasked_padding_is_close_but_not_equal(sp_pool, models, checkpoints):
    _, ours = models[False]
    inputs = make_inputs(CASES["generate"][0], 1, 11)
    with torch.no_grad():
        expected = ours(**inputs)[0]
    sp_pool.run(reset_warning_once)
    sp = on_pool(sp_pool, checkpoints[False], "generate", 1, 11)
    conformance.assert_sp_unmasked_padding_is_close_but_not_equal(sp, expected, world_size=None)
    # The divisible grid has no padding: none mode is then exact.
    inputs = make_inputs(CASES["divisible"][0], 1, 12)
    with torch.no_grad():
        expected = ours(**inputs)[0]
    sp = on_pool(sp_pool, checkpoints[False], "divisible", 1, 12)
    conformance.assert_sp_none_mode_exact_without_padding(sp, expected, silent=False)


# ---- under ring attention (USP: ring_pool) ------------------------------------------------------------


def test_ring_matches_single_process_at_padded_sizes(ring_pool, models, checkpoints):
    """35 image and 11 text tokens pad inside a ring block at ring 2, ring 3 and Ulysses 2 x ring 2; the
    Edit-Plus layout's modulation index travels with the image; rows with prompts of 8 and 5 tokens (the
    text's filler and each row's tail in other blocks than the padding) equal the reference."""
    _, ours = models[False]
    with torch.no_grad():
        expected = ours(**make_inputs(CASES["generate"][0], 1, 11))[0]
    conformance.assert_ring_conformance(on_pool(ring_pool, checkpoints[False], "generate", 1, 11), expected, None)
    inputs = make_inputs(CASES["edit_plus"][0], 2, 7)
    with torch.no_grad():
        expected = models[True][1](**inputs)[0]
    for out in ring_pool.run(sp_forward, checkpoints[True], "edit_plus", "trim", 2, 7):
        conformance.assert_close(out, expected)
    ref, _ = models[False]
    inputs = make_inputs(CASES["generate"][0], 2, 11)
    with torch.no_grad():
        expected = ref(**inputs, encoder_hidden_states_mask=torch.tensor(RAGGED_MASK))[0]
    for mode in ("mask", "trim"):
        for out in ring_pool.run(sp_forward, checkpoints[False], "generate", mode, 2, 11, mask_rows=RAGGED_MASK):
            conformance.assert_close(out, expected)


# ---- text longer than diffusers' rotary table ------------------------------------------------------

LONG_TEXT = 4100  # diffusers' table has 4096 positions; the 5x7 grid's text starts at position 3


def _reference_with_longer_table(folder: str) -> torch.nn.Module:
    """The reference with a rotary table long enough for LONG_TEXT: what it would compute if it could."""
    ref = ReferenceTransformer.from_pretrained(folder).eval()
    rope = ref.pos_embed
    index = torch.arange(2 * 4096)
    rope.pos_freqs = torch.cat([rope.rope_params(index, dim, rope.theta) for dim in rope.axes_dim], dim=1)
    return ref


def test_text_beyond_the_rotary_table_gets_a_row_per_token_like_a_longer_table(models, checkpoints):
    ref, ours = models[False]
    inputs = make_inputs(CASES["generate"][0], 1, LONG_TEXT)
    # The reference slices fewer text rows than tokens from its 4096-row table and fails in attention.
    with torch.no_grad(), pytest.raises(RuntimeError, match="size of tensor"):
        ref(**inputs)
    with torch.no_grad():
        expected = _reference_with_longer_table(checkpoints[False])(**inputs)[0]
        actual = ours(**inputs)[0]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_text_beyond_the_rotary_table_under_sp_matches_single_process(sp_pool, models, checkpoints):
    _, ours = models[False]
    with torch.no_grad():
        expected = ours(**make_inputs(CASES["generate"][0], 1, LONG_TEXT))[0]
    for out in sp_pool.run(sp_forward, checkpoints[False], "generate", "trim", 1, LONG_TEXT):
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)


# ---- layered checkpoints (Qwen-Image-Layered: use_layer3d_rope) ------------------------------------

LAYERED = ([(1, 5, 7), (1, 5, 7), (1, 5, 7)], 2)  # two layers and the condition image; batch 2


def _layered_models(folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(2)
    ref = ReferenceTransformer(**CONFIG, use_layer3d_rope=True, use_additional_t_cond=True).eval()
    ref.save_pretrained(folder)
    return ref, QwenImageTransformer2DModel.from_pretrained(folder).eval()


def test_a_layered_checkpoint_keeps_its_3d_rope_and_matches_the_reference_with_a_text_mask(tmp_path):
    ref, ours = _layered_models(tmp_path)
    assert type(ours.pos_embed) is type(ref.pos_embed)  # QwenEmbedLayer3DRope, as the config says
    img_shapes, batch = LAYERED
    inputs = make_inputs(img_shapes, batch, text_len=11)
    mask = torch.ones(batch, 11, dtype=torch.bool)
    mask[1, 7:] = False  # the second prompt is shorter
    inputs.update(encoder_hidden_states_mask=mask, additional_t_cond=torch.tensor([0, 1]))
    with torch.no_grad():
        expected = ref(**inputs)[0]
        actual = ours(**inputs)[0]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_a_layered_checkpoint_extends_its_rotary_table_for_long_text_too(tmp_path):
    ref, ours = _layered_models(tmp_path)
    img_shapes, _ = LAYERED
    inputs = make_inputs(img_shapes, 1, LONG_TEXT) | dict(additional_t_cond=torch.tensor([1]))
    rope = ref.pos_embed
    index = torch.arange(2 * 4096)
    rope.pos_freqs = torch.cat([rope.rope_params(index, dim, rope.theta) for dim in rope.axes_dim], dim=1)
    with torch.no_grad():
        expected = ref(**inputs)[0]
        actual = ours(**inputs)[0]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
