"""What every SP transformer keeps of diffusers' contract, and its compiled blocks.

Runs on a small transformer of every family (a new family adds its class to FAMILIES here):
a processor set with `set_attn_processor` is the one that runs, `attention_kwargs={"scale": ...}`
goes through diffusers' LoRA scaling rather than into the processors, and the regionally
compiled blocks (what the runner does on GPUs) give the same output as eager ones.
"""

from __future__ import annotations

import inspect

import pytest
import test_flux2_transformer as flux2_case
import test_glm_image_transformer as glm_image_case
import test_hunyuan_video_15_transformer as hunyuan_case
import test_ltx2_transformer as ltx2_case
import test_qwen_image21_transformer as qwen_image21_case
import test_wan22_transformer as wan22_case
import test_z_image_transformer as z_image_case
import torch
from tiny_qwen_transformer import QWEN_CONFIG, qwen_inputs

from vllm_omni.diffusion.models.flux2.transformer import Flux2Transformer2DModel
from vllm_omni.diffusion.models.glm_image.transformer import GlmImageTransformer2DModel
from vllm_omni.diffusion.models.hunyuan_video_15.transformer import HunyuanVideo15Transformer3DModel
from vllm_omni.diffusion.models.ltx2.transformer import LTX2VideoTransformer3DModel
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel
from vllm_omni.diffusion.models.qwen_image21.transformer import QwenImage21Transformer2DModel
from vllm_omni.diffusion.models.wan22.transformer import WanTransformer3DModel
from vllm_omni.diffusion.models.z_image.transformer import ZImageTransformer2DModel
from vllm_omni.diffusion.worker.cuda_graphs import compile_repeated_blocks

FAMILIES = {
    "qwen_image": (QwenImageTransformer2DModel, QWEN_CONFIG, qwen_inputs),
    "flux2": (Flux2Transformer2DModel, flux2_case.CONFIG, lambda: flux2_case.make_inputs("generate", 1)),
    "hunyuan_video_15": (
        HunyuanVideo15Transformer3DModel,
        hunyuan_case.CONFIG,
        lambda: dict(hunyuan_case.make_inputs(hunyuan_case.PARITY_CASES["t2v_glyph"]), return_dict=False),
    ),
    "qwen_image21": (
        QwenImage21Transformer2DModel,
        qwen_image21_case.CONFIG,
        lambda: qwen_image21_case.make_inputs("condition", 1),
    ),
    "wan22": (WanTransformer3DModel, wan22_case.CONFIGS["5b"], lambda: wan22_case.make_inputs(wan22_case.Case("5b"))),
    "glm_image": (
        GlmImageTransformer2DModel,
        glm_image_case.CONFIG,
        lambda: glm_image_case.make_inputs(glm_image_case.COND),
    ),
    "z_image": (ZImageTransformer2DModel, z_image_case.CONFIG, lambda: z_image_case.make_inputs("cfg")),
    "ltx2": (
        LTX2VideoTransformer3DModel,
        ltx2_case.CONFIGS["2.3"],  # gates, prompt modulation, perturbed self-attention
        lambda: ltx2_case.make_inputs(ltx2_case.Case("2.3", stg=True, per_token_timestep=True)),
    ),
}
# Families whose diffusers class has no processor API to set (family -> why the test is skipped).
NO_SET_ATTN_PROCESSOR = {
    "glm_image": "diffusers' GlmImageTransformer2DModel has no attn_processors / set_attn_processor",
    "z_image": "diffusers' ZImageTransformer2DModel has no attn_processors / set_attn_processor (a processor set on "
    "a block's attention is tested in test_z_image_transformer.py)",
}


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    cls, config, inputs = FAMILIES[request.param]
    torch.manual_seed(0)
    return cls(**config).eval(), inputs


def test_set_attn_processor_takes_effect(family, request):
    reason = NO_SET_ATTN_PROCESSOR.get(request.node.callspec.params["family"])
    if reason:
        pytest.skip(reason)
    model, inputs = family
    calls = []
    processors = model.attn_processors

    class Recording:
        def __init__(self, inner):
            self.inner = inner

        def __call__(self, *args, **kwargs):
            calls.append(1)
            return self.inner(*args, **kwargs)

    model.set_attn_processor({name: Recording(p) for name, p in processors.items()})
    with torch.no_grad():
        model(**inputs())
    assert len(calls) == len(processors)


def test_lora_scale_goes_through_diffusers_scaling(family):
    model, inputs = family
    with torch.no_grad():
        plain = model(**inputs())[0]
        name = next(
            n
            for n in ("attention_kwargs", "joint_attention_kwargs")
            if n in inspect.signature(model.forward).parameters
        )
        scaled = model(**inputs(), **{name: {"scale": 1.0}})[0]
    torch.testing.assert_close(scaled, plain, rtol=0, atol=0)


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
def test_compiled_blocks_equal_eager(family):
    model, inputs = family
    with torch.no_grad():
        expected = model(**inputs())[0]
    blocks = [m for m in model.modules() if type(m).__name__ in model._repeated_blocks]
    assert blocks and compile_repeated_blocks(model, backend="eager") == len(blocks)
    with torch.no_grad():
        actual = model(**inputs())[0]
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
