"""LoRA on Qwen-Image-Edit and Edit-Plus: the engine's merged adapter equals diffusers' unmerged one on an edit forward.

The edit pipelines resize every source image to about a megapixel, so a whole request costs half a minute on
CPU; what the adapter changes is the transformer, which sees the edit's extra image grids (Edit-Plus: several,
with zero_cond_t). So this compares one transformer forward with the edit's grids: diffusers' pipeline with
`load_lora_weights` + `set_adapters` (PEFT layers, unmerged) against our SP class with the adapter merged by the
worker's `LoraAdapters`, read through the same pipeline's loader; then the base model is restored bit for bit.
Qwen-Image's whole-request parity, kohya files and switching are in tests/entrypoints/test_omni_lora.py.
"""

from __future__ import annotations

import pytest
import torch

from tests.lora_files import make_adapter, pipeline_class
from vllm_omni.diffusion.model_source import resolve_model_path
from vllm_omni.diffusion.models.registry import TINY_MODELS
from vllm_omni.diffusion.request import LoraRequest
from vllm_omni.diffusion.worker.lora import LoraAdapters

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

GRIDS = {  # the target's grid, then the sources' (token counts 35 + 24 (+ 9))
    "tiny/qwen-image-edit": [(1, 5, 7), (1, 4, 6)],
    "tiny/qwen-image-edit-plus": [(1, 5, 7), (1, 4, 6), (1, 3, 3)],
}
SCALE = 0.7


def edit_inputs(transformer: torch.nn.Module, grids: list[tuple[int, int, int]]) -> dict:
    config = transformer.config
    generator = torch.Generator().manual_seed(2)
    tokens = sum(f * h * w for f, h, w in grids)
    return dict(
        hidden_states=torch.randn(1, tokens, config.in_channels, generator=generator),
        encoder_hidden_states=torch.randn(1, 9, config.joint_attention_dim, generator=generator),
        timestep=torch.rand(1, generator=generator),
        img_shapes=[grids],
        return_dict=False,
    )


@pytest.mark.parametrize("model", list(GRIDS))
def test_merged_adapter_equals_diffusers_on_an_edit_forward_and_unmerges_exactly(model, tmp_path):
    path = resolve_model_path(model)
    adapter = make_adapter(path, tmp_path / "adapter", seed=7)
    cls = pipeline_class(path)

    reference = cls.from_pretrained(path, dtype=torch.float32)
    inputs = edit_inputs(reference.transformer, GRIDS[model])
    reference.load_lora_weights(adapter, adapter_name="x")
    reference.set_adapters(["x"], [SCALE])
    ours = (
        TINY_MODELS[model]
        .family_pipeline()
        .denoisers["transformer"]
        .from_pretrained(path, subfolder="transformer", dtype=torch.float32)
    )
    pipe = cls.from_pretrained(path, transformer=ours, dtype=torch.float32)
    adapters = LoraAdapters(pipe, {"transformer": ours}, torch.device("cpu"), 1, 1)
    with torch.no_grad():
        expected = reference.transformer(**inputs)[0]
        base = ours(**inputs)[0]
        adapters.activate(LoraRequest("x", str(adapter), SCALE, 1))
        merged = ours(**inputs)[0]
        adapters.activate(None)
        restored = ours(**inputs)[0]
    assert (expected - base).abs().max() > 100 * (merged - expected).abs().max()  # the adapter matters here
    torch.testing.assert_close(merged, expected, rtol=0, atol=1e-5)
    assert torch.equal(restored, base)
