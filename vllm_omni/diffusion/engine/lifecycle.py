"""The scheduler's engines from load to shutdown (scheduler.py holds the queue, queue_admission.py what joins it):
loading them in the background, the watchdog that has dead workers respawned, the server's health, and whether
new work is taken now. /health reads `health()` and every submit `check_accepting()`, which reads `health()`, so
the two never disagree.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from vllm_omni.diffusion.engine.job import one_line
from vllm_omni.diffusion.engine.replicas import Engine, ReplicaEngines
from vllm_omni.diffusion.protocol import HealthState
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


@dataclass(frozen=True)
class Health:
    state: HealthState
    detail: str | None = None
    restarts: int = 0  # worker-group restarts so far
    last_restart_reason: str | None = None
    graph_capture_failures: int = 0  # CUDA graph captures that failed on a rank (that SP group ran eagerly)
    last_graph_capture_failure: str | None = None
    replicas: tuple[Health, ...] = ()  # each replica's, when there are several

    @property
    def ok(self) -> bool:
        return self.state == "ok"

    def to_dict(self) -> dict[str, Any]:
        body: dict[str, Any] = {"status": self.state} | ({"detail": self.detail} if self.detail else {})
        if self.restarts:  # a group that never restarted answers just {"status": "ok"}
            body.update(restarts=self.restarts, last_restart_reason=self.last_restart_reason)
        if self.graph_capture_failures:
            body.update(
                graph_capture_failures=self.graph_capture_failures,
                last_graph_capture_failure=self.last_graph_capture_failure,
            )
        if self.replicas:
            body["replicas"] = [replica.to_dict() for replica in self.replicas]
        return body


class Unavailable(Exception):
    """No work is taken now; `state` is "loading", "failed" or "shutting_down"."""

    def __init__(self, state: HealthState, message: str) -> None:
        super().__init__(message)
        self.state = state


class Lifecycle:
    """The replicas' engines through loading, serving and shutting down, on the scheduler's event loop."""

    def __init__(
        self, engines: ReplicaEngines, on_fatal: Callable[[str], None], watchdog_interval_s: float | None
    ) -> None:
        self.engines = engines
        self.on_fatal = on_fatal  # the workers are lost for good, or the model cannot load: the server ends
        self.watchdog_interval_s = watchdog_interval_s  # None: no watchdog
        self.loaded = False  # the first load finished; later restarts do not reset it
        self.load_error: str | None = None
        self.load_failure: BaseException | None = None  # what the load raised
        self.shutting_down = False
        self._load_task: asyncio.Task | None = None

    def start(self) -> list[asyncio.Task]:
        """Begin loading the engines (in the background) and start the watchdog; their tasks, for `stop` to end."""
        self._load_task = asyncio.create_task(self._load(), name="load-engine")
        tasks = [self._load_task]
        if self.watchdog_interval_s is not None:
            tasks.append(asyncio.create_task(self._watchdog(), name="watchdog"))
        return tasks

    async def wait_until_loaded(self) -> None:
        """Until every replica has loaded and warmed up; raises what the load raised."""
        await asyncio.shield(self._load_task)
        if self.load_failure is not None:
            raise self.load_failure
        if not self.loaded:
            raise Unavailable("shutting_down", "shut down while the engine was loading")

    async def _load(self) -> None:
        started = time.perf_counter()
        try:
            await self.engines.load()
        except Exception as exc:  # noqa: BLE001 - any failure to load ends the server
            if self.shutting_down:
                return
            logger.error("Could not start the engine: %s", exc)
            self.load_failure = exc
            self.load_error = one_line(f"{type(exc).__name__}: {exc}")
            self.on_fatal(self.load_error)
            return
        if self.engines.created and not self.shutting_down:
            self.loaded = True
            logger.info("Engine ready in %.1f s", time.perf_counter() - started)

    async def _watchdog(self) -> None:
        """Have dead workers respawned while idle; call `on_fatal` when they are lost for good."""
        while True:
            await asyncio.sleep(self.watchdog_interval_s)
            if not self.loaded or self.shutting_down:
                continue
            lost = await self.engines.check_workers()
            if lost is not None and not self.shutting_down:
                logger.error("The workers cannot be brought back (%s); shutting down", lost)
                self.on_fatal(lost)
                return

    def health(self) -> Health:
        """The server's state: ok only while work is taken (one replica up and warm is enough); else why not."""
        if self.shutting_down:
            return Health("shutting_down")
        if self.load_error:
            return Health("failed", self.load_error)
        replicas = tuple(self.replica_health(engine) for engine in self.engines)
        if len(replicas) == 1:
            return replicas[0]
        serving = [health for health in replicas if health.ok]
        first = (serving or list(replicas))[0]
        return dataclasses.replace(
            first,
            restarts=sum(h.restarts for h in replicas),
            graph_capture_failures=sum(h.graph_capture_failures for h in replicas),
            replicas=replicas,
        )

    def replica_health(self, engine: Engine | None) -> Health:
        if engine is None:
            return Health("loading")
        state, detail = engine.health_status()
        if state == "ok" and not self.loaded:  # the warm-up has just ended; `loaded` flips next
            state, detail = "warming_up", None
        return Health(
            state,
            detail,
            getattr(engine, "restarts", 0),
            getattr(engine, "last_restart_reason", None),
            getattr(engine, "graph_capture_failures", 0),
            getattr(engine, "last_graph_capture_failure", None),
        )

    def check_accepting(self) -> None:
        """Unavailable unless new work is taken (loaded and warm, workers not lost, not shutting down).

        Reads `health()`, so /health never says ok while a request would be refused.
        """
        health = self.health()
        if health.state == "shutting_down":
            raise Unavailable("shutting_down", "the server is shutting down")
        if health.state == "failed":
            cause = "the model could not be loaded" if self.load_error else "the workers are down"
            raise Unavailable("failed", f"{cause}: {health.detail}")
        if not self.loaded:
            what = "warming up (compiling, capturing CUDA graphs)" if health.state == "warming_up" else "loading"
            raise Unavailable(health.state, f"the model is still {what}; poll GET /health until it answers 200")
        # While a dead worker's group is respawned (and warms up), requests still queue: the engine waits for it.
