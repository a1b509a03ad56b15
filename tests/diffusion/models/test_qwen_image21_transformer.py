"""Our Qwen-Image 2.1 transformer against the diffusers reference, single process and under SP.

Same random weights (a checkpoint saved by the diffusers class and loaded by ours); fp32. The target
image's 20 tokens pad at U3, the 7 text tokens at U2 and U3 (the cases with condition images pad too).
"""

from __future__ import annotations

import conformance
import pytest
import torch
from diffusers import QwenImage21Transformer2DModel as ReferenceTransformer
from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21KVCache
from sp_cases import sp_mode, worker_model

from vllm_omni.diffusion.models.qwen_image21.transformer import QwenImage21Transformer2DModel
from vllm_omni.logger import reset_warning_once

CONFIG = dict(
    patch_size=1,
    in_channels=8,
    out_channels=8,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=6,
    context_in_dim=32,
    mlp_ratio=3,
    axes_dims_rope=(4, 6, 6),
)
# (text tokens before the condition images, condition images (1, h, w), text after each, target (1, h, w)).
CASES = {
    "generate": (7, [], 0, (1, 4, 5)),
    "condition": (5, [(1, 2, 4)], 3, (1, 4, 5)),
    "two_conditions": (3, [(1, 2, 2), (1, 2, 4)], 2, (1, 2, 6)),
    "divisible": (6, [], 0, (1, 4, 6)),
}


def make_models(causal_condition: bool, folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    torch.manual_seed(0)
    ref = ReferenceTransformer(**CONFIG, causal_condition=causal_condition).eval()
    # The zero-centred norms start at zero: larger random weights everywhere.
    conformance.save_reference(ref, folder, scale=0.1)
    return ref, QwenImage21Transformer2DModel.from_pretrained(folder).eval()


def make_inputs(case: str, batch: int, seed: int = 1) -> dict:
    text_before, conditions, text_after, target = CASES[case]
    slots = [False] * text_before
    for _, h, w in conditions:
        slots += [True] * (h * w // 4) + [False] * text_after  # one vision slot per 2x2 latent tokens
    text_rows = len(slots)
    slots += [True] * (target[1] * target[2] // 4)  # the target's slots end the sequence
    tokens = sum(h * w for _, h, w in [*conditions, target])
    gen = torch.Generator().manual_seed(seed)
    return dict(
        hidden_states=torch.randn(batch, tokens, CONFIG["in_channels"], generator=gen),
        encoder_hidden_states=torch.randn(batch, text_rows, CONFIG["context_in_dim"], generator=gen),
        timestep=torch.rand(batch, generator=gen),
        img_shapes=[[*conditions, target]] * batch,
        img_mask=torch.tensor([slots] * batch),
        return_dict=False,
    )


def short_last_prompt(inputs: dict) -> torch.Tensor:
    """A text mask whose last row's prompt is two tokens shorter (right padding, as the pipeline pads)."""
    mask = torch.ones(inputs["encoder_hidden_states"].shape[:2], dtype=torch.bool)
    mask[-1, -2:] = False
    return mask


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {cc: make_models(cc, tmp_path_factory.mktemp(f"qwen21_cc{int(cc)}")) for cc in (True, False)}


@pytest.mark.parametrize("causal_condition", [True, False])
@pytest.mark.parametrize("case", ["generate", "condition", "two_conditions"])
@pytest.mark.parametrize("batch", [1, 2])
def test_matches_diffusers_reference(models, causal_condition, case, batch):
    ref, ours = models[causal_condition]
    inputs = make_inputs(case, batch)
    with torch.no_grad():
        expected = ref(**inputs)[0]
        actual = ours(**inputs)[0]
    torch.testing.assert_close(actual, expected, rtol=0, atol=1e-5)


def test_parameter_names_are_the_checkpoints(models):
    conformance.assert_parameter_names_are_the_checkpoints(*models[True], config=None)


@pytest.mark.parametrize("case", ["generate", "condition"])
def test_text_mask_matches_reference_except_at_masked_tokens(models, case):
    ref, ours = models[True]
    inputs = make_inputs(case, 2)
    mask = short_last_prompt(inputs)
    with torch.no_grad():
        expected = ref(**inputs, encoder_hidden_states_mask=mask)[0]
        actual = ours(**inputs, encoder_hidden_states_mask=mask)[0]
    # The masked tokens' rows are zeros (nobody reads them); every other row is the reference's.
    masked = (actual == 0).all(-1)
    assert masked.sum(1).tolist() == [0, 2]
    torch.testing.assert_close(actual[~masked], expected[~masked], rtol=0, atol=1e-5)


def test_the_prefix_kv_cache_runs_diffusers_forward(models):
    ref, ours = models[True]
    inputs = make_inputs("condition", 1)
    outputs = []
    for model in (ref, ours):
        cache = QwenImage21KVCache(CONFIG["num_layers"])
        with torch.no_grad():
            model(**inputs, kv_cache=cache, kv_cache_mode="extract")
            outputs.append(model(**inputs, kv_cache=cache, kv_cache_mode="cached")[0])
    torch.testing.assert_close(outputs[1], outputs[0], rtol=0, atol=1e-5)


# ---- under SP (gloo workers) ----------------------------------------------------------------


def sp_forward(folder: str, case: str, mode: str, batch: int, masked: bool = False, random_padding: bool = False):
    """Worker side: our forward under the worker's SP group in one padding mode; (output, warnings logged)."""
    model = worker_model(QwenImage21Transformer2DModel.from_pretrained, folder)
    inputs = make_inputs(case, batch)
    if masked:
        inputs["encoder_hidden_states_mask"] = short_last_prompt(inputs)
    with sp_mode(mode, random_padding) as warnings, torch.no_grad():
        output = model(**inputs)[0]
    return output, warnings


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, models):
    folder = tmp_path_factory.mktemp("qwen21_ckpt")
    models[True][0].save_pretrained(folder)
    return str(folder)


def on_pool(sp_pool, checkpoint: str, case: str, batch: int, masked: bool = False):
    """`sp_forward` on the pool's ranks as conformance's checks call it."""
    return lambda mode, random_padding: sp_pool.run(sp_forward, checkpoint, case, mode, batch, masked, random_padding)


@pytest.mark.parametrize("case", ["generate", "two_conditions"])
def test_sp_exact_modes_match_single_process(sp_pool, models, checkpoint, case):
    _, ours = models[True]
    for batch, masked in ((1, False), (2, True)):
        inputs = make_inputs(case, batch)
        if masked:
            inputs["encoder_hidden_states_mask"] = short_last_prompt(inputs)
        with torch.no_grad():
            expected = ours(**inputs)[0]
        conformance.assert_sp_exact_modes_match(on_pool(sp_pool, checkpoint, case, batch, masked), expected)


@pytest.mark.parametrize("mode", ["mask", "trim"])
def test_sp_padding_content_never_reaches_real_tokens(sp_pool, checkpoint, mode):
    conformance.assert_sp_padding_content_never_reaches_real_tokens(on_pool(sp_pool, checkpoint, "condition", 1), mode)


def test_sp_unmasked_padding_is_close_but_not_equal_and_warns_once(sp_pool, models, checkpoint):
    _, ours = models[True]
    with torch.no_grad():
        expected = ours(**make_inputs("generate", 1))[0]
    sp_pool.run(reset_warning_once)
    conformance.assert_sp_unmasked_padding_is_close_but_not_equal(
        on_pool(sp_pool, checkpoint, "generate", 1),
        expected,
        sp_pool.world_size,
        once=True,
        part=lambda t: t[:, -20:],  # the target's rows: they see the padding (the text's never do)
    )
    # Without padding, none mode is exact.
    with torch.no_grad():
        expected = ours(**make_inputs("divisible", 1))[0]
    conformance.assert_sp_none_mode_exact_without_padding(
        on_pool(sp_pool, checkpoint, "divisible", 1), expected, silent=False
    )


def test_sp_refuses_the_prefix_kv_cache(sp_pool, checkpoint):
    with pytest.raises(RuntimeError, match="prefix KV cache .* not supported under sequence parallelism"):
        sp_pool.run(_kv_cache_forward, checkpoint)


def _kv_cache_forward(folder: str) -> None:
    model = QwenImage21Transformer2DModel.from_pretrained(folder).eval()
    with torch.no_grad():
        model(**make_inputs("generate", 1), kv_cache=QwenImage21KVCache(CONFIG["num_layers"]), kv_cache_mode="extract")
