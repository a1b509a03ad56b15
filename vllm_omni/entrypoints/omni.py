"""`Omni`: the offline engine. `from vllm_omni import Omni`.

with Omni("tiny/qwen-image", ulysses_degree=2) as omni:
    images = omni.generate("a cat", height=208, width=240, num_inference_steps=4, seed=0)
"""

from __future__ import annotations

import queue
from typing import Any

from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.engine.request_fields import FIELDS_BY_NAME
from vllm_omni.diffusion.request import GenerationParams


class Omni:
    """Starts one worker per rank (CUDA + NCCL when there are enough GPUs, else CPU + gloo).

    `distributed_executor_backend="ray"` runs the ranks as Ray actors: this process's Ray
    connection if it has one, else the cluster at `ray_address` ("auto" or "HEAD_IP:6379"), else
    a private Ray instance on this machine (docs/multinode.md). `data_parallel_size=N` starts N
    replicas, each a group of its own ranks (and GPUs): `generate` is thread-safe, and calls made
    at once from N threads run at once, each on an idle replica. `quantization="fp8"`: FP8 matmuls in
    the denoisers' large linear layers (CUDA GPUs of compute capability 8.9+, `pip install 'vllm_omni[fp8]'`).
    `cache="first_block"` (with `cache_threshold`): step caching in the denoisers (diffusion/worker/step_cache.py);
    each output's `step_cache` says which steps it skipped.
    """

    def __init__(self, model: str, **options: Any) -> None:
        """`options` are the engine options, by name: `EngineArgs`' fields (diffusion/engine/args.py),
        e.g. ulysses_degree, mask_sp_padding, device, dtype, quantization, cache, limits' max_steps; an
        unknown name is a TypeError naming it. `limits=EngineLimits(...)` and `cache=StepCacheConfig(...)`
        are accepted as shorthands."""
        from vllm_omni.diffusion.engine.core import DiffusionEngine

        self.engine_args = EngineArgs.from_kwargs(model, **options)  # every check, before any worker starts
        self.engines: list[DiffusionEngine] = []
        try:
            for replica in range(self.engine_args.data_parallel_size):  # each loads while the next starts
                self.engines.append(DiffusionEngine(self.engine_args.engine_config(replica), self.engine_args.limits))
            for engine in self.engines:
                engine.wait_until_ready()
        except BaseException:
            self.close()
            raise
        self.engine = self.engines[0]
        self._idle: queue.Queue[DiffusionEngine] = queue.Queue()
        for engine in self.engines:
            self._idle.put(engine)
        self.last_output = None

    def generate(
        self,
        prompt: str,
        *,
        image: Any = None,
        output_type: str = "pil",
        **fields: Any,
    ) -> list[Any]:
        """Images or videos for one prompt.

        `fields` are the declared request fields (vllm_omni/diffusion/engine/request_fields.py):
        negative_prompt, height, width, num_inference_steps, guidance_scale, guidance_scale_2, true_cfg_scale, n,
        seed, and for video models num_frames and fps. `image` is a path, bytes or a PIL image, or
        a list of them. Returns PIL images (a video: a list of PIL frames), float32 arrays in
        [0, 1] with output_type="np", uint8 arrays with "uint8". The seed used (drawn when not
        given), the real size and the timings are in `self.last_output`.
        """
        unknown = sorted(set(fields) - set(FIELDS_BY_NAME))
        if unknown:
            raise TypeError(
                f"generate() got unknown argument(s) {', '.join(unknown)}; request fields: {', '.join(FIELDS_BY_NAME)}"
            )
        params = GenerationParams(prompt=prompt, image=image, output_type=output_type, **fields)
        engine = self._idle.get()  # waits while every replica runs another thread's request
        try:
            output = engine.step(params)
        finally:
            self._idle.put(engine)
        self.last_output = output  # with several threads: the latest call's
        return output.images

    def close(self) -> None:
        for engine in self.engines:
            engine.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
