"""What every SP transformer keeps of diffusers' contract, and its compiled blocks.

Runs on the tiny Qwen-Image transformer (the other families add their classes to FAMILIES here):
a processor set with `set_attn_processor` is the one that runs, `attention_kwargs={"scale": ...}`
goes through diffusers' LoRA scaling rather than into the processors, and the regionally
compiled blocks (what the runner does on GPUs) give the same output as eager ones.
"""

from __future__ import annotations

import pytest
import torch

from vllm_omni.diffusion.cuda_graphs import compile_repeated_blocks
from vllm_omni.diffusion.models.qwen_image import QwenImageTransformer2DModel

QWEN_CONFIG = dict(
    patch_size=2,
    in_channels=16,
    out_channels=4,
    num_layers=2,
    attention_head_dim=16,
    num_attention_heads=6,
    joint_attention_dim=32,
    axes_dims_rope=(4, 6, 6),
)


def qwen_inputs() -> dict:
    gen = torch.Generator().manual_seed(0)
    return dict(
        hidden_states=torch.randn(1, 35, 16, generator=gen),
        encoder_hidden_states=torch.randn(1, 7, 32, generator=gen),
        timestep=torch.rand(1, generator=gen),
        img_shapes=[[(1, 5, 7)]],
        return_dict=False,
    )


FAMILIES = {"qwen_image": (QwenImageTransformer2DModel, QWEN_CONFIG, qwen_inputs)}


@pytest.fixture(params=sorted(FAMILIES))
def family(request):
    cls, config, inputs = FAMILIES[request.param]
    torch.manual_seed(0)
    return cls(**config).eval(), inputs


def test_set_attn_processor_takes_effect(family):
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
        scaled = model(**inputs(), attention_kwargs={"scale": 1.0})[0]
    torch.testing.assert_close(scaled, plain, rtol=0, atol=0)


def test_compiled_blocks_equal_eager(family):
    model, inputs = family
    with torch.no_grad():
        expected = model(**inputs())[0]
    assert compile_repeated_blocks(model, backend="eager") == model.config.num_layers
    with torch.no_grad():
        actual = model(**inputs())[0]
    torch.testing.assert_close(actual, expected, rtol=1e-6, atol=1e-6)
