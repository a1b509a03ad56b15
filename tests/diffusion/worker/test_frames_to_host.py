"""The worker's last step (runner.frames_to_host): a pipeline's frames, converted on their device, reach the host
with the values numpy's conversion of the float32 frames gave, for images and videos, in chunks; a NaN or Inf
fails the request. A tiny image and a tiny video request through the runner: its uint8 output is the float32
output converted as before."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.worker import runner as runner_module
from vllm_omni.diffusion.worker.runner import PipelineRunner, frames_to_host


def numpy_uint8(array: np.ndarray) -> np.ndarray:
    """What the worker computed on the host before: the float32 frames, channels last, to uint8."""
    return (array.clip(0, 1) * 255).round().astype(np.uint8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 5, 7), (2, 9, 3, 4, 6)], ids=["images", "video"])
def test_uint8_frames_are_numpy_s_conversion_in_every_chunk(monkeypatch, shape, dtype):
    monkeypatch.setattr(runner_module, "CONVERT_CHUNK_ELEMENTS", 2 * 3 * 4 * 6)  # chunks of 2 pictures, one short
    gen = torch.Generator().manual_seed(0)
    frames = torch.rand(shape, generator=gen).mul(1.2).sub(0.1).to(dtype)  # some values outside [0, 1]
    flat = frames.view(-1)
    ties = (torch.arange(8) + 0.5) / 255  # x * 255 lands on k + 0.5 (or next to it): round half to even decides
    flat[: ties.numel()] = ties.to(dtype)
    expected = numpy_uint8(np.moveaxis(frames.float().numpy(), -3, -1))
    as_uint8 = frames_to_host(frames, as_float=False)
    assert as_uint8.dtype == np.uint8 and as_uint8.shape == expected.shape
    np.testing.assert_array_equal(as_uint8, expected)
    as_float = frames_to_host(frames, as_float=True)
    assert as_float.dtype == np.float32
    np.testing.assert_array_equal(as_float, np.moveaxis(frames.float().numpy(), -3, -1))


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_non_finite_value_fails(bad):
    frames = torch.rand(1, 3, 4, 4)
    frames[0, 1, 2, 3] = bad
    with pytest.raises(FloatingPointError, match="non-finite"):
        frames_to_host(frames, as_float=False)


@pytest.mark.parametrize(
    "name, fields",
    [
        ("tiny/qwen-image", dict(height=48, width=64, negative_prompt="blurry", true_cfg_scale=4.0)),
        ("tiny/wan2.2-ti2v", dict(height=64, width=96, num_frames=5, guidance_scale=4.0)),
    ],
)
def test_the_runner_s_uint8_output_is_its_float_output_converted(name, fields):
    path = resolve_model_path(name)
    runner = PipelineRunner(path, read_pipeline_spec(path), torch.device("cpu"), torch.float32, rank=0)
    outputs = {}
    for output_type in ("np", "uint8"):
        request = DiffusionRequest(
            request_id=output_type, prompt="a red fox", num_inference_steps=2, seed=5, output_type=output_type, **fields
        )
        outputs[output_type] = runner.run(request, lambda step: None)
    assert outputs["np"].dtype == np.float32
    np.testing.assert_array_equal(outputs["uint8"], numpy_uint8(outputs["np"]))
