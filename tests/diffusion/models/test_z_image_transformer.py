"""Our Z-Image transformer against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32.
The reference pads each stream to a multiple of 32 itself (35 image tokens -> 64, 11 caption
tokens -> 32), so 2 ranks never pad; 3 ranks pad both streams (64 -> 66, 32 -> 33).
"""

from __future__ import annotations

import conformance
import pytest
import torch
from diffusers import ZImageTransformer2DModel as ReferenceTransformer
from diffusers.models.transformers import transformer_z_image as reference
from sp_cases import sp_mode, worker_model
from sp_pool import SPWorkerPool

from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.comm import SimulatedGroup
from vllm_omni.diffusion.distributed.parallel_state import ParallelState, use_parallel_state
from vllm_omni.diffusion.models.z_image.transformer import ZImageTransformer2DModel
from vllm_omni.logger import reset_warning_once

CONFIG = dict(
    all_patch_size=(2,),
    all_f_patch_size=(1,),
    in_channels=4,
    dim=96,
    n_layers=2,
    n_refiner_layers=1,
    n_heads=6,
    n_kv_heads=6,
    cap_feat_dim=24,
    axes_dims=[4, 6, 6],  # frame/height/width rotary dims, summing to the head dim (96 / 6)
    axes_lens=[256, 32, 32],
)
LATENT = (10, 14)  # 5 x 7 = 35 image tokens
# Caption lengths per row: one row; two rows as a CFG step passes them (prompt, then the shorter
# empty negative prompt: the reference masks the batch padding between them); two equal rows; two rows
# whose captions the reference pads to different lengths (64 and 32 tokens: ours shares one forward).
CASES = {"one": [11], "cfg": [11, 5], "equal": [11, 11], "ragged": [40, 5]}


def make_inputs(case: str, seed: int = 1, controlnet: bool = False) -> dict:
    gen = torch.Generator().manual_seed(seed)
    lengths = CASES[case]
    inputs = dict(
        x=[torch.randn(CONFIG["in_channels"], 1, *LATENT, generator=gen) for _ in lengths],
        t=torch.rand(len(lengths), generator=gen),
        cap_feats=[torch.randn(n, CONFIG["cap_feat_dim"], generator=gen) for n in lengths],
        return_dict=False,
    )
    if controlnet:  # residuals over the reference's joint [image, caption] sequence: 64 + the longest caption's
        joint = 64 + max(-(-n // 32) * 32 for n in lengths)
        inputs["controlnet_block_samples"] = {1: torch.randn(len(lengths), joint, CONFIG["dim"], generator=gen)}
    return inputs


checkpoint = conformance.checkpoint_fixture(ReferenceTransformer, CONFIG, "z_image_transformer")
models = conformance.models_fixture(ReferenceTransformer, ZImageTransformer2DModel)


def assert_samples_close(actual: list, expected: list, atol: float = 1e-5) -> None:
    assert len(actual) == len(expected)
    for a, e in zip(actual, expected):
        assert a.shape == e.shape == (CONFIG["in_channels"], 1, *LATENT)
        torch.testing.assert_close(a, e, rtol=0, atol=atol)


@pytest.mark.parametrize("controlnet", [False, True], ids=["plain", "controlnet"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_diffusers_reference(models, case, controlnet):
    ref, ours = models
    inputs = make_inputs(case, controlnet=controlnet)
    with torch.no_grad():
        assert_samples_close(ours(**inputs)[0], ref(**inputs)[0])


def test_parameter_names_and_config_are_the_checkpoints(models):
    conformance.assert_parameter_names_are_the_checkpoints(*models, config="all")


def omni_inputs() -> dict:
    """The Omni variant's call: a condition image then the target, one caption each, no SigLIP features."""
    gen = torch.Generator().manual_seed(4)
    return dict(
        x=[[torch.randn(CONFIG["in_channels"], 1, *LATENT, generator=gen) for _ in range(2)]],
        t=torch.rand(1, generator=gen),
        cap_feats=[[torch.randn(n, CONFIG["cap_feat_dim"], generator=gen) for n in (9, 6)]],
        siglip_feats=[None],
        image_noise_mask=[[0, 1]],
        return_dict=False,
    )


def test_omni_inputs_match_the_reference_at_one_rank_and_are_refused_under_sp(models):
    ref, ours = models
    with torch.no_grad():
        expected, actual = ref(**omni_inputs())[0], ours(**omni_inputs())[0]
        assert_samples_close(actual, expected)
        state = ParallelState(DiffusionParallelConfig(ulysses_degree=2), 0, 2, SimulatedGroup(2), None)
        with use_parallel_state(state), pytest.raises(NotImplementedError, match="Omni.*sequence parallelism"):
            ours(**omni_inputs())


def test_processors_set_later_take_effect(checkpoint):
    """A processor set on a block's attention (diffusers' class has no set_attn_processor) is the one that
    runs: diffusers' own processors run the reference at one rank."""
    ref = ReferenceTransformer.from_pretrained(checkpoint).eval()
    ours = ZImageTransformer2DModel.from_pretrained(checkpoint).eval()
    calls = []

    class CountingAttnProcessor(reference.ZSingleStreamAttnProcessor):
        def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
            calls.append(attn)
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)

    for module in ours.modules():
        if isinstance(module, reference.ZImageTransformerBlock):
            module.attention.set_processor(CountingAttnProcessor())
    inputs = make_inputs("cfg")
    with torch.no_grad():
        assert_samples_close(ours(**inputs)[0], ref(**inputs)[0])
    assert len(calls) == CONFIG["n_layers"] + 2 * CONFIG["n_refiner_layers"]  # one caption length: one group
    calls.clear()
    inputs = make_inputs("ragged")
    with torch.no_grad():  # diffusers' processors attend to every key: rows of other caption lengths run apart
        assert_samples_close(ours(**inputs)[0], ref(**inputs)[0])
    assert len(calls) == 2 * (CONFIG["n_layers"] + 2 * CONFIG["n_refiner_layers"])

    # Under SP those processors would attend to one rank's tokens only: refused before any work.
    state = ParallelState(DiffusionParallelConfig(ulysses_degree=2), 0, 2, SimulatedGroup(2), None)
    with use_parallel_state(state), torch.no_grad(), pytest.raises(RuntimeError, match="sequence parallelism"):
        ours(**inputs)


# ---- under SP (gloo workers) ----------------------------------------------------------------


def sp_forward(folder: str, case: str, mode: str, random_padding: bool = False, controlnet: bool = False):
    """Worker side: our forward under the worker's SP group in one padding mode; (outputs, warnings logged)."""
    model = worker_model(ZImageTransformer2DModel.from_pretrained, folder)
    with sp_mode(mode, random_padding) as warnings, torch.no_grad():
        output = model(**make_inputs(case, controlnet=controlnet))[0]
    return output, warnings


def test_rows_of_different_caption_lengths_share_one_forward_and_equal_their_rows_alone(models):
    """fp32 to a few ulps: the batch's GEMMs have other shapes; attention sees each row's own keys."""
    _, ours = models
    inputs = make_inputs("ragged", controlnet=True)
    forwards = []
    hook = ours.cap_embedder.register_forward_hook(lambda *_: forwards.append(1))
    try:
        with torch.no_grad():
            batched = ours(**inputs)[0]
            assert len(forwards) == 1
            alone = []
            for i, n in enumerate(CASES["ragged"]):
                joint = 64 + -(-n // 32) * 32
                row = dict(
                    inputs, x=inputs["x"][i : i + 1], t=inputs["t"][i : i + 1], cap_feats=inputs["cap_feats"][i : i + 1]
                )
                row["controlnet_block_samples"] = {
                    k: v[i : i + 1, :joint] for k, v in inputs["controlnet_block_samples"].items()
                }
                alone += ours(**row)[0]
    finally:
        hook.remove()
    for a, b in zip(batched, alone):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def on_pool(sp_pool, checkpoint: str, case: str, controlnet: bool = False, sample: bool = False):
    """`sp_forward` on the pool's ranks as conformance's checks call it; `sample`: each rank's first sample."""

    def sp(mode: str, random_padding: bool) -> list:
        results = sp_pool.run(sp_forward, checkpoint, case, mode, random_padding, controlnet)
        return [(out[0], warnings) for out, warnings in results] if sample else results

    return sp


@pytest.mark.parametrize("case", ["one", "cfg", "ragged"])
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoint, case):
    _, ours = models
    with torch.no_grad():
        expected = ours(**make_inputs(case, controlnet=case == "cfg"))[0]
    sp = on_pool(sp_pool, checkpoint, case, controlnet=case == "cfg")
    conformance.assert_sp_exact_modes_match(sp, expected, compare=assert_samples_close)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoint, mode):
    conformance.assert_sp_padding_content_never_reaches_real_tokens(
        on_pool(sp_pool, checkpoint, "cfg"), mode, equal=lambda a, b: all(torch.equal(x, y) for x, y in zip(a, b))
    )


def test_sp_unmasked_padding_is_close_but_not_equal_and_warns_once(sp_pool, models, checkpoint):
    _, ours = models
    with torch.no_grad():
        expected = ours(**make_inputs("one"))[0][0]
    sp_pool.run(reset_warning_once)
    sp = on_pool(sp_pool, checkpoint, "one", sample=True)
    if sp_pool.world_size == 2:  # both streams are multiples of 32: nothing pads, none mode is exact
        conformance.assert_sp_none_mode_exact_without_padding(sp, expected, silent=True)
        return
    results = conformance.assert_sp_unmasked_padding_is_close_but_not_equal(sp, expected, sp_pool.world_size, once=True)
    conformance.assert_sp_padding_hook_changes_unmasked_output(sp, clean=results)


# ---- under ring attention (USP: ring_pool, and Ulysses 3 x ring 2 for its 30 heads' sake) ----------------


@pytest.fixture(scope="module")
def u3r2_pool():
    """Z-Image's 30 heads take no Ulysses 4 or 8: its SP degrees past 6 are Ulysses x ring. Ulysses 3 x ring 2
    (the tiny model's 6 heads allow it) pads both streams (64 -> 66 image tokens, 32 -> 36 caption tokens)."""
    pool = SPWorkerPool(6, ring_degree=2)
    yield pool
    pool.close()


def _ring_checks(pool, models, checkpoint) -> None:
    _, ours = models
    with torch.no_grad():
        expected = ours(**make_inputs("one"))[0][0]
    pool.run(reset_warning_once)
    padded = pool.world_size in (3, 6)  # 2 and 4 ranks divide both streams (64 and 32 tokens)
    sp = on_pool(pool, checkpoint, "one", sample=True)
    if padded:
        conformance.assert_ring_conformance(sp, expected, pool.ring_degree)
    else:
        conformance.assert_sp_exact_modes_match(sp, expected)
        conformance.assert_sp_none_mode_exact_without_padding(sp, expected, silent=True)
    with torch.no_grad():  # a CFG step's prompt and negative prompt: rows of different caption lengths
        expected = ours(**make_inputs("cfg", controlnet=True))[0]
    sp = on_pool(pool, checkpoint, "cfg", controlnet=True)
    conformance.assert_sp_exact_modes_match(sp, expected, compare=assert_samples_close)


def test_ring_matches_single_process(ring_pool, models, checkpoint):
    _ring_checks(ring_pool, models, checkpoint)


def test_ulysses_3_by_ring_2_matches_single_process(u3r2_pool, models, checkpoint):
    _ring_checks(u3r2_pool, models, checkpoint)
