"""`Omni`: the offline engine. `from vllm_omni import Omni`.

with Omni("tiny/qwen-image", ulysses_degree=2) as omni:
    images = omni.generate("a cat", height=208, width=240, num_inference_steps=4, seed=0)
"""

from __future__ import annotations

import dataclasses
import queue
from typing import Any

from vllm_omni.diffusion.config import (
    DiffusionParallelConfig,
    EngineLimits,
    OmniDiffusionConfig,
    StepCacheConfig,
    normalize_dtype_name,
)
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

    def __init__(
        self,
        model: str,
        *,
        ulysses_degree: int = 1,
        ring_degree: int = 1,
        cfg_parallel_size: int = 1,
        mask_sp_padding: bool = False,
        trim_sp_padding: bool = True,
        vae_parallel: bool | None = None,
        device: str | None = None,
        dtype: Any = None,
        attention_backend: str | None = None,
        enforce_eager: bool = False,
        quantization: str | None = None,
        cache: str | StepCacheConfig | None = None,
        cache_threshold: float | None = None,
        warmup: bool | None = None,
        warmup_size: tuple[int, int] | None = None,
        distributed_executor_backend: str = "mp",
        data_parallel_size: int = 1,
        ray_address: str | None = None,
        limits: EngineLimits | None = None,
        load_timeout_s: float | None = None,
        stall_timeout_s: float | None = None,
    ) -> None:
        from vllm_omni.diffusion.engine.core import DiffusionEngine

        parallel = DiffusionParallelConfig(
            ulysses_degree=ulysses_degree,
            ring_degree=ring_degree,
            cfg_parallel_size=cfg_parallel_size,
            mask_sp_padding=mask_sp_padding,
            trim_sp_padding=trim_sp_padding,
            vae_parallel=vae_parallel,
            distributed_executor_backend=distributed_executor_backend,
            data_parallel_size=data_parallel_size,
        )
        config = OmniDiffusionConfig(
            model=model,
            parallel_config=parallel,
            device=device,
            dtype=None if dtype is None else normalize_dtype_name(dtype),
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            quantization=quantization,
            cache=_step_cache(cache, cache_threshold),
            warmup=warmup,
            warmup_size=warmup_size,
            ray_address=ray_address,
            load_timeout_s=load_timeout_s,  # None: the env var, else the default
            stall_timeout_s=stall_timeout_s,
        )
        self.engines: list[DiffusionEngine] = []
        try:
            for replica in range(data_parallel_size):  # each loads in the background while the next starts
                self.engines.append(DiffusionEngine(dataclasses.replace(config, replica=replica), limits))
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


def _step_cache(cache: str | StepCacheConfig | None, threshold: float | None) -> StepCacheConfig | None:
    if isinstance(cache, StepCacheConfig):
        if threshold is not None:
            raise ValueError("cache_threshold goes inside the StepCacheConfig given as cache")
        return cache
    if cache is None:
        if threshold is not None:
            raise ValueError('cache_threshold needs a cache: give cache="first_block"')
        return None
    return StepCacheConfig(cache) if threshold is None else StepCacheConfig(cache, threshold)
