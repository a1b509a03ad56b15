"""Our HunyuanVideo 1.5 transformer against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32.
Text inputs look like the pipelines': a fixed-length prompt with a mask, ByT5 glyph tokens
(all masked when the prompt has no quoted text), and image embeddings (all zero for
text-to-video, which the reference then masks).
"""

from __future__ import annotations

import contextlib
import dataclasses

import conformance
import pytest
import torch
from diffusers import HunyuanVideo15Transformer3DModel as ReferenceTransformer
from sp_cases import sp_mode, worker_model

from vllm_omni.diffusion.models.hunyuan_video_15.transformer import HunyuanVideo15Transformer3DModel

LATENT = 4
CONFIG = dict(
    in_channels=2 * LATENT + 1,  # noisy latents, condition latents, condition mask
    out_channels=LATENT,
    num_attention_heads=6,
    attention_head_dim=16,
    num_layers=2,
    num_refiner_layers=2,
    text_embed_dim=32,
    text_embed_2_dim=24,
    image_embed_dim=20,
    rope_axes_dim=(4, 6, 6),
)
PROMPT_LEN, GLYPH_LEN, IMAGE_LEN = 40, 16, 12
# Latent grids: 175 video tokens (2 and 3 pad), 105 (2 pads), 30 (divisible by both).
GRIDS = {"odd": (5, 5, 7), "pad2": (3, 5, 7), "divisible": (2, 3, 5)}


@dataclasses.dataclass(frozen=True)
class Case:
    """One transformer call: per-row valid prompt tokens (a list of ints or of position lists), glyph tokens, i2v."""

    grid: tuple[int, int, int] = GRIDS["odd"]
    prompt_valid: tuple = (7,)
    glyph_valid: tuple = (0,)
    i2v: bool = False
    image_rows: int | None = None  # rows of image embeddings, if not one per video


def _mask(rows: tuple, length: int) -> torch.Tensor:
    mask = torch.zeros(len(rows), length)
    for i, valid in enumerate(rows):
        mask[i, list(valid) if isinstance(valid, (tuple, list)) else slice(0, valid)] = 1
    return mask


def make_inputs(case: Case, seed: int = 1, pad_noise: float = 0.0) -> dict:
    """The forward's arguments; `pad_noise` changes the content of the masked text tokens only."""
    gen = torch.Generator().manual_seed(seed)
    batch = len(case.prompt_valid)
    frames, height, width = case.grid
    prompt_mask, glyph_mask = _mask(case.prompt_valid, PROMPT_LEN), _mask(case.glyph_valid, GLYPH_LEN)
    prompt = torch.randn(batch, PROMPT_LEN, CONFIG["text_embed_dim"], generator=gen)
    glyph = torch.randn(batch, GLYPH_LEN, CONFIG["text_embed_2_dim"], generator=gen) * glyph_mask[..., None]
    if pad_noise:
        noise = torch.Generator().manual_seed(seed + 100)
        prompt = prompt + (1 - prompt_mask[..., None]) * pad_noise * torch.randn(prompt.shape, generator=noise)
        glyph = glyph + (1 - glyph_mask[..., None]) * pad_noise * torch.randn(glyph.shape, generator=noise)
    image_rows = case.image_rows or batch
    image = torch.randn(image_rows, IMAGE_LEN, CONFIG["image_embed_dim"], generator=gen)
    return dict(
        hidden_states=torch.randn(batch, CONFIG["in_channels"], frames, height, width, generator=gen),
        timestep=torch.rand(batch, generator=gen) * 1000,
        encoder_hidden_states=prompt,
        encoder_attention_mask=prompt_mask,
        encoder_hidden_states_2=glyph,
        encoder_attention_mask_2=glyph_mask,
        image_embeds=image if case.i2v else torch.zeros_like(image),
        return_dict=False,
    )


def make_models(folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = conformance.save_reference(ReferenceTransformer(**CONFIG).eval(), folder)
    return ref, HunyuanVideo15Transformer3DModel.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("hunyuan_video_15"))


@pytest.fixture(scope="module")
def models(checkpoint):
    return make_models(checkpoint)


def run(model, inputs: dict, bucket_multiple: int | None = None) -> torch.Tensor:
    if bucket_multiple is not None:
        model.text_bucket_multiple = bucket_multiple
    try:
        with torch.no_grad():
            return model(**inputs)[0]
    finally:
        if bucket_multiple is not None:
            del model.text_bucket_multiple  # back to the class default


PARITY_CASES = {
    "t2v": Case(),
    "t2v_long_prompt": Case(prompt_valid=(31,)),
    "t2v_glyph": Case(prompt_valid=(19,), glyph_valid=(5,)),
    "t2v_mask_with_holes": Case(prompt_valid=((0, 1, 2, 5, 9, 20),), glyph_valid=((3, 4, 10),)),
    "i2v": Case(i2v=True),
    "i2v_glyph": Case(prompt_valid=(19,), glyph_valid=(5,), i2v=True),
    "batch_same_masks": Case(prompt_valid=(7, 7), glyph_valid=(5, 5)),
    "batch_different_masks": Case(prompt_valid=(7, 19), glyph_valid=(0, 5)),
    "i2v_batch_different_masks": Case(prompt_valid=(7, 19), glyph_valid=(5, 0), i2v=True),
    "divisible_grid": Case(grid=GRIDS["divisible"], glyph_valid=(3,)),
}


@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_matches_diffusers_reference(models, name):
    ref, ours = models
    inputs = make_inputs(PARITY_CASES[name])
    torch.testing.assert_close(run(ours, inputs), run(ref, inputs), rtol=0, atol=1e-5)


def test_parameter_names_and_config_are_the_checkpoints(models):
    conformance.assert_parameter_names_are_the_checkpoints(*models, config="public")


def test_attention_processors_are_settable(models):
    _, ours = models
    processors = ours.attn_processors
    block_processor = processors["transformer_blocks.0.attn.processor"]
    # Setting processors goes through diffusers' mechanism and is what the forward then runs.
    ours.set_attn_processor(dict(processors))
    assert ours.transformer_blocks[0].attn.processor is block_processor
    assert "forward" not in vars(ours.transformer_blocks[0].attn)  # the module's forward is diffusers'


def test_text_to_video_with_several_videos_per_prompt(models):
    """The t2v pipeline passes one row of image embeddings for num_videos_per_prompt rows; the
    reference cannot run that batch, so each row is compared with a reference run of its own."""
    ref, ours = models
    inputs = make_inputs(Case(prompt_valid=(7, 7), glyph_valid=(2, 2), image_rows=1))
    actual = run(ours, inputs)
    for i in range(2):
        row = {k: v[i : i + 1] if isinstance(v, torch.Tensor) and v.shape[0] == 2 else v for k, v in inputs.items()}
        torch.testing.assert_close(actual[i : i + 1], run(ref, row), rtol=0, atol=1e-5)


def test_bucket_filler_is_dropped_exactly(models):
    """Compacted text rounded up to a bucket (filler from masked tokens) equals the unbucketed run."""
    _, ours = models
    for case in (Case(prompt_valid=(7,), glyph_valid=(5,)), Case(prompt_valid=(19,), i2v=True)):
        inputs = make_inputs(case)
        unbucketed = run(ours, inputs, bucket_multiple=1)
        for multiple in (4, 16, 64):
            torch.testing.assert_close(run(ours, inputs, bucket_multiple=multiple), unbucketed, rtol=0, atol=1e-6)


def test_masked_text_content_never_reaches_the_video(models):
    _, ours = models
    for case in (Case(prompt_valid=(7,), glyph_valid=(5,)), Case(prompt_valid=(7, 19), glyph_valid=(0, 4), i2v=True)):
        clean = run(ours, make_inputs(case))
        assert torch.equal(run(ours, make_inputs(case, pad_noise=5.0)), clean)


def test_text_plan_is_computed_once_per_mask_tensor(models, monkeypatch):
    """The pipeline passes the same mask tensors at every step: the host-side plan (a device sync) is cached."""
    from vllm_omni.diffusion.models.hunyuan_video_15 import transformer as module

    _, ours = models
    calls = []
    original = module.plan_text
    monkeypatch.setattr(module, "plan_text", lambda *a, **k: calls.append(1) or original(*a, **k))
    inputs = make_inputs(Case(prompt_valid=(7,), glyph_valid=(5,)))
    first = run(ours, inputs)
    assert len(calls) == 1
    assert torch.equal(run(ours, inputs), first) and len(calls) == 1
    # An equal mask in a new tensor is planned again (never confused with a freed tensor's entry).
    run(ours, dict(inputs, encoder_attention_mask=inputs["encoder_attention_mask"].clone()))
    assert len(calls) == 2
    # Writing into the mask invalidates its plan.
    inputs["encoder_attention_mask"][0, 7] = 1
    torch.testing.assert_close(run(ours, inputs), run(models[0], inputs), rtol=0, atol=1e-5)
    assert len(calls) == 3


# ---- under SP (gloo workers) ----------------------------------------------------------------

SP_CASES = {
    # 175 video tokens; 7 + 6 = 13 valid text tokens (pads at 2 and 3 unbucketed; bucket 64 is filler)
    "t2v_glyph": Case(prompt_valid=(7,), glyph_valid=(6,)),
    # rows with different padding (one forward, each row's own text), image tokens valid
    "i2v_rows": Case(prompt_valid=(7, 19), glyph_valid=(0, 5), i2v=True),
    # 105 video tokens: pads at 2 only
    "pad2_grid": Case(grid=GRIDS["pad2"], prompt_valid=(11,)),
}


def sp_forward(
    folder: str, case: Case, mode: str, bucket_multiple: int | None = None, random_padding: bool = False
) -> tuple[torch.Tensor, list[str]]:
    """Worker side: our forward under the worker's SP group in `mode`; the output and the warnings logged."""
    model = worker_model(HunyuanVideo15Transformer3DModel.from_pretrained, folder)
    inputs = make_inputs(case, pad_noise=5.0 if random_padding else 0.0)
    with sp_mode(mode, random_padding, reset_warnings=True) as warnings:
        return run(model, inputs, bucket_multiple), warnings


def on_pool(sp_pool, checkpoint: str, case: Case, bucket_multiple: int | None = None):
    """`sp_forward` on the pool's ranks as conformance's checks call it."""
    return lambda mode, random_padding: sp_pool.run(sp_forward, checkpoint, case, mode, bucket_multiple, random_padding)


@pytest.mark.parametrize("case", list(SP_CASES))
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoint, case):
    _, ours = models
    expected = run(ours, make_inputs(SP_CASES[case]))
    for bucket_multiple in (1, 64):
        conformance.assert_sp_exact_modes_match(on_pool(sp_pool, checkpoint, SP_CASES[case], bucket_multiple), expected)


def batched_and_alone(model: torch.nn.Module, case: Case, mode: str | None = None) -> tuple:
    """`case`'s rows run as one batch and each alone (in SP `mode` on a worker), and the batch's forwards."""
    inputs = make_inputs(case)
    forwards = []
    hook = model.x_embedder.register_forward_hook(lambda *_: forwards.append(1))
    with sp_mode(mode) if mode else contextlib.nullcontext():
        batched = run(model, inputs)
        count = len(forwards)
        alone = [
            run(model, {k: v[i : i + 1] if torch.is_tensor(v) else v for k, v in inputs.items()}) for i in range(2)
        ]
    hook.remove()
    return batched, torch.cat(alone), count


def sp_batched_and_alone(folder: str, case: Case, mode: str) -> tuple:
    return batched_and_alone(worker_model(HunyuanVideo15Transformer3DModel.from_pretrained, folder), case, mode)


def test_rows_of_different_prompt_lengths_share_one_forward_and_equal_their_rows_alone(sp_pool, models, checkpoint):
    """Rows whose prompt and glyph padding differ (one with glyph text, one without) run one forward; each row
    equals its run alone to fp32 reassociation in the batched GEMMs (attention sees each row's exact keys)."""
    case = SP_CASES["i2v_rows"]
    results = [batched_and_alone(models[1], case)]
    for mode in ("mask", "trim"):
        results += sp_pool.run(sp_batched_and_alone, checkpoint, case, mode)
    for batched, alone, forwards in results:
        assert forwards == 1
        torch.testing.assert_close(batched, alone, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoint, mode):
    """Random values in the SP padding and in the masked text tokens (hence the bucket filler)."""
    for case in ("t2v_glyph", "i2v_rows"):
        conformance.assert_sp_padding_content_never_reaches_real_tokens(
            on_pool(sp_pool, checkpoint, SP_CASES[case]), mode
        )


def test_sp_unmasked_padding_is_close_but_not_equal_and_warns(sp_pool, models, checkpoint):
    _, ours = models
    case = SP_CASES["t2v_glyph"]
    expected = run(ours, make_inputs(case))
    conformance.assert_sp_unmasked_padding_is_close_but_not_equal(
        on_pool(sp_pool, checkpoint, case), expected, sp_pool.world_size
    )
    # Divisible video grid: the only padding is the text bucket's filler, which is not SP padding
    # and is cut in every mode, so none mode is exact and silent.
    case = Case(grid=GRIDS["divisible"], prompt_valid=(7,), glyph_valid=(5,))
    expected = run(ours, make_inputs(case))
    conformance.assert_sp_none_mode_exact_without_padding(on_pool(sp_pool, checkpoint, case), expected, silent=True)


# ---- under ring attention (USP: ring_pool) ------------------------------------------------------------


def test_ring_matches_single_process_at_padded_sizes(ring_pool, models, checkpoint):
    """175 video tokens pad inside a ring block at ring 2, ring 3 and Ulysses 2 x ring 2 ([video, text]: the
    text behind), its text compacted to 13 valid tokens in a bucket of 64 (filler in the last blocks); rows whose
    prompts and glyphs differ in length each see their own text."""
    _, ours = models
    case = SP_CASES["t2v_glyph"]
    expected = run(ours, make_inputs(case))
    conformance.assert_ring_conformance(on_pool(ring_pool, checkpoint, case, 64), expected, ring_pool.ring_degree)
    case = SP_CASES["i2v_rows"]
    expected = run(ours, make_inputs(case))
    conformance.assert_sp_exact_modes_match(on_pool(ring_pool, checkpoint, case), expected)
