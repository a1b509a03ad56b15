"""Our FLUX.2 transformer against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32.
Token counts are chosen so that 2 and 3 ranks pad both streams.
"""

from __future__ import annotations

import conformance
import pytest
import torch
from diffusers import Flux2Transformer2DModel as ReferenceTransformer
from diffusers.models.transformers import transformer_flux2 as reference
from sp_cases import sp_mode, worker_model

from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.comm import SimulatedGroup
from vllm_omni.diffusion.distributed.parallel_state import ParallelState, get_parallel_state, use_parallel_state
from vllm_omni.diffusion.models.flux2.transformer import Flux2Transformer2DModel
from vllm_omni.logger import reset_warning_once

CONFIG = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=6,
    joint_attention_dim=24,
    timestep_guidance_channels=32,
    axes_dims_rope=(4, 4, 4, 4),
)
# (latent grids: the generated image, then reference images; text tokens). Image tokens 35 and
# 35 + 24 = 59, text 11: neither 2 nor 3 divides them. The last case divides by both.
CASES = {
    "generate": ([(5, 7)], 11),
    "reference_image": ([(5, 7), (4, 6)], 11),
    "divisible": ([(6, 6)], 12),
}


def _ids(t: int, h: int, w: int, length: int) -> torch.Tensor:
    """Position ids (T, H, W, L) as the FLUX.2 pipeline builds them."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(length))


def make_inputs(case: str, batch: int, seed: int = 1) -> dict:
    grids, text_len = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    image_len = sum(h * w for h, w in grids)
    # The generated image has T=0; reference image i has T=10 + 10 * i.
    img_ids = torch.cat([_ids(0 if i == 0 else 10 * i, h, w, 1) for i, (h, w) in enumerate(grids)])
    return dict(
        hidden_states=torch.randn(batch, image_len, CONFIG["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, text_len, CONFIG["joint_attention_dim"], generator=gen),
        timestep=torch.rand(batch, generator=gen),
        img_ids=img_ids.expand(batch, -1, -1),
        txt_ids=_ids(0, 1, 1, text_len).expand(batch, -1, -1),
        guidance=torch.full((batch,), 4.0),
        return_dict=False,
    )


checkpoint = conformance.checkpoint_fixture(ReferenceTransformer, CONFIG, "flux2_transformer")
models = conformance.models_fixture(ReferenceTransformer, Flux2Transformer2DModel)


@pytest.mark.parametrize("case", ["generate", "reference_image"])
@pytest.mark.parametrize("batch", [1, 2])
def test_matches_diffusers_reference(models, case, batch):
    ref, ours = models
    inputs = make_inputs(case, batch)
    with torch.no_grad():
        expected = ref(**inputs)[0]
        actual = ours(**inputs)[0]
    assert actual.shape == expected.shape == (batch, inputs["hidden_states"].shape[1], CONFIG["in_channels"])
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_parameter_names_and_config_are_the_checkpoints(models):
    conformance.assert_parameter_names_are_the_checkpoints(*models, config="all")


def test_processors_set_later_take_effect(checkpoint):
    """set_attn_processor still works: diffusers' own processors run the reference at one rank."""
    ref = ReferenceTransformer.from_pretrained(checkpoint).eval()
    ours = Flux2Transformer2DModel.from_pretrained(checkpoint).eval()
    calls = []

    class CountingAttnProcessor(reference.Flux2AttnProcessor):
        def __call__(self, attn, *args, **kwargs):
            calls.append(attn)
            return super().__call__(attn, *args, **kwargs)

    processors = {
        name: CountingAttnProcessor() if name.startswith("transformer_blocks") else proc
        for name, proc in ref.attn_processors.items()
    }
    ours.set_attn_processor(processors)
    assert not any(type(p).__module__.startswith("vllm_omni") for p in ours.attn_processors.values())
    inputs = make_inputs("generate", 2)
    with torch.no_grad():
        expected = ref(**inputs)[0]
        actual = ours(**inputs)[0]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    assert len(calls) == CONFIG["num_layers"]

    # Under SP those processors would attend to one rank's tokens only: refused before any work.
    state = ParallelState(DiffusionParallelConfig(ulysses_degree=2), 0, 2, SimulatedGroup(2), None)
    with use_parallel_state(state), torch.no_grad(), pytest.raises(RuntimeError, match="sequence parallelism"):
        ours(**inputs)


def test_lora_scale_is_applied_around_the_forward(models, monkeypatch):
    """`joint_attention_kwargs["scale"]` scales the LoRA layers for the call, as in the reference."""
    import diffusers.utils
    from diffusers.utils import peft_utils

    _, ours = models
    events = []
    monkeypatch.setattr(diffusers.utils, "USE_PEFT_BACKEND", True)

    def recorder(name):
        return lambda model, scale: events.append((name, model, scale))

    monkeypatch.setattr(peft_utils, "scale_lora_layers", recorder("scale"))
    monkeypatch.setattr(peft_utils, "unscale_lora_layers", recorder("unscale"))
    inputs = make_inputs("generate", 1)
    kwargs = {"scale": 0.5}
    with torch.no_grad():
        ours(**inputs, joint_attention_kwargs=kwargs)
    assert events == [("scale", ours, 0.5), ("unscale", ours, 0.5)]
    assert kwargs == {"scale": 0.5}  # the caller's dict is left alone


KLEIN_KV_GRIDS = ((5, 7), (5, 5))  # the image, the reference image: 35 and 25 tokens, padded at 2 and 3 ranks


def klein_kv_inputs(batch: int, seed: int = 1) -> tuple[dict, dict, int]:
    """klein KV's two kinds of call: the first step, the reference image's tokens in front ([reference, image]),
    extracts their keys and values; a later step (the image alone) reads them from the cache. The later
    step's inputs are the first step's image rows at a new timestep, so it can also be recomputed in full."""
    (image_h, image_w), (ref_h, ref_w) = KLEIN_KV_GRIDS
    image_len, ref_len = image_h * image_w, ref_h * ref_w
    gen = torch.Generator().manual_seed(seed)
    text_len = CASES["generate"][1]
    img_ids = torch.cat([_ids(10, ref_h, ref_w, 1), _ids(0, image_h, image_w, 1)])
    first = dict(
        hidden_states=torch.randn(batch, ref_len + image_len, CONFIG["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, text_len, CONFIG["joint_attention_dim"], generator=gen),
        timestep=torch.rand(batch, generator=gen),
        img_ids=img_ids.expand(batch, -1, -1),
        txt_ids=_ids(0, 1, 1, text_len).expand(batch, -1, -1),
        guidance=None,  # klein has no guidance embedding; this config has one, which the reference then skips
        return_dict=False,
    )
    later = dict(
        first,
        hidden_states=first["hidden_states"][:, ref_len:] + 0.5,
        img_ids=first["img_ids"][:, ref_len:],
        timestep=first["timestep"] * 0.5,
    )
    return first, later, ref_len


def set_klein_kv_processors(model) -> None:
    """What diffusers' Flux2KleinKVPipeline installs on its transformer."""
    for block in model.transformer_blocks:
        block.attn.set_processor(reference.Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(reference.Flux2KVParallelSelfAttnProcessor())


def kv_steps(model, first: dict, later: dict, ref_len: int) -> tuple[torch.Tensor, torch.Tensor, object]:
    """The first step (extract) and a later one (cached): (first output, later output, cache)."""
    with torch.no_grad():
        out, cache = model(**first, kv_cache_mode="extract", num_ref_tokens=ref_len, ref_fixed_timestep=0.0)
        later_out = model(**later, kv_cache=cache, kv_cache_mode="cached")[0]
    return out, later_out, cache


@pytest.mark.parametrize("processors", ["ours", "diffusers_kv"])
@pytest.mark.parametrize("batch", [1, 2])
def test_klein_kv_cache_matches_diffusers_reference_at_one_rank(checkpoint, batch, processors):
    """Our processors take the KV arguments as diffusers' KV processors do; theirs, set on ours, run as in diffusers."""
    ref = ReferenceTransformer.from_pretrained(checkpoint).eval()
    ours = Flux2Transformer2DModel.from_pretrained(checkpoint).eval()
    set_klein_kv_processors(ref)
    if processors == "diffusers_kv":
        set_klein_kv_processors(ours)
    first, later, ref_len = klein_kv_inputs(batch)
    expected, expected_later, expected_cache = kv_steps(ref, first, later, ref_len)
    actual, actual_later, cache = kv_steps(ours, first, later, ref_len)
    assert actual.shape == (batch, first["hidden_states"].shape[1] - ref_len, CONFIG["in_channels"])
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
    torch.testing.assert_close(actual_later, expected_later, rtol=0, atol=1e-5)
    assert cache.num_ref_tokens == ref_len
    layers = zip(
        cache.double_block_caches + cache.single_block_caches,
        expected_cache.double_block_caches + expected_cache.single_block_caches,
    )
    for layer, expected_layer in layers:  # diffusers' format at one rank: [B, reference tokens, H, D]
        torch.testing.assert_close(layer.get(), expected_layer.get(), rtol=0, atol=1e-5)


def test_klein_kv_cached_step_equals_recomputing_the_references(models):
    """The cached step's output is the first-step computation at the later step's inputs: the reference tokens
    attend only to themselves at a fixed timestep, so their keys and values never change."""
    _, ours = models
    first, later, ref_len = klein_kv_inputs(2)
    _, cached, _ = kv_steps(ours, first, later, ref_len)
    recomputed_inputs = dict(
        later,
        hidden_states=torch.cat([first["hidden_states"][:, :ref_len], later["hidden_states"]], dim=1),
        img_ids=first["img_ids"],
    )
    with torch.no_grad():
        recomputed = ours(**recomputed_inputs, kv_cache_mode="extract", num_ref_tokens=ref_len)[0]
    torch.testing.assert_close(cached, recomputed, rtol=0, atol=1e-5)


def test_klein_kv_arguments_with_diffusers_default_processors_match_the_reference(checkpoint):
    """With diffusers' default processors set on both, the KV arguments are ignored alike (the reference's
    processors take none of them): our forward hands the blocks what diffusers' does."""
    ref = ReferenceTransformer.from_pretrained(checkpoint).eval()
    ours = Flux2Transformer2DModel.from_pretrained(checkpoint).eval()
    ours.set_attn_processor(
        {name: type(proc)() for name, proc in ref.attn_processors.items()}  # fresh default instances
    )
    first, _, ref_len = klein_kv_inputs(1)
    with torch.no_grad():
        expected = ref(**first, kv_cache_mode="extract", num_ref_tokens=ref_len)[0]
        actual = ours(**first, kv_cache_mode="extract", num_ref_tokens=ref_len)[0]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


# ---- under SP (gloo workers) ----------------------------------------------------------------


def sp_forward(folder: str, case: str, mode: str, batch: int, random_padding: bool = False):
    """Worker side: our forward under the worker's SP group in one padding mode; (output, warnings logged)."""
    model = worker_model(Flux2Transformer2DModel.from_pretrained, folder)
    with sp_mode(mode, random_padding) as warnings, torch.no_grad():
        output = model(**make_inputs(case, batch))[0]
    return output, warnings


def on_pool(sp_pool, checkpoint: str, case: str, batch: int):
    """`sp_forward` on the pool's ranks as conformance's checks call it."""
    return lambda mode, random_padding: sp_pool.run(sp_forward, checkpoint, case, mode, batch, random_padding)


@pytest.mark.parametrize("case", ["generate", "reference_image"])
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoint, case):
    _, ours = models
    for batch in (1, 2):
        with torch.no_grad():
            expected = ours(**make_inputs(case, batch))[0]
        conformance.assert_sp_exact_modes_match(on_pool(sp_pool, checkpoint, case, batch), expected)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoint, mode):
    conformance.assert_sp_padding_content_never_reaches_real_tokens(
        on_pool(sp_pool, checkpoint, "reference_image", 2), mode
    )


def test_sp_padding_hook_changes_unmasked_output(sp_pool, checkpoint):
    conformance.assert_sp_padding_hook_changes_unmasked_output(on_pool(sp_pool, checkpoint, "generate", 1))


def test_sp_unmasked_padding_is_close_but_not_equal_and_warns(sp_pool, models, checkpoint):
    _, ours = models
    with torch.no_grad():
        expected = ours(**make_inputs("generate", 1))[0]
    sp_pool.run(reset_warning_once)
    sp = on_pool(sp_pool, checkpoint, "generate", 1)
    conformance.assert_sp_unmasked_padding_is_close_but_not_equal(sp, expected, sp_pool.world_size, once=True)
    with torch.no_grad():
        expected = ours(**make_inputs("divisible", 1))[0]
    conformance.assert_sp_none_mode_exact_without_padding(
        on_pool(sp_pool, checkpoint, "divisible", 1), expected, silent=False
    )


def sp_kv_forward(folder: str, mode: str, batch: int, random_padding: bool = False):
    """Worker side: klein KV's first and later step under the worker's SP group; (first, later, warnings)."""
    model = worker_model(Flux2Transformer2DModel.from_pretrained, folder)
    with sp_mode(mode, random_padding) as warnings:
        first, later, _ = kv_steps(model, *klein_kv_inputs(batch))
    return first, later, warnings


def kv_on_pool(sp_pool, checkpoint: str, batch: int):
    """`sp_kv_forward` on the pool's ranks as conformance's checks call it: ((first, later), warnings) per rank."""
    return lambda mode, random_padding: [
        ((first, later), warnings)
        for first, later, warnings in sp_pool.run(sp_kv_forward, checkpoint, mode, batch, random_padding)
    ]


def both_steps_close(actual: tuple, expected: tuple) -> None:
    for a, e in zip(actual, expected, strict=True):
        conformance.assert_close(a, e)


def both_steps_equal(a: tuple, b: tuple) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def test_sp_klein_kv_exact_modes_match_single_process(sp_pool, models, checkpoint):
    """Image, text and reference tokens all pad at 2 and 3 ranks; each rank keeps its heads' reference K/V."""
    _, ours = models
    for batch in (1, 2):
        expected = kv_steps(ours, *klein_kv_inputs(batch))[:2]
        conformance.assert_sp_exact_modes_match(
            kv_on_pool(sp_pool, checkpoint, batch), expected, compare=both_steps_close
        )


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_klein_kv_padding_content_never_reaches_real_tokens(sp_pool, checkpoint, mode):
    """Random padding at the first step, kept in the reference K/V (mask mode), changes no real token at either step."""
    conformance.assert_sp_padding_content_never_reaches_real_tokens(
        kv_on_pool(sp_pool, checkpoint, 2), mode, equal=both_steps_equal
    )


def test_sp_klein_kv_cache_from_another_layout_is_refused(sp_pool, checkpoint):
    """A cache kept at one rank holds every head: a later step under SP names the mismatch."""
    results = sp_pool.run(sp_kv_with_single_process_cache, checkpoint)
    assert all("another sequence-parallel layout" in message for message in results)


def sp_kv_with_single_process_cache(folder: str) -> str:
    model = worker_model(Flux2Transformer2DModel.from_pretrained, folder)
    first, later, ref_len = klein_kv_inputs(1)
    state = get_parallel_state()
    with use_parallel_state(None), torch.no_grad():
        _, cache = model(**first, kv_cache_mode="extract", num_ref_tokens=ref_len)
    try:
        with use_parallel_state(state), torch.no_grad():
            model(**later, kv_cache=cache, kv_cache_mode="cached")
    except ValueError as exc:
        return str(exc)
    return "no error"
