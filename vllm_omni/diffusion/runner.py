"""One runner for every model family: a diffusers pipeline with our SP transformer swapped in.

A worker (worker.py) builds one `PipelineRunner` and calls `run` per request. What every family
shares lives here: loading the pipeline with the family's transformer, decoding the source images
(they arrive as the compressed files the engine checked), CUDA graphs for the transformer's
sharded forward, CFG parallel (cfg_parallel.py), one CPU generator seeded identically on every
rank (so every rank holds the same latents), the per-step hook (cancellation, progress), the
progress bar on rank 0 only, and the result as uint8 (images [n, H, W, 3], videos
[n, F, H, W, 3]) unless the caller asked for float arrays.

A family supplies only what differs, in `models/<family>/pipeline.py`: its transformer class
(TRANSFORMER_CLASS), `pipeline_kwargs` (request -> the pipeline's keyword arguments; or
`prepare_pipeline(pipe, request, spec)` where the pipeline itself is set per request) and, for
pipelines with CFG, `uses_cfg(request)` and DEFAULT_NEGATIVE_PROMPT.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable
from pathlib import Path

import diffusers
import numpy as np
import torch

from vllm_omni.diffusion.cfg_parallel import CFGParallelForward, swap_prompts
from vllm_omni.diffusion.cuda_graphs import CUDAGraphForward, SimulatedGraphs, compile_repeated_blocks
from vllm_omni.diffusion.data import DiffusionRequest
from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state
from vllm_omni.diffusion.images import decode_image
from vllm_omni.diffusion.models.registry import PipelineSpec

StepCallback = Callable[[int], None]


class PipelineRunner:
    def __init__(
        self,
        path: str | Path,
        spec: PipelineSpec,
        device: torch.device,
        dtype: torch.dtype,
        rank: int,
        enforce_eager: bool = False,
    ) -> None:
        self.spec = spec
        self.family = spec.family_module("pipeline")
        # Straight onto the device, without a random initialisation first (accelerate's meta-device load).
        transformer = self.family.TRANSFORMER_CLASS.from_pretrained(
            path, subfolder="transformer", dtype=dtype, device_map=str(device)
        )
        self.graph_capture_failures: list[str] = []  # this rank's, since the worker last reported them
        simulated = SimulatedGraphs.from_env()  # test-only: the graph decisions on CPU ranks
        if (device.type == "cuda" or simulated is not None) and not enforce_eager:
            if spec.compile_blocks and device.type == "cuda":
                compile_repeated_blocks(transformer)
            # Only the sharded part is replayed: the host-side preparation in `forward` (text
            # compaction, row splitting, rotary tables) decides shapes and runs eagerly before it.
            transformer.forward_sharded = CUDAGraphForward(
                transformer.forward_sharded, on_failure=self.graph_capture_failures.append, simulated=simulated
            )
        state = get_parallel_state()
        self.cfg: CFGParallelForward | None = None
        self.cfg_rank = 0
        if state is not None and state.config.cfg_parallel_size > 1:
            self.cfg = CFGParallelForward(transformer.forward, state.cfg_group)
            self.cfg_rank = state.cfg_rank
            transformer.forward = self.cfg
        pipeline_class = getattr(diffusers, spec.diffusers_class)
        self.pipe = pipeline_class.from_pretrained(path, transformer=transformer, dtype=dtype).to(device)
        self.pipe.set_progress_bar_config(disable=rank != 0, desc="denoising")

    @property
    def num_attention_heads(self) -> int:
        return self.pipe.transformer.config.num_attention_heads

    def run(self, request: DiffusionRequest, on_step_end: StepCallback) -> np.ndarray:
        """Run one request; `on_step_end(step)` is called after every denoising step and may raise to stop.

        Returns uint8 [n, H, W, 3] (video [n, F, H, W, 3]), or float32 in [0, 1] for output_type="np".
        """
        if request.images:
            # The engine checked the files' headers; they travel compressed and are decoded here, once.
            names = [f"image[{i}]" if len(request.images) > 1 else "image" for i in range(len(request.images))]
            request = dataclasses.replace(
                request, images=[decode_image(image, name) for image, name in zip(request.images, names)]
            )
        prepare = getattr(self.family, "prepare_pipeline", None)  # families that configure the pipeline per request
        kwargs = prepare(self.pipe, request, self.spec) if prepare else self.family.pipeline_kwargs(request, self.spec)
        # One CPU generator on every rank: identical latents everywhere, on any device.
        kwargs.update(generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np")
        if self.cfg is not None:
            self.cfg.start_request(self.family.uses_cfg(request))
            if self.cfg.active and self.cfg_rank == 1:
                kwargs = swap_prompts(kwargs, self.family.DEFAULT_NEGATIVE_PROMPT)
        scheduler = self.pipe.scheduler
        scheduler_step = scheduler.step
        steps = itertools.count()

        # Every pipeline calls scheduler.step once per denoising step, whatever callbacks it offers.
        def step_and_report(*args, **step_kwargs):
            out = scheduler_step(*args, **step_kwargs)
            if self.cfg is not None:
                self.cfg.end_step()
            on_step_end(next(steps))
            return out

        scheduler.step = step_and_report
        try:
            with torch.inference_mode():
                result = self.pipe(**kwargs)
        finally:
            del scheduler.step  # back to the class's method
        frames = result.frames if self.spec.modality == "video" else result.images
        array = np.asarray(frames, dtype=np.float32)
        if not np.isfinite(array).all():
            raise FloatingPointError("the pipeline produced non-finite pixel values (NaN or Inf)")
        if request.output_type == "np":
            return array
        # Pictures and files need only uint8: a 121-frame video crosses the worker pipe at a quarter the size.
        return (array.clip(0, 1) * 255).round().astype(np.uint8)
