"""The engine's warm-up requests: what makes compiled blocks dynamic before the first user request.

torch.compile specialises a compiled block to the first shapes it sees and recompiles once, with
the sequence lengths dynamic, at the first other shape (seen on the CPU in
`test_two_shapes_make_the_compiled_blocks_dynamic`); on an H200 that recompile took 8.7 s of
Qwen-Image's first 1328x1328 request. So with compiled blocks the engine sends a second warm-up
request that changes every sequence length, and these tests check that it does, for every
family, and that the engine's own checks accept it.
"""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image
from test_preprocess import preprocessor

from vllm_omni.diffusion.engine.core import WARMUP_PROMPT, warmup_requests
from vllm_omni.diffusion.models.text_compaction import BUCKET_MULTIPLE

MODELS = [
    "tiny/qwen-image",
    "tiny/qwen-image-edit",
    "tiny/flux2",
    "tiny/hunyuan-video-1.5",
    "tiny/hunyuan-video-1.5-i2v",
]


def _shape(request) -> tuple:
    images = tuple(Image.open(io.BytesIO(image)).size for image in request.images or ())
    return request.height, request.width, request.num_frames, images


@pytest.mark.parametrize("model", MODELS)
def test_with_compiled_blocks_a_second_request_changes_the_image_and_text_lengths(model):
    pre = preprocessor(model)
    first, second = (pre(params, params.request_id, 0) for params in warmup_requests(pre.spec, None, dynamic=True))
    assert _shape(first) != _shape(second)
    if second.height is not None:
        step = pre.spec.size_multiple
        assert second.height % step == 0 and second.width % step == 0
    tokens = [len(pre.tokens.tokenizer(r.prompt)["input_ids"]) for r in (first, second)]
    assert tokens[0] <= BUCKET_MULTIPLE < tokens[1]  # another text bucket
    assert (first.request_id, second.request_id) == ("warm-up", "warm-up-2")


def test_without_compiled_blocks_one_request_at_the_deploy_size():
    pre = preprocessor("tiny/qwen-image")
    (only,) = warmup_requests(pre.spec, (1328, 1328), dynamic=False)
    request = pre(only, only.request_id, 0)
    assert (request.width, request.height, request.prompt) == (1328, 1328, WARMUP_PROMPT)
    assert request.num_inference_steps == 2


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
def test_two_shapes_make_the_compiled_blocks_dynamic():
    """Why the second request: after two shapes, no further size or text length compiles a graph."""
    import torch._dynamo.utils as dynamo_utils

    from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel
    from vllm_omni.diffusion.worker.cuda_graphs import compile_repeated_blocks

    torch._dynamo.reset()
    torch.manual_seed(0)
    config = dict(patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16)
    config.update(num_attention_heads=6, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
    model = QwenImageTransformer2DModel(**config).eval()
    compile_repeated_blocks(model, backend="eager")

    def new_graphs(rows: int, cols: int, text: int) -> int:
        gen = torch.Generator().manual_seed(0)
        inputs = dict(
            hidden_states=torch.randn(1, rows * cols, 16, generator=gen),
            encoder_hidden_states=torch.randn(1, text, 32, generator=gen),
            timestep=torch.rand(1, generator=gen),
            img_shapes=[[(1, rows, cols)]],
            return_dict=False,
        )
        before = dynamo_utils.counters["stats"]["unique_graphs"]
        with torch.no_grad():
            model(**inputs)
        return dynamo_utils.counters["stats"]["unique_graphs"] - before

    assert new_graphs(16, 16, 10) > 0  # the first shape compiles
    assert new_graphs(12, 12, 80) > 0  # the second recompiles, dynamic
    assert [new_graphs(*shape) for shape in [(21, 17, 40), (8, 10, 150), (4, 4, 5)]] == [0, 0, 0]
