"""Our LTX-2 transformer against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32. Two configs: LTX-2.0's
layout ("split" RoPE, prompt projections, no gates) and LTX-2.3's (gated attention, prompt modulation, perturbed
self-attention for spatio-temporal guidance, "interleaved" RoPE here to cover the other rotary layout). The video
stream is frames x height x width tokens, the audio stream its latent frames; sizes are picked so that the video
stream pads, the audio stream pads, or both, at Ulysses 2 and 3.
"""

from __future__ import annotations

import dataclasses

import conformance
import pytest
import torch
from diffusers import LTX2VideoTransformer3DModel as ReferenceTransformer
from sp_cases import sp_mode, worker_model

from vllm_omni.diffusion.models.ltx2.transformer import LTX2VideoTransformer3DModel

TEXT_LEN, CAPTION = 12, 16
HEADS, HEAD_DIM, AUDIO_HEAD_DIM = 6, 8, 4  # 6 heads: Ulysses 2 and 3 divide them
INNER, AUDIO_INNER = HEADS * HEAD_DIM, HEADS * AUDIO_HEAD_DIM
BASE = dict(
    in_channels=4,
    out_channels=4,
    num_attention_heads=HEADS,
    attention_head_dim=HEAD_DIM,
    audio_in_channels=4,
    audio_out_channels=4,
    audio_num_attention_heads=HEADS,
    audio_attention_head_dim=AUDIO_HEAD_DIM,
    audio_cross_attention_dim=AUDIO_INNER,
    num_layers=2,
    rope_double_precision=False,
)
CONFIGS = {
    # LTX-2.0: the prompt projected by the transformer (caption_projection) to each stream's width.
    "2.0": dict(BASE, cross_attention_dim=INNER, caption_channels=CAPTION, rope_type="split"),
    # LTX-2.3: the connectors project the prompt; gates, prompt modulation, STG's perturbed self-attention.
    "2.3": dict(
        BASE,
        cross_attention_dim=INNER,
        caption_channels=CAPTION,
        rope_type="interleaved",
        gated_attn=True,
        cross_attn_mod=True,
        audio_gated_attn=True,
        audio_cross_attn_mod=True,
        perturbed_attn=True,
        use_prompt_embeddings=False,
    ),
}
# (latent frames, height, width) video grids and audio latent frames; tokens in the comments.
VIDEO = {"pad23": (5, 5, 7), "even": (2, 3, 5)}  # 175 (pads at 2 and 3), 30 (divisible by 2 and 3)
AUDIO = {"pad23": 13, "even": 12}  # 13 (pads at 2 and 3), 12


@dataclasses.dataclass(frozen=True)
class Case:
    config: str = "2.0"
    video: str = "pad23"
    audio: str = "pad23"
    batch: int = 1
    per_token_timestep: bool = False  # image-to-video: the first frame's tokens at timestep 0
    text_valid: int | None = None  # masked prompt tokens after this many (None: all valid)
    cross_timestep: bool = True  # use_cross_timestep (LTX2Pipeline's default)
    stg: bool = False  # spatio-temporal guidance at block 1 (every row perturbed)
    isolate: bool = False  # isolate_modalities


def make_inputs(case: Case, seed: int = 1) -> dict:
    gen = torch.Generator().manual_seed(seed)
    frames, height, width = VIDEO[case.video]
    audio_frames = AUDIO[case.audio]
    batch, tokens = case.batch, frames * height * width
    text_dim = CAPTION if CONFIGS[case.config].get("use_prompt_embeddings", True) else None
    timestep = audio_timestep = torch.rand(batch, generator=gen) * 1000
    sigma = timestep / 1000
    if case.per_token_timestep:  # as the image-to-video pipeline passes it: the audio's stays one per row
        timestep = timestep[:, None].expand(batch, tokens).clone()
        timestep[:, : height * width] = 0
    mask = torch.ones(batch, TEXT_LEN)
    if case.text_valid is not None:
        mask[:, case.text_valid :] = 0
    return dict(
        hidden_states=torch.randn(batch, tokens, 4, generator=gen),
        audio_hidden_states=torch.randn(batch, audio_frames, 4, generator=gen),
        encoder_hidden_states=torch.randn(batch, TEXT_LEN, text_dim or INNER, generator=gen),
        audio_encoder_hidden_states=torch.randn(batch, TEXT_LEN, text_dim or AUDIO_INNER, generator=gen),
        timestep=timestep,
        audio_timestep=audio_timestep,
        sigma=sigma,
        encoder_attention_mask=mask,
        audio_encoder_attention_mask=mask,
        num_frames=frames,
        height=height,
        width=width,
        fps=24.0,
        audio_num_frames=audio_frames,
        use_cross_timestep=case.cross_timestep,
        spatio_temporal_guidance_blocks=[1] if case.stg else None,
        isolate_modalities=case.isolate,
        return_dict=False,
    )


def make_models(config: str, folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = conformance.save_reference(ReferenceTransformer(**CONFIGS[config]).eval(), folder)
    return ref, LTX2VideoTransformer3DModel.from_pretrained(folder).eval()


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    return {config: str(tmp_path_factory.mktemp(f"ltx2_{config}")) for config in CONFIGS}


@pytest.fixture(scope="module")
def models(checkpoints):
    return {config: make_models(config, folder) for config, folder in checkpoints.items()}


def run(model, inputs: dict) -> torch.Tensor:
    """Both outputs, video then audio, flattened per row: every comparison covers both streams."""
    with torch.no_grad():
        video, audio = model(**inputs)
    return torch.cat([video.flatten(1), audio.flatten(1)], dim=1)


PARITY_CASES = {
    "2.0": Case(),
    "2.0_batch2_per_token_timestep": Case(batch=2, per_token_timestep=True),
    "2.0_masked_prompt": Case(text_valid=5),
    "2.0_own_timesteps": Case(cross_timestep=False, per_token_timestep=True),
    "2.0_isolated_modalities": Case(isolate=True),
    "2.3": Case("2.3"),
    "2.3_stg": Case("2.3", stg=True),
    "2.3_batch2_per_token_timestep": Case("2.3", batch=2, per_token_timestep=True),
}


@pytest.mark.parametrize("name", list(PARITY_CASES))
def test_matches_diffusers_reference(models, name):
    case = PARITY_CASES[name]
    ref, ours = models[case.config]
    inputs = make_inputs(case)
    torch.testing.assert_close(run(ours, inputs), run(ref, inputs), rtol=0, atol=1e-5)


def test_return_dict_has_both_samples(models):
    ref, ours = models["2.0"]
    inputs = dict(make_inputs(Case()), return_dict=True)
    with torch.no_grad():
        out, expected = ours(**inputs), ref(**inputs)
    torch.testing.assert_close(out.sample, expected.sample, rtol=0, atol=1e-5)
    torch.testing.assert_close(out.audio_sample, expected.audio_sample, rtol=0, atol=1e-5)


def test_parameter_names_and_config_are_the_checkpoints(models):
    for config in CONFIGS:
        conformance.assert_parameter_names_are_the_checkpoints(*models[config], config="public")


def test_attention_kinds_are_declared(models):
    """Self-attention per stream through the Ulysses layer; the two streams cross through StreamCrossAttention; the
    prompt by cross-attention."""
    _, ours = models["2.0"]
    for block in ours.transformer_blocks:
        kinds = {name: getattr(block, name).processor.attention for name in ("attn1", "audio_attn1")}
        assert [(k.kind, k.stream) for k in kinds.values()] == [("joint", "image"), ("joint", "audio")]
        assert block.attn2.processor.attention.kind == block.audio_attn2.processor.attention.kind == "cross"
        a2v, v2a = block.audio_to_video_attn.processor.attention, block.video_to_audio_attn.processor.attention
        assert (a2v.kind, a2v.query_stream, a2v.kv_stream) == ("stream_cross", "image", "audio")
        assert (v2a.kind, v2a.query_stream, v2a.kv_stream) == ("stream_cross", "audio", "image")


def test_dense_video_self_attention_mask_is_refused(models):
    _, ours = models["2.0"]
    inputs = make_inputs(Case(video="even"))
    tokens = inputs["hidden_states"].shape[1]
    with pytest.raises(NotImplementedError, match="video_self_attention_mask"):
        ours(**inputs, video_self_attention_mask=torch.ones(1, tokens, tokens))


# ---- under SP (gloo workers) ----------------------------------------------------------------

SP_CASES = {
    "video_pads": Case(video="pad23", audio="even"),
    "audio_pads": Case(video="even", audio="pad23"),
    "both_pad_i2v_batch2": Case(batch=2, per_token_timestep=True, text_valid=7),
    "both_pad_2.3_stg": Case("2.3", stg=True, cross_timestep=False, per_token_timestep=True),
}


def sp_forward(folder: str, case: Case, mode: str, random_padding: bool = False) -> tuple[torch.Tensor, list[str]]:
    """Worker side: our forward under the worker's SP group in `mode`; the output and the warnings logged."""
    model = worker_model(LTX2VideoTransformer3DModel.from_pretrained, folder)
    with sp_mode(mode, random_padding, reset_warnings=True) as warnings:
        return run(model, make_inputs(case)), warnings


def on_pool(sp_pool, checkpoints: dict[str, str], case: Case):
    """`sp_forward` on the pool's ranks, as conformance's checks call it."""
    return lambda mode, random_padding: sp_pool.run(sp_forward, checkpoints[case.config], case, mode, random_padding)


@pytest.mark.parametrize("name", list(SP_CASES))
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoints, name):
    case = SP_CASES[name]
    expected = run(models[case.config][1], make_inputs(case))
    conformance.assert_sp_exact_modes_match(on_pool(sp_pool, checkpoints, case), expected)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoints, mode):
    """Random values in both streams' padded rows, their coordinates and (image-to-video) per-token timesteps."""
    for name in ("both_pad_i2v_batch2", "both_pad_2.3_stg"):
        conformance.assert_sp_padding_content_never_reaches_real_tokens(
            on_pool(sp_pool, checkpoints, SP_CASES[name]), mode
        )


@pytest.mark.parametrize("name", ["video_pads", "audio_pads"])
def test_sp_unmasked_padding_is_close_but_not_equal_and_warns_once(sp_pool, models, checkpoints, name):
    case = SP_CASES[name]
    expected = run(models[case.config][1], make_inputs(case))
    conformance.assert_sp_unmasked_padding_is_close_but_not_equal(
        on_pool(sp_pool, checkpoints, case), expected, sp_pool.world_size
    )


def test_sp_none_mode_is_exact_and_silent_where_nothing_pads(sp_pool, models, checkpoints):
    case = Case(video="even", audio="even")
    expected = run(models[case.config][1], make_inputs(case))
    conformance.assert_sp_none_mode_exact_without_padding(on_pool(sp_pool, checkpoints, case), expected, silent=True)


# ---- under ring attention (USP: ring_pool) ------------------------------------------------------------


def test_ring_matches_single_process_at_padded_sizes(ring_pool, models, checkpoints):
    """Both streams pad inside a ring block (175 video tokens, 13 audio): each stream's self-attention goes around
    the ring, while the cross-stream attentions exchange heads over the whole SP group in one all-to-all, so a
    group whose size does not divide the 6 heads (Ulysses 2 x ring 2: 4 ranks) is refused on every rank, naming
    the heads, rather than computing something else."""
    case = Case()
    forward = on_pool(ring_pool, checkpoints, case)
    if HEADS % ring_pool.world_size:
        with pytest.raises(RuntimeError, match=rf"all {ring_pool.world_size} sequence-parallel ranks .* \({HEADS}\)"):
            forward("trim", False)
        return
    expected = run(models[case.config][1], make_inputs(case))
    conformance.assert_ring_conformance(forward, expected, ring_pool.ring_degree)
