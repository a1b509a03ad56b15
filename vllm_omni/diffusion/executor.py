"""Starts one worker process per rank, sends each request to all of them, collects the result.

One request runs at a time (the engine queues them). The executor watches its workers: a
worker that dies, or ranks left waiting after another rank failed, make it restart the whole
group (their process group is broken) and fail the request in flight with a clear error. A
restart that cannot load the model marks the executor failed; the server then exits non-zero.
"""

from __future__ import annotations

import multiprocessing as mp
import queue
import socket
import threading
import time
from typing import Any

from vllm_omni.diffusion.data import DiffusionRequest, OmniDiffusionConfig, RequestCancelled, RequestFailed
from vllm_omni.diffusion.worker import worker_main
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

POLL_S = 0.2
STUCK_AFTER_ERROR_S = 30.0  # ranks still busy this long after another rank failed are stuck


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class WorkerStartError(RuntimeError):
    pass


class MultiprocExecutor:
    def __init__(self, config: OmniDiffusionConfig, model_path: str) -> None:
        self.config = config
        self.model_path = model_path
        self.world_size = config.parallel_config.world_size
        self._ctx = mp.get_context("spawn")
        self._cancel_token = self._ctx.Value("q", -1)
        self._lock = threading.Lock()  # one request (or restart) at a time
        self._procs: list[mp.process.BaseProcess] = []
        self._ready = threading.Event()
        self.failed: str | None = None
        self.restarts = 0
        self._spawn()

    # ---- lifecycle -------------------------------------------------------------------------

    def _spawn(self) -> None:
        self._ready.clear()
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._request_queues = [self._ctx.Queue() for _ in range(self.world_size)]
        self._results = self._ctx.Queue()
        self._procs = [
            self._ctx.Process(
                target=worker_main,
                name=f"omni-worker-{rank}",
                args=(
                    rank,
                    self.config,
                    self.model_path,
                    init_method,
                    self._request_queues[rank],
                    self._results,
                    self._cancel_token,
                ),
                daemon=True,
            )
            for rank in range(self.world_size)
        ]
        for proc in self._procs:
            proc.start()

    def wait_until_ready(self, timeout: float | None = None) -> None:
        """Block until every worker has loaded the model; raise WorkerStartError if one cannot."""
        with self._lock:
            self._wait_ready_locked(timeout)

    def _wait_ready_locked(self, timeout: float | None) -> None:
        if self._ready.is_set():
            return
        deadline = None if timeout is None else time.monotonic() + timeout
        ready: set[int] = set()
        while len(ready) < self.world_size:
            try:
                kind, rank, _, detail = self._results.get(timeout=POLL_S)
            except queue.Empty:
                dead = self._dead_worker()
                if dead is not None:
                    self._fail_start(f"worker rank {dead[0]} exited with code {dead[1]} while loading")
                if deadline is not None and time.monotonic() > deadline:
                    self._fail_start(f"workers did not load within {timeout:.0f} s")
                continue
            if kind == "load_error":
                self._fail_start(f"worker rank {rank} could not load {self.config.model}: {detail}")
            elif kind == "ready":
                ready.add(rank)
        self._ready.set()

    def _fail_start(self, message: str) -> None:
        self._kill_all()
        self.failed = message.splitlines()[0]
        raise WorkerStartError(message)

    @property
    def is_ready(self) -> bool:
        return self._ready.is_set() and self.failed is None

    def is_healthy(self) -> bool:
        return self.is_ready and self._dead_worker() is None

    def _dead_worker(self) -> tuple[int, int | None] | None:
        for rank, proc in enumerate(self._procs):
            if not proc.is_alive():
                return rank, proc.exitcode
        return None

    def restart(self, reason: str) -> None:
        """Kill every worker and start a fresh group (a broken process group cannot be repaired)."""
        logger.error("Restarting workers: %s", reason)
        self._kill_all()
        self.restarts += 1
        self._spawn()
        self._wait_ready_locked(None)
        logger.info("Workers restarted (%d restart(s) so far)", self.restarts)

    def check_workers(self) -> None:
        """Respawn the group if a worker died while idle (called by the server's watchdog)."""
        if not self._ready.is_set() or self.failed:
            return
        if not self._lock.acquire(blocking=False):
            return  # a request in flight notices a death itself
        try:
            dead = self._dead_worker()
            if dead is not None:
                self.restart(f"worker rank {dead[0]} exited with code {dead[1]}")
        finally:
            self._lock.release()

    def shutdown(self) -> None:
        """Ask idle workers to leave their loop; kill the rest (still loading, or busy)."""
        if self._ready.is_set() and self._lock.acquire(timeout=1.0):
            try:
                for q in self._request_queues:
                    q.put(None)
                deadline = time.monotonic() + 10
                for proc in self._procs:
                    proc.join(timeout=max(0.0, deadline - time.monotonic()))
            finally:
                self._lock.release()
        self._kill_all()

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.is_alive():
                proc.kill()
        for proc in self._procs:
            proc.join(timeout=10)
        self._ready.clear()
        for q in [*getattr(self, "_request_queues", []), getattr(self, "_results", None)]:
            if q is not None:
                q.close()
                q.cancel_join_thread()  # the readers are gone: do not wait to flush

    # ---- requests ----------------------------------------------------------------------------

    def cancel(self, cancel_token: int) -> None:
        self._cancel_token.value = cancel_token

    def execute(self, request: DiffusionRequest) -> Any:
        """Run `request` on every rank and return rank 0's images."""
        with self._lock:
            if self.failed:
                raise RequestFailed(f"the workers are down: {self.failed}")
            if not self._ready.is_set():
                self._wait_ready_locked(None)
            dead = self._dead_worker()
            if dead is not None:
                self.restart(f"worker rank {dead[0]} exited with code {dead[1]}")
            for q in self._request_queues:
                q.put(request)
            return self._collect(request)

    def _collect(self, request: DiffusionRequest) -> Any:
        replies: dict[int, tuple[str, Any]] = {}
        first_error_at = None
        while len(replies) < self.world_size:
            try:
                kind, rank, request_id, payload = self._results.get(timeout=POLL_S)
            except queue.Empty:
                dead = self._dead_worker()
                if dead is not None:
                    self.restart(f"worker rank {dead[0]} exited with code {dead[1]} during {request.request_id}")
                    raise RequestFailed(
                        f"a worker died while running the request (rank {dead[0]}, exit code {dead[1]}); "
                        "the workers were restarted"
                    ) from None
                if first_error_at is not None and time.monotonic() - first_error_at > STUCK_AFTER_ERROR_S:
                    message = next(p for k, p in replies.values() if k == "error")
                    self.restart(f"ranks stuck after an error in {request.request_id}")
                    raise RequestFailed(message) from None
                continue
            if request_id != request.request_id:
                continue  # a late reply to an earlier request
            replies[rank] = (kind, payload)
            if kind == "error" and first_error_at is None:
                first_error_at = time.monotonic()
        kinds = {kind for kind, _ in replies.values()}
        if kinds == {"done"}:
            return replies[0][1]
        if "error" in kinds:
            raise RequestFailed(next(payload for kind, payload in replies.values() if kind == "error"))
        raise RequestCancelled(replies[0][1] if replies[0][0] == "cancelled" else "cancelled")
