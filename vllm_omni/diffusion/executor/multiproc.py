"""One worker process per rank on this machine (`MultiprocExecutor`, the default executor backend).

DiffusionEngine creates it; base.WorkerGroupExecutor holds the lifecycle it shares with the Ray
executor. Ranks run worker.worker_main, started from one long-lived thread so that they die with this
process; requests go down one queue per rank, reports come up one shared queue.

How a worker process starts is vLLM's `VLLM_WORKER_MULTIPROC_METHOD`: spawn (the default: each worker a fresh
interpreter that imports torch, diffusers and its family, about 8 s on a CPU core) or forkserver (one server
process per executor process imports them once, `FORKSERVER_PRELOAD`; each worker is forked from it, and gets the
executor's environment as it is when the group starts). Fork is refused: the executor's process runs threads.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing import reduction
from typing import Any

from vllm_omni import envs
from vllm_omni.diffusion.config import OmniDiffusionConfig
from vllm_omni.diffusion.executor.base import WorkerGroupExecutor
from vllm_omni.diffusion.models.registry import FAMILY_PACKAGES
from vllm_omni.diffusion.protocol import CANCEL_SLOTS, RankReport
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.worker.worker import worker_main

START_METHODS = ("spawn", "forkserver")
# What the forkserver imports before it forks any worker: the worker's code and every family's (diffusers with it).
FORKSERVER_PRELOAD = [
    "vllm_omni.diffusion.worker.worker",
    *(f"vllm_omni.diffusion.models.{package}.pipeline" for package in FAMILY_PACKAGES),
]


class _ExecutorStdio:
    """This process's stdout and stderr, as a forked worker's `stdio` argument: pickled for the forkserver, each
    fd goes with the request to fork (multiprocessing.reduction.DupFd), so the worker writes where this process
    writes now, as a spawned one does, not where the server's output went when it started."""

    def __reduce__(self) -> tuple:
        return tuple, ((reduction.DupFd(1), reduction.DupFd(2)),)


def start_method() -> str:
    """`VLLM_WORKER_MULTIPROC_METHOD`, spawn unless set."""
    method = os.environ.get(envs.WORKER_MULTIPROC_METHOD) or "spawn"
    if method not in START_METHODS:
        raise ValueError(f"{envs.WORKER_MULTIPROC_METHOD}={method!r}: the workers start with spawn or forkserver")
    return method


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MultiprocExecutor(WorkerGroupExecutor):
    """One worker process per rank on this machine, started with spawn or forked by a forkserver."""

    def __init__(self, config: OmniDiffusionConfig, model_path: str) -> None:
        super().__init__(config, model_path)
        self._method = start_method()
        self._ctx = mp.get_context(self._method)
        if self._method == "forkserver":
            self._ctx.set_forkserver_preload(FORKSERVER_PRELOAD)  # read once, when the server starts
        self._cancel_token = self._ctx.Array("q", [-1] * CANCEL_SLOTS)  # the cancelled requests in flight
        # PR_SET_PDEATHSIG fires when the *thread* that spawned a worker ends: spawn from one that
        # lives as long as the executor, never from a request's or a thread pool's passing thread.
        self._spawner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="omni-spawner")
        self._procs: list[mp.process.BaseProcess] = []
        self._request_queues: list[Any] = []
        self._results: Any = None
        with self._group_lock:
            self._spawn_locked()

    def _start_group(self) -> None:
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._request_queues = [self._ctx.Queue() for _ in range(self.world_size)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(
                target=worker_main,
                name=f"omni-worker-r{self.config.replica}-{rank}"
                if self.config.parallel_config.data_parallel_size > 1
                else f"omni-worker-{rank}",
                args=(
                    rank,
                    self.config,
                    self.model_path,
                    init_method,
                    os.getpid() if self._method == "spawn" else None,  # a forked worker's parent: the forkserver
                    self._request_queues[rank],
                    self._results,
                    self._cancel_token,
                    # A spawned worker inherits both as they are now; a forked one, the forkserver's from its start.
                    dict(os.environ) if self._method == "forkserver" else None,
                    _ExecutorStdio() if self._method == "forkserver" else None,
                ),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        procs = self._procs
        self._spawner.submit(lambda: [proc.start() for proc in procs]).result()

    def _dead_worker(self) -> tuple[int, str] | None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                return rank, f"exited with code {proc.exitcode}"
        return None

    def _next_report(self, timeout: float) -> RankReport:
        return self._results.get(timeout=timeout)

    def _send_request(self, request: DiffusionRequest) -> None:
        for q in self._request_queues:
            q.put(request)

    def _stop_idle_group(self, deadline: float) -> None:
        for q in self._request_queues:
            q.put(None)
        for proc in self._procs:
            proc.join(timeout=max(0.0, deadline - time.monotonic()))

    def _kill_group(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        for q in [*self._request_queues, self._results]:
            if q is not None:
                q.close()
                q.cancel_join_thread()  # the readers are gone: do not wait to flush

    def _release(self) -> None:
        self._spawner.shutdown(wait=False)

    def _flag_cancels(self, cancel_tokens: list[int]) -> None:
        self._cancel_token[:] = cancel_tokens
