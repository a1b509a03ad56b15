"""One worker process per rank on this machine (`MultiprocExecutor`, the default executor backend).

DiffusionEngine creates it; base.WorkerGroupExecutor holds the lifecycle it shares with the Ray
executor. Ranks run worker.worker_main, started with the spawn method from one long-lived thread so
that they die with this process; requests go down one queue per rank, reports come up one shared queue.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vllm_omni.diffusion.config import OmniDiffusionConfig
from vllm_omni.diffusion.executor.base import WorkerGroupExecutor
from vllm_omni.diffusion.protocol import CANCEL_SLOTS, RankReport
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.worker.worker import worker_main


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class MultiprocExecutor(WorkerGroupExecutor):
    """One worker process per rank on this machine, started with the spawn method."""

    def __init__(self, config: OmniDiffusionConfig, model_path: str) -> None:
        super().__init__(config, model_path)
        self._ctx = mp.get_context("spawn")
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
                    os.getpid(),
                    self._request_queues[rank],
                    self._results,
                    self._cancel_token,
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
