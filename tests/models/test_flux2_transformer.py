"""Our FLUX.2 transformer against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32.
Token counts are chosen so that 2 and 3 ranks pad both streams.
"""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch
from diffusers import Flux2Transformer2DModel as ReferenceTransformer
from diffusers.models.transformers import transformer_flux2 as reference
from sp_padding import random_sp_padding

from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.comm import SimulatedGroup
from vllm_omni.diffusion.distributed.parallel_state import ParallelState, get_parallel_state, use_parallel_state
from vllm_omni.diffusion.models.flux2 import Flux2Transformer2DModel
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


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> str:
    torch.manual_seed(0)
    ref = ReferenceTransformer(**CONFIG).eval()
    # Move every weight off its initial value (modulations, norms) so no path is trivially zero.
    with torch.no_grad():
        for p in ref.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    folder = tmp_path_factory.mktemp("flux2_transformer")
    ref.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def models(checkpoint):
    return ReferenceTransformer.from_pretrained(checkpoint).eval(), Flux2Transformer2DModel.from_pretrained(
        checkpoint
    ).eval()


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
    ref, ours = models
    assert list(ref.state_dict()) == list(ours.state_dict())
    assert dict(ref.config) == dict(ours.config)


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


def klein_kv_inputs(batch: int) -> tuple[dict, dict, int]:
    """klein KV's two kinds of call: the first step, the reference image's tokens in front ([reference, image]),
    extracts their keys and values; a later step (the image alone) reads them from the cache."""
    first = make_inputs("reference_image", batch)
    (image_h, image_w), (ref_h, ref_w) = CASES["reference_image"][0]
    image_len, ref_len = image_h * image_w, ref_h * ref_w
    order = torch.cat([torch.arange(image_len, image_len + ref_len), torch.arange(image_len)])
    first.update(hidden_states=first["hidden_states"][:, order], img_ids=first["img_ids"][:, order])
    return first, make_inputs("generate", batch, seed=2), ref_len


def set_klein_kv_processors(model) -> None:
    """What diffusers' Flux2KleinKVPipeline installs on its transformer."""
    for block in model.transformer_blocks:
        block.attn.set_processor(reference.Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(reference.Flux2KVParallelSelfAttnProcessor())


@pytest.mark.parametrize("batch", [1, 2])
def test_klein_kv_cache_matches_diffusers_reference_at_one_rank(checkpoint, batch):
    ref = ReferenceTransformer.from_pretrained(checkpoint).eval()
    ours = Flux2Transformer2DModel.from_pretrained(checkpoint).eval()
    set_klein_kv_processors(ref)
    set_klein_kv_processors(ours)
    first, later, ref_len = klein_kv_inputs(batch)
    extract = dict(kv_cache_mode="extract", num_ref_tokens=ref_len, ref_fixed_timestep=0.0)
    with torch.no_grad():
        expected, expected_cache = ref(**first, **extract)
        actual, cache = ours(**first, **extract)
        assert actual.shape == (batch, first["hidden_states"].shape[1] - ref_len, CONFIG["in_channels"])
        torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)
        layers = zip(
            cache.double_block_caches + cache.single_block_caches,
            expected_cache.double_block_caches + expected_cache.single_block_caches,
        )
        for layer, expected_layer in layers:
            torch.testing.assert_close(layer.get(), expected_layer.get(), rtol=0, atol=1e-5)
        cached = dict(kv_cache_mode="cached", return_dict=True)
        expected = ref(**dict(later, kv_cache=expected_cache, **cached)).sample
        actual = ours(**dict(later, kv_cache=cache, **cached)).sample
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_klein_kv_arguments_with_our_processors_match_the_reference(models):
    """Without the KV processors both models ignore the cache arguments alike (diffusers' KV-mode tests do this)."""
    ref, ours = models
    first, _, ref_len = klein_kv_inputs(1)
    with torch.no_grad():
        expected = ref(**first, kv_cache_mode="extract", num_ref_tokens=ref_len)[0]
        actual = ours(**first, kv_cache_mode="extract", num_ref_tokens=ref_len)[0]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_klein_kv_cache_is_refused_under_sp(models):
    _, ours = models
    first, later, ref_len = klein_kv_inputs(1)
    state = ParallelState(DiffusionParallelConfig(ulysses_degree=2), 0, 2, SimulatedGroup(2), None)
    cache = reference.Flux2KVCache(CONFIG["num_layers"], CONFIG["num_single_layers"])
    with use_parallel_state(state), torch.no_grad():
        with pytest.raises(NotImplementedError, match="KV cache.*sequence parallelism"):
            ours(**first, kv_cache_mode="extract", num_ref_tokens=ref_len)
        with pytest.raises(NotImplementedError, match="KV cache.*sequence parallelism"):
            ours(**later, kv_cache=cache, kv_cache_mode="cached")


# ---- under SP (gloo workers) ----------------------------------------------------------------

_MODES = {
    "mask": DiffusionParallelConfig(mask_sp_padding=True),
    "trim": DiffusionParallelConfig(),
    "none": DiffusionParallelConfig(trim_sp_padding=False),
}
_worker_models: dict = {}


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def sp_forward(folder: str, case: str, mode: str, batch: int, random_padding: bool = False):
    """Worker side: our forward under the worker's SP group in one padding mode; (output, warnings logged)."""
    if folder not in _worker_models:
        _worker_models[folder] = Flux2Transformer2DModel.from_pretrained(folder).eval()
    state = get_parallel_state()
    config = _MODES[mode].replace(ulysses_degree=state.config.ulysses_degree)
    warnings = _Warnings()
    logging.getLogger("vllm_omni").addHandler(warnings)
    try:
        with random_sp_padding(random_padding), use_parallel_state(dataclasses.replace(state, config=config)):
            with torch.no_grad():
                output = _worker_models[folder](**make_inputs(case, batch))[0]
    finally:
        logging.getLogger("vllm_omni").removeHandler(warnings)
    return output, warnings.messages


def reset_warnings() -> None:
    reset_warning_once()


@pytest.mark.parametrize("case", ["generate", "reference_image"])
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoint, case):
    _, ours = models
    for batch in (1, 2):
        with torch.no_grad():
            expected = ours(**make_inputs(case, batch))[0]
        for mode in ("mask", "trim"):
            for out, warnings in sp_pool.run(sp_forward, checkpoint, case, mode, batch):
                torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
                assert warnings == []


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoint, mode):
    clean = sp_pool.run(sp_forward, checkpoint, "reference_image", mode, 2)
    noisy = sp_pool.run(sp_forward, checkpoint, "reference_image", mode, 2, random_padding=True)
    for (a, _), (b, _) in zip(clean, noisy):
        assert torch.equal(a, b)


def test_sp_padding_hook_changes_unmasked_output(sp_pool, checkpoint):
    """The hook really writes the padding: in none mode random padding changes real tokens."""
    clean = sp_pool.run(sp_forward, checkpoint, "generate", "none", 1)
    noisy = sp_pool.run(sp_forward, checkpoint, "generate", "none", 1, random_padding=True)
    for (a, _), (b, _) in zip(clean, noisy):
        assert not torch.equal(a, b)


def test_sp_unmasked_padding_is_close_but_not_equal_and_warns(sp_pool, models, checkpoint):
    _, ours = models
    with torch.no_grad():
        expected = ours(**make_inputs("generate", 1))[0]
    sp_pool.run(reset_warnings)
    results = sp_pool.run(sp_forward, checkpoint, "generate", "none", 1)
    for out, warnings in results:
        diff = (out - expected).abs().max().item()
        assert 0 < diff < 0.5 * expected.abs().max().item()
        assert len(warnings) == 1 and "unmasked SP padding" in warnings[0]
        assert f"ulysses_degree={sp_pool.world_size}" in warnings[0]
    # Once per process: the next forward is silent.
    assert all(warnings == [] for _, warnings in sp_pool.run(sp_forward, checkpoint, "generate", "none", 1))
    # Without padding, none mode is exact.
    with torch.no_grad():
        expected = ours(**make_inputs("divisible", 1))[0]
    for out, _ in sp_pool.run(sp_forward, checkpoint, "divisible", "none", 1):
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-5)
