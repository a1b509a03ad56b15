"""`Omni`: the offline engine, over the same scheduler as the HTTP server. `from vllm_omni import Omni`.

if __name__ == "__main__":  # the workers start with spawn, which runs the script again in each of them
    with Omni("tiny/qwen-image", ulysses_degree=2) as omni:
        images = omni.generate("a cat", height=208, width=240, num_inference_steps=4, seed=0)
"""

from __future__ import annotations

import ast
import asyncio
import dataclasses
import sys
import threading
from collections.abc import Coroutine
from typing import Any

from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.engine.job import Job
from vllm_omni.diffusion.engine.queue_admission import InternalError
from vllm_omni.diffusion.engine.replicas import Engine, engine_factory
from vllm_omni.diffusion.engine.request_fields import FIELDS_BY_NAME
from vllm_omni.diffusion.engine.scheduler import Scheduler
from vllm_omni.diffusion.request import DiffusionOutput, GenerationParams, RequestCancelled, RequestFailed


class Omni:
    """Starts one worker per rank (CUDA + NCCL when there are enough GPUs, else CPU + gloo).

    `distributed_executor_backend="ray"` runs the ranks as Ray actors: this process's Ray
    connection if it has one, else the cluster at `ray_address` ("auto" or "HEAD_IP:6379"), else
    a private Ray instance on this machine (docs/multinode.md). `data_parallel_size=N` starts N
    replicas, each a group of its own ranks (and GPUs): `generate` is thread-safe, and calls made
    at once from N threads run at once, each on an idle replica. `max_batch_size=B` (with
    `batch_wait_ms`) runs up to B calls made at once that can share a forward as one pipeline call
    (docs/serving.md, request batching). `quantization="fp8"`: FP8 matmuls in
    the denoisers' large linear layers (CUDA GPUs of compute capability 8.9+, `pip install -e '.[fp8]'`).
    `cache="first_block"` (with `cache_threshold`): step caching in the denoisers (diffusion/worker/step_cache.py);
    each output's `step_cache` says which steps it skipped.
    """

    def __init__(self, model: str, **options: Any) -> None:
        """`options` are the engine options, by name: `EngineArgs`' fields (diffusion/engine/args.py),
        e.g. ulysses_degree, mask_sp_padding, device, dtype, quantization, cache, limits' max_steps; an
        unknown name is a TypeError naming it. `limits=EngineLimits(...)` and `cache=StepCacheConfig(...)`
        are accepted as shorthands."""
        self.engine_args = args = EngineArgs.from_kwargs(model, **options)  # every check, before any worker starts
        if args.distributed_executor_backend == "mp":
            check_main_guard()
        self.scheduler = Scheduler(
            engine_factory(args.engine_config, args.limits),
            # Offline callers wait their turn in `generate` instead of being refused; no watchdog: a dead
            # worker is respawned by the next call, as the engine does on its own.
            dataclasses.replace(args.limits, max_queue=sys.maxsize),
            watchdog_interval_s=None,
            replicas=args.data_parallel_size,
            batching=args.batching,
            scheduling_policy=args.scheduling_policy,
            max_num_seqs=args.max_num_seqs,
        )
        self._outputs = threading.local()  # each calling thread's last output
        # The scheduler lives on an event loop of its own, so callers need none.
        self._loop = asyncio.new_event_loop()
        self._loop_thread = threading.Thread(target=self._loop.run_forever, name="omni-scheduler", daemon=True)
        self._loop_thread.start()
        try:
            self._call(self.scheduler.start())
            self._call(self.scheduler.wait_until_loaded())
        except BaseException:
            self.close()
            raise

    @property
    def engine(self) -> Engine:
        """The first replica's engine."""
        return self.scheduler.engine

    @property
    def engines(self) -> list[Engine]:
        """Each replica's engine."""
        return self.scheduler.engines

    @property
    def last_output(self) -> DiffusionOutput | None:
        """The output of this thread's latest `generate` call (its seed, size, timings, `batch_size`)."""
        return getattr(self._outputs, "output", None)

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
        seed, lora (a served adapter's name, or {"name", "scale"}, or {"name", "path", "scale"} to serve one from
        its file), priority (with scheduling_policy="priority": lower runs first), and for video models num_frames
        and fps. `image` is a path, bytes or a PIL image, or a list of them. Returns PIL images (a video: a list of
        PIL frames), float32 arrays in [0, 1] with output_type="np", uint8 arrays with "uint8". The seed used
        (drawn when not given), the real size, the timings and the batch size are in `self.last_output` (this thread's).
        Bad input raises a RequestError (a ValueError naming the field); a failed run what the engine raised.
        """
        unknown = sorted(set(fields) - set(FIELDS_BY_NAME))
        if unknown:
            raise TypeError(
                f"generate() got unknown argument(s) {', '.join(unknown)}; request fields: {', '.join(FIELDS_BY_NAME)}"
            )
        params = GenerationParams(prompt=prompt, image=image, output_type=output_type, **fields)
        try:
            job = self._call(self._run(params))
        except InternalError as exc:
            # The engine's checks failed unexpectedly: raise what they raised, as the engine would.
            raise (exc.__context__ or exc) from None
        if job.status != "completed":
            raise job.exception or _error(job)
        self._outputs.output = job.result
        return job.result.images

    async def _run(self, params: GenerationParams) -> Job:
        job = await self.scheduler.submit(params)
        try:
            return await job.wait()
        except asyncio.CancelledError:  # the caller stopped waiting (Ctrl-C): so does the job
            self.scheduler.cancel(job.id, "the caller stopped waiting")
            raise
        finally:
            self.scheduler.forget(job.id)

    def _call(self, coroutine: Coroutine[Any, Any, Any]) -> Any:
        """Run `coroutine` on the scheduler's loop and wait for its result in this thread."""
        future = asyncio.run_coroutine_threadsafe(coroutine, self._loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # a no-op once it finished
            raise

    def close(self) -> None:
        """Cancel what runs, close the engines and their workers."""
        if self._loop.is_closed():
            return
        try:
            self._call(self.scheduler.stop())
            self._call(self._loop.shutdown_default_executor())  # the threads that created the engines
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._loop_thread.join()
            self._loop.close()

    def __enter__(self) -> Omni:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def check_main_guard() -> None:
    """RuntimeError, in one line, when `Omni` is made by the top-level code of the main script outside
    `if __name__ == "__main__":`. Its workers start with spawn, which runs the main script again in each of
    them; there that code would start workers of its own, and multiprocessing stops it with a long traceback
    from every worker. Interactive sessions and `python -c` have no script to run again."""
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    if main is None or path is None:
        return
    frame, top = sys._getframe(1), None
    while frame is not None:  # the outermost frame running the main script's top-level code
        if frame.f_globals is vars(main) and frame.f_code.co_name == "<module>":
            top = frame
        frame = frame.f_back
    if top is None:
        return
    line = top.f_lineno
    try:
        tree = ast.parse(open(path, encoding="utf-8").read())
    except (OSError, SyntaxError, ValueError):
        return  # no source to read (a frozen app): nothing to say
    if any(_is_main_guard(node) and node.lineno <= line <= (node.end_lineno or line) for node in ast.walk(tree)):
        return
    raise RuntimeError(
        f"{path}, line {line}: Omni's workers start with spawn, which runs this script again in each of them; "
        'put the code that makes the Omni under `if __name__ == "__main__":`'
    )


def _is_main_guard(node: ast.AST) -> bool:
    """`if __name__ == "__main__":` (either way round)."""
    if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.comparators) != 1:
        return False
    if not isinstance(node.test.ops[0], ast.Eq):
        return False
    sides = [node.test.left, node.test.comparators[0]]
    names = [side.id for side in sides if isinstance(side, ast.Name)]
    values = [side.value for side in sides if isinstance(side, ast.Constant)]
    return names == ["__name__"] and values == ["__main__"]


def _error(job: Job) -> Exception:
    """The exception for a job that ended without one of its own (cancelled while queued, or by shutdown)."""
    if job.status == "cancelled":
        return RequestCancelled(job.error.message)
    return RequestFailed(job.error.message)
