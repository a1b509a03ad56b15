"""Qwen-Image pipelines (generate, edit, edit-plus) with our SP transformer in place of theirs.

The diffusers pipeline does everything else: prompt encoding, latents, scheduler, true CFG
with a negative prompt, VAE. A worker builds one `QwenImageRunner` and calls `run` per request.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import diffusers
import numpy as np
import torch

from vllm_omni.diffusion.cuda_graphs import CUDAGraphForward
from vllm_omni.diffusion.data import DiffusionRequest
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel
from vllm_omni.diffusion.models.registry import PipelineSpec

StepCallback = Callable[[int], None]


class QwenImageRunner:
    def __init__(
        self,
        path: Path,
        spec: PipelineSpec,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        enforce_eager: bool = False,
    ) -> None:
        self.spec = spec
        transformer = QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer", dtype=dtype)
        if device.type == "cuda" and not enforce_eager:
            transformer.forward = CUDAGraphForward(transformer.forward)
        pipeline_class = getattr(diffusers, spec.diffusers_class)
        self.pipe = pipeline_class.from_pretrained(path, transformer=transformer, dtype=dtype).to(device)
        self.pipe.set_progress_bar_config(disable=rank != 0, desc="denoising")

    @property
    def num_attention_heads(self) -> int:
        return self.pipe.transformer.config.num_attention_heads

    def run(self, request: DiffusionRequest, on_step_end: StepCallback) -> np.ndarray:
        """Images as float32 [n, H, W, 3] in [0, 1]; `on_step_end(step)` may raise to stop."""

        def callback(pipe, step: int, timestep, tensors: dict) -> dict:
            on_step_end(step)
            return {}

        kwargs = dict(
            prompt=request.prompt,
            negative_prompt=request.negative_prompt,
            height=request.height,
            width=request.width,
            num_inference_steps=request.num_inference_steps,
            true_cfg_scale=request.true_cfg_scale,
            num_images_per_prompt=request.num_images,
            # One CPU generator on every rank: identical latents everywhere, on any device.
            generator=torch.Generator("cpu").manual_seed(request.seed),
            output_type="np",
            callback_on_step_end=callback,
        )
        if request.guidance_scale is not None:
            kwargs["guidance_scale"] = request.guidance_scale
        if self.spec.task == "edit":
            kwargs["image"] = request.images if self.spec.max_input_images > 1 else request.images[0]
        with torch.inference_mode():
            images = self.pipe(**kwargs).images
        return np.asarray(images, dtype=np.float32)
