"""The engines behind one Scheduler, one per replica (data_parallel_size: each a worker group on GPUs of
its own): created and loaded together, their workers checked, shut down. `engine_factory` builds
DiffusionEngines for the HTTP server and `Omni` alike."""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections.abc import Callable, Iterator
from typing import Any, Protocol

from vllm_omni.diffusion.config import EngineLimits, Envelope, OmniDiffusionConfig
from vllm_omni.diffusion.protocol import HealthState, ProgressCallback
from vllm_omni.diffusion.request import DiffusionRequest, GenerationParams
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class Engine(Protocol):
    """What the scheduler needs of a DiffusionEngine (tests pass a fake)."""

    spec: Any
    envelope: Envelope | None  # what one forward holds on its GPUs (admission.py); None: not sized (a CPU)

    def preprocess(self, params: GenerationParams) -> DiffusionRequest: ...
    def step(
        self, request: DiffusionRequest, on_progress: ProgressCallback | None = None, interleave: bool = False
    ) -> Any: ...
    def step_batch(
        self, requests: list[DiffusionRequest], on_progress: ProgressCallback | None = None
    ) -> list[Any]: ...
    def cancel(self, request_id: str) -> None: ...
    def wait_until_ready(self) -> None: ...
    def health_status(self) -> tuple[HealthState, str | None]: ...
    def check_workers(self) -> None: ...
    def begin_shutdown(self) -> None: ...
    def close(self) -> None: ...


def engine_factory(
    config: Callable[[], OmniDiffusionConfig],
    limits: EngineLimits | None = None,
    *,
    prepare: Callable[[], None] | None = None,
) -> Callable[[int], Engine]:
    """What a Scheduler calls to create replica `i`'s engine: a DiffusionEngine on `config()` with `replica=i`
    (its ranks take the GPUs after the earlier replicas'). `prepare` runs first (the server pins its GPUs)."""

    def create(replica: int) -> Engine:
        from vllm_omni.diffusion.engine.core import DiffusionEngine

        if prepare is not None:
            prepare()
        return DiffusionEngine(dataclasses.replace(config(), replica=replica), limits)

    return create


class ReplicaEngines:
    """Replica i's engine at `[i]`: None until `factory(i)` has returned (it may still be loading then)."""

    def __init__(self, factory: Callable[[int], Engine], count: int) -> None:
        self._factory = factory
        self._engines: list[Engine | None] = [None] * count
        self._lock = threading.Lock()  # engine creation vs. shutdown
        self._closing = False

    def __len__(self) -> int:
        return len(self._engines)

    def __getitem__(self, replica: int) -> Engine | None:
        return self._engines[replica]

    def __iter__(self) -> Iterator[Engine | None]:
        return iter(self._engines)

    async def load(self) -> None:
        """Create every replica's engine, each in a thread of its own, and wait until each has loaded and
        warmed up; raises the first failure (an engine created after `begin_shutdown` is closed at once)."""
        await asyncio.gather(*(asyncio.to_thread(self._create_and_wait, i) for i in range(len(self))))

    def _create_and_wait(self, replica: int) -> None:
        engine = self._factory(replica)
        with self._lock:
            if self._closing:
                engine.close()
                return
            self._engines[replica] = engine
        engine.wait_until_ready()

    @property
    def created(self) -> bool:
        return all(engine is not None for engine in self._engines)

    async def check_workers(self) -> str | None:
        """Have dead workers respawned (the watchdog, while idle); why the workers are lost for good, or None."""
        for engine in self._engines:
            try:
                await asyncio.to_thread(engine.check_workers)
            except Exception as exc:  # noqa: BLE001 - a failed respawn shows in health_status, read below
                logger.error("Respawning the workers failed: %s", exc)
            state, detail = engine.health_status()
            if state == "failed":
                return detail or "the workers are lost"
        return None

    def begin_shutdown(self, running_ids: list[list[str]]) -> None:
        """Each engine starts nothing new and cancels its calls in flight (`running_ids[i]`: replica i's)."""
        with self._lock:
            self._closing = True
            engines = list(self._engines)
        for engine, request_ids in zip(engines, running_ids):
            if engine is not None:
                engine.begin_shutdown()
                for request_id in request_ids:
                    engine.cancel(request_id)

    async def close(self) -> None:
        """Close every engine created so far, and its workers."""
        with self._lock:
            self._closing = True
            engines = [engine for engine in self._engines if engine is not None]
        if engines:
            await asyncio.gather(*(asyncio.to_thread(engine.close) for engine in engines))
            logger.info("Workers shut down")
