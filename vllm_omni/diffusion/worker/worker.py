"""One rank of the worker group: join the process groups, load the pipeline, serve requests (`run_rank`).

MultiprocExecutor (executor/multiproc.py) runs it in a process per rank (`worker_main`),
RayExecutor (executor/ray.py) in a thread of a Ray actor per rank. Every rank runs the whole
pipeline on the same request and seed; rank 0 sends the images back. What a rank reports (ready,
progress, a failed graph capture, stats, done / cancelled / failed) is in diffusion/protocol.py:
the executor's deadlines read the progress, and it tells a request that failed everywhere (bad
input) from one that left ranks stuck in a collective (it restarts the group). A worker process
never outlives the executor's process (`bind_lifetime_to_parent`). A loaded rank serves through a
`RankServer`; the tests reach into it only through its `RankHooks` (worker/hooks.py), None in production.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import multiprocessing
import os
import signal
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from vllm_omni import envs
from vllm_omni.diffusion.config import PLACEMENTS, Envelope, OmniDiffusionConfig
from vllm_omni.diffusion.protocol import (
    Cancelled,
    Done,
    Failed,
    GraphCaptureFailed,
    LoadFailed,
    Progress,
    Ready,
    Stats,
)
from vllm_omni.diffusion.request import DiffusionRequest, RequestCancelled, RequestError
from vllm_omni.diffusion.worker.hooks import HookPoint, RankHooks, rank_hooks
from vllm_omni.diffusion.worker.memory_guard import GroupOutOfMemory, is_out_of_memory, memory_figures, release_memory
from vllm_omni.diffusion.worker.step_cache import step_cache_line
from vllm_omni.logger import init_logger

if TYPE_CHECKING:  # loaded in the rank (_load): the executor's process imports this module without torch
    from vllm_omni.diffusion.worker.memory_plan import RankPlan
    from vllm_omni.diffusion.worker.runner import PipelineRunner

logger = init_logger(__name__)

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def _cpu_threads(world_size: int) -> int:
    if envs.CPU_THREADS in os.environ:
        return max(1, int(os.environ[envs.CPU_THREADS]))
    return max(1, (os.cpu_count() or 1) // world_size)


def bind_lifetime_to_parent(parent_pid: int | None) -> None:
    """Die with the parent process however it dies (SIGKILL included), so no worker keeps a GPU.

    Two guards: the kernel's parent-death signal (Linux; it fires even if this process is stuck in
    native code, and follows the parent *thread* that spawned us, so the executor spawns from a
    thread that lives as long as it does), and a thread waiting on the pipe multiprocessing keeps
    open to the parent, which reaches end-of-file when the parent is gone (any platform).
    """
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            logger.warning("prctl(PR_SET_PDEATHSIG) failed (errno %d)", ctypes.get_errno())
    # `parent_pid` None: forked by the executor's forkserver, which ends when the executor's process does (the
    # signal follows it); multiprocessing's pipe below is the executor's whichever way the worker started.
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent died before the signal was armed
    parent = multiprocessing.parent_process()
    if parent is not None:
        if not parent.is_alive():
            os._exit(1)  # the executor's process died before the watch began
        threading.Thread(target=_exit_when_gone, args=(parent,), name="parent-watch", daemon=True).start()


def _exit_when_gone(parent: Any) -> None:
    parent.join()  # returns once the parent's end of the pipe is closed
    os._exit(1)  # no cleanup: a collective or a CUDA call could block it


def worker_main(
    rank: int,
    config: OmniDiffusionConfig,
    model_path: str,
    init_method: str,
    parent_pid: int | None,
    request_queue: Any,
    result_queue: Any,
    cancel_token: Any,
    environ: dict[str, str] | None = None,
    stdio: tuple[Any, Any] | None = None,
) -> None:
    """A worker process of MultiprocExecutor: bound to its parent, then the rank's whole life.

    A forkserver's child inherits the server's environment and output from when the server started; `environ`
    (the executor's environment) and `stdio` (its stdout and stderr, multiprocessing fd handles) are what they
    are when the group starts, as a spawned worker inherits them."""
    if stdio is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        for target, handle in zip((1, 2), stdio):
            os.dup2(handle.detach(), target)
    bind_lifetime_to_parent(parent_pid)
    if environ is not None and environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    # Ctrl-C reaches the terminal's whole process group; the parent decides how its workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    gpu = config.replica * config.parallel_config.world_size + rank  # a replica's ranks have GPUs of their own
    run_rank(rank, config, model_path, init_method, request_queue, result_queue, cancel_token, cuda_index=gpu)


def run_rank(
    rank: int,
    config: OmniDiffusionConfig,
    model_path: str,
    init_method: str,
    requests: Any,
    reports: Any,
    cancel_token: Any,
    cuda_index: int,
) -> None:
    """One rank from start to end: join the groups, load, report `Ready`, serve until a None request.

    Both executors run it: MultiprocExecutor in a process per rank, RayExecutor in a thread of an
    actor per rank. `requests.get()` gives the next DiffusionRequest (None: leave), `reports.put(
    report)` sends a protocol.RankReport to the executor, `cancel_token[:]` holds the cancel tokens the
    executor flagged (the cancelled requests in flight, protocol.CANCEL_SLOTS of them). `cuda_index`
    is the GPU to use on CUDA (a Ray actor sees only the one Ray gave it, as device 0). A load failure
    is reported (`LoadFailed`), not raised. The rank's test seams are built here, once (worker/hooks.py).
    """
    try:
        hooks = rank_hooks(rank)
        runner, plan = _load(rank, config, model_path, init_method, cuda_index, hooks)
    except BaseException as exc:  # noqa: BLE001 - reported to the executor, which raises it
        reports.put(LoadFailed(rank, f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        return
    reports.put(Ready(rank, plan.envelope if plan is not None else None))
    RankServer(rank, runner, plan, requests, reports, cancel_token, hooks).serve()


def _load(
    rank: int,
    config: OmniDiffusionConfig,
    model_path: str,
    init_method: str,
    cuda_index: int,
    hooks: RankHooks | None,
) -> tuple[PipelineRunner, RankPlan | None]:
    import torch

    from vllm_omni.diffusion.attention.backends import configure_attention_backend
    from vllm_omni.diffusion.distributed.parallel_state import initialize_parallel_state, most_of_ranks
    from vllm_omni.diffusion.model_source import heads_error, read_pipeline_spec
    from vllm_omni.diffusion.worker.memory_plan import plan_rank
    from vllm_omni.diffusion.worker.offload import AUTO_PLACEMENT_REASONS
    from vllm_omni.diffusion.worker.runner import PipelineRunner, present_components, skipped_text_encoders

    start = time.perf_counter()
    parallel = config.parallel_config
    if config.device == "cuda":
        torch.cuda.set_device(cuda_index)
        device = torch.device("cuda", cuda_index)
    else:
        torch.set_num_threads(_cpu_threads(parallel.world_size))
        device = torch.device("cpu")
    # A backstop behind the executor's deadlines: no collective (nor the rendezvous) waits forever.
    group_timeout = timedelta(seconds=max(config.load_timeout_s, config.stall_timeout_s))
    initialize_parallel_state(parallel, rank, init_method, device, timeout=group_timeout)
    configure_attention_backend(
        config.attention_backend,
        parallel.mask_sp_padding,
        config.fp8_attention_full_steps,
        device,
        graphs=not config.enforce_eager,
    )

    spec = read_pipeline_spec(Path(model_path))
    dtype = getattr(torch, config.dtype)
    # Before any weight is loaded: a deploy that cannot fit is refused here, saying what would (memory_plan.py).
    components = set(present_components(Path(model_path))) - set(
        skipped_text_encoders(Path(model_path), spec.family_pipeline())
    )
    simulated = hooks.device_memory() if hooks is not None else None  # a test's device, on any rank
    rank_plan = plan_rank(config, spec, Path(model_path), device, sorted(components), memory=simulated)
    if rank_plan is not None:
        offload = rank_plan.plan.offload
    else:  # no device memory to plan against (a CPU): auto keeps every weight where it is
        offload = "none" if config.cpu_offload == "auto" else config.cpu_offload
    if rank_plan is not None and config.cpu_offload == "auto":
        # Every rank offloads alike (CUDA graphs go with it): the costliest placement any rank needs. Every rank of
        # the world reaches this point (the same config, the same kind of device), or failed loading before it.
        offload = PLACEMENTS[most_of_ranks(PLACEMENTS.index(offload))]
        if offload != rank_plan.plan.offload:
            agreed = dataclasses.replace(config, cpu_offload=offload)
            rank_plan = plan_rank(agreed, spec, Path(model_path), device, sorted(components), memory=simulated)
        if offload != "none":
            logger.info(
                "Worker rank %d: %s offload chosen (cpu_offload auto): the default request does not fit with %s on "
                "some rank; %s",
                rank,
                offload,
                *AUTO_PLACEMENT_REASONS[offload],
            )
    plan = rank_plan.plan if rank_plan is not None else None
    if plan is not None:
        logger.info("Worker rank %d %s", rank, plan.line())
    if device.type == "cuda":  # what the plan was measured against is also what the rank may allocate
        torch.cuda.set_per_process_memory_fraction(config.gpu_memory_utilization, device)
    runner = PipelineRunner(
        model_path,
        spec,
        device,
        dtype,
        rank,
        enforce_eager=config.enforce_eager,
        quantization=config.quantization,
        cache=config.cache,
        cpu_offload=offload,
        resident_blocks=plan.resident_blocks() if plan is not None else None,
        # Left to the engine: only where the weights cross to the GPU every forward (then once a step, not twice).
        cfg_one_pass=config.cfg_one_pass if config.cfg_one_pass is not None else offload == "layerwise",
        loras=(config.max_loras, config.max_cpu_loras or config.max_loras)
        if config.lora_modules or config.allow_runtime_lora
        else None,
        hooks=hooks,
    )
    for name, heads in runner.attention_heads.items():  # the engine checked the configs; these are the models
        error = heads_error(heads, parallel.ulysses_degree, parallel.ring_degree, spec.heads_over_sp_group)
        if error is not None:
            raise ValueError(f"{name}: {error}")
    logger.info(
        "Worker rank %d loaded %s (%s, %s, pid %d) in %.1f s: %s MiB of weights%s",
        rank,
        model_path,
        device,
        config.dtype,
        os.getpid(),
        time.perf_counter() - start,
        f"{runner.weight_bytes / 2**20:,.1f}",
        f", without {', '.join(runner.skipped)} (its SP group's rank 0 encodes the prompts)" if runner.skipped else "",
    )
    return runner, rank_plan


class RankServer:
    """A rank's serving loop: it runs each request the executor sends on this rank and sends its reports (progress,
    then stats and done, or how it ended).

    Interleaving: the executor sends a request to a busy group only to run it inside the running one (the
    scheduling policy chose it, engine/policy.py). At each step's end every rank agrees whether one arrived (on
    any rank: each rank's queue gets the same requests in the same order), takes it from its queue and runs it to
    its end here, nested, with the running one put aside (runner.suspended); then the running one goes on."""

    def __init__(
        self,
        rank: int,
        runner: PipelineRunner,
        plan: RankPlan | None,
        requests: Any,
        reports: Any,
        cancel_token: Any,
        hooks: RankHooks | None = None,
    ) -> None:
        self.rank, self.runner, self.plan, self.hooks = rank, runner, plan, hooks
        self.requests, self.reports, self.cancel_token = requests, reports, cancel_token

    def serve(self) -> None:
        """Serve until a None request, then leave the process groups."""
        from vllm_omni.diffusion.distributed.parallel_state import destroy_parallel_state

        while True:
            request: DiffusionRequest | None = self.requests.get()
            if request is None:
                break
            extras = self.hooks.request_extras(request) if self.hooks is not None else {}
            # In a method of its own: whatever the request held (its images, a failure's frames) is
            # dropped when it returns, before the next request arrives.
            self.serve_request(request, extras)
            del request
        destroy_parallel_state()

    def serve_request(self, request: DiffusionRequest, extras: dict[str, Any] | None = None) -> None:
        """Run one request on this rank and send its reports; `extras`: the hooks' figures for its Stats."""
        rank, runner, reports = self.rank, self.runner, self.reports
        total = request.num_inference_steps * len(request.forward_chunks)  # more images than fit: calls in a row
        reports.put(Progress(rank, request.request_id, 0, total))
        encoded: list[tuple[int, int]] = []  # the encode stage's last (done, total), for the log
        start = time.perf_counter()
        failure: Failed | None = None
        try:
            try:
                images = runner.run(
                    request,
                    functools.partial(self._step_end, request, total),
                    functools.partial(self._decode_tile, request, total),
                    functools.partial(self._encode_progress, request, encoded),
                    functools.partial(self._cancelled, request),
                )
            finally:
                # Before the request's last report: the executor stops reading once every rank answered.
                while runner.graph_capture_failures:
                    reason = runner.graph_capture_failures.pop(0)
                    reports.put(GraphCaptureFailed(rank, request.request_id, reason))
        except RequestCancelled as exc:
            logger.info("%s", exc)
            reports.put(Cancelled(rank, request.request_id, str(exc)))
            return
        except RequestError as exc:  # bad input only the worker could see (a source image's data): a 400
            logger.info("Request %s refused on rank %d: %s", request.request_id, rank, exc)
            reports.put(Failed(rank, request.request_id, exc))  # pickles with its param
            return
        except Exception as exc:  # noqa: BLE001 - the request fails, the worker goes on
            failure = _failure(rank, request, runner, exc)
        if failure is not None:
            # Out of the except clause, so its exception (and the tensors its frames hold) can go.
            runner.end_failed_request()
            release_memory(runner.device)
            reports.put(failure)
            return
        records = runner.cache.summary() if runner.cache is not None else None
        cache = None if records is None else runner.cache.report()
        if rank == 0:
            self._log_done(request, encoded, time.perf_counter() - start, cache)
        peak, allocated, reserved = memory_figures(runner.device)
        envelope = self._measured_envelope(request) if request.profile else None
        stats = Stats(
            rank,
            request.request_id,
            phase_seconds=dict(runner.phase_seconds),  # a copy: a Ray rank's report waits for its poll
            graph_captures=runner.graph_captures,
            compiles=runner.compiles(),
            step_cache=records,
            cfg_one_pass_steps=runner.cfg_one_pass_steps,
            peak_memory_bytes=peak,
            allocated_memory_bytes=allocated,
            reserved_memory_bytes=reserved,
            envelope=envelope,
            extras=extras or {},
        )
        reports.put(stats)
        # Rank 0 answers with the result: the frames, and their sound where the model makes some.
        reports.put(Done(rank, request.request_id, images if rank == 0 else None, runner.audio if rank == 0 else None))

    def _cancelled(self, request: DiffusionRequest) -> bool:
        return request.cancel_token in self.cancel_token[:]

    def _at(self, point: HookPoint, index: int, request: DiffusionRequest) -> None:
        if self.hooks is not None:
            self.hooks.at(point, index, request, functools.partial(self._cancelled, request))

    def _step_end(self, request: DiffusionRequest, total: int, step: int) -> None:
        """After every denoising step (the runner's `on_step_end`): cancel, report progress, run an arrived request."""
        from vllm_omni.diffusion.distributed.parallel_state import any_rank_each

        self._at("step", step, request)
        # All ranks must stop at the same step, or the others would wait in a collective forever; likewise they
        # take an arrived request at the same step. None arrives after the last step (the executor waits then).
        stop, arrived = any_rank_each(self._cancelled(request), step + 1 < total and not self.requests.empty())
        if stop:
            raise RequestCancelled(f"request {request.request_id} cancelled at step {step + 1}")
        self.reports.put(Progress(self.rank, request.request_id, min(step + 1, total), total))
        if arrived:
            inner: DiffusionRequest = self.requests.get()
            logger.info(
                "Request %s: suspended after step %d/%d for %s", request.request_id, step + 1, total, inner.request_id
            )
            with self.runner.suspended(request):
                self.serve_request(inner)
            logger.info("Request %s: resumed at step %d/%d", request.request_id, step + 2, total)

    def _decode_tile(self, request: DiffusionRequest, total: int, tile: int) -> None:
        from vllm_omni.diffusion.distributed.parallel_state import any_rank

        self._at("decode", tile, request)
        # Every rank reaches every tile start of a split decode: a cancel stops them all at one tile.
        if any_rank(self._cancelled(request)):
            raise RequestCancelled(f"request {request.request_id} cancelled while decoding (tile {tile + 1})")
        self.reports.put(Progress(self.rank, request.request_id, total, total))  # alive: the stall deadline

    def _encode_progress(
        self, request: DiffusionRequest, encoded: list[tuple[int, int]], done: int, total: int
    ) -> None:
        self._at("encode", done, request)
        # Only this rank runs the stage (its SP peers wait in the broadcast of its output, where the
        # runner tells them it stopped): its own cancel check decides.
        if self._cancelled(request):
            raise RequestCancelled(f"request {request.request_id} cancelled while encoding ({done}/{total})")
        encoded[:] = [(done, total)]
        self.reports.put(Progress(self.rank, request.request_id, done, total, "encode"))

    def _log_done(self, request: DiffusionRequest, encoded: list[tuple[int, int]], seconds: float, cache: Any) -> None:
        runner, one_pass = self.runner, self.runner.cfg_one_pass_steps
        batched = f" (batched with {', '.join(row.request_id for row in request.batch)})" if request.batch else ""
        logger.info(
            "Request %s%s: %s%d step(s) in %.2f s (forwards: %s)%s%s",
            request.request_id,
            batched,
            "".join(
                f"encode {done}/{total} token(s) in {runner.phase_seconds['encode']:.2f} s, " for done, total in encoded
            ),
            request.num_inference_steps,
            seconds,
            ", ".join(f"{name} {count}" for name, count in sorted(runner.forwards.items())),
            "" if cache is None else f"; {step_cache_line(cache)}",
            f"; CFG in one pass at {one_pass} step(s)" if one_pass else "",
        )

    def _measured_envelope(self, request: DiffusionRequest) -> Envelope | None:
        """The envelope this rank's measured step leaves (the warm-up's profile request): the runner's peak on CUDA,
        else the hooks' (a test's simulated step); None without a plan or a figure."""
        plan = self.plan
        if plan is None:
            return None
        estimate = plan.plan_at(request.tokens, text_tokens=0).step_bytes
        measured = self.runner.step_peak_bytes
        if measured is None and self.hooks is not None:
            measured = self.hooks.measured_step_bytes(estimate)
        if measured is None:
            return None
        envelope = plan.measured(measured, request.tokens)
        logger.info(
            "Measured one denoising step of %d tokens: %.1f MiB of activations (planned %.1f MiB); envelope: %s",
            request.tokens,
            measured / 2**20,
            estimate / 2**20,
            envelope,
        )
        return envelope


def _failure(rank: int, request: DiffusionRequest, runner: Any, exc: Exception) -> Failed:
    """The report of a request that failed on this rank with `exc`, logged here with its traceback, as text: a log
    record holding the exception (in its arguments or exc_info) would keep the failed request's tensors alive in any
    handler that keeps records, as pytest's does (measured on an H200: 658 MiB after an out-of-memory error in the
    decode)."""
    trace = "".join(traceback.format_exception(exc)).rstrip()
    if not is_out_of_memory(exc):
        logger.warning(
            "Request %s failed on rank %d: %s: %s\n%s", request.request_id, rank, type(exc).__name__, str(exc), trace
        )
        return Failed(rank, request.request_id, f"{type(exc).__name__}: {exc}")
    agreed = isinstance(exc, GroupOutOfMemory)
    error = exc.error if agreed else exc
    logger.warning(
        "Request %s ran out of memory on rank %d while %s: %s: %s\n%s",
        request.request_id,
        rank,
        {"encode": "encoding the prompt", "denoise": "denoising", "decode": "decoding"}[runner.phase],
        type(error).__name__,
        str(error),
        trace,
    )
    text = f"{type(error).__name__}: {error}"
    return Failed(rank, request.request_id, text, out_of_memory=runner.phase, agreed=agreed)
