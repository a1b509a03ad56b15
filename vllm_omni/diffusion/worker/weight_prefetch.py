"""Reads a checkpoint's weight files into the page cache while the workers start (the engine calls it).

A worker spends its first seconds starting before it reads a byte, and safetensors then pages the
weights in through mmap, more slowly than one sequential read: so the engine's process reads the
files start to end on a thread meanwhile, the transformer's first (the order the runner loads them),
and the workers of this machine find them in the page cache (figures: docs/serving.md, start-up).
Skipped when the weights take more than half the memory available and when
`VLLM_OMNI_PREFETCH_WEIGHTS=0`."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from vllm_omni import envs
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

ENV_VAR = envs.PREFETCH_WEIGHTS
WEIGHT_SUFFIXES = (".safetensors", ".bin")
CHUNK = 16 * 2**20


def weight_files(model_path: Path) -> list[Path]:
    """The weight files under `model_path` in load order: the transformer's, then the rest (by path)."""
    files = sorted(p for p in model_path.rglob("*") if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    return sorted(files, key=lambda p: p.relative_to(model_path).parts[0] != "transformer")


def available_memory_bytes() -> int | None:
    """MemAvailable from /proc/meminfo (None where there is none)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


class WeightPrefetch:
    """One daemon thread reading `files` once; `stop()` ends it at the next chunk."""

    def __init__(self, files: list[Path]) -> None:
        self.files = files
        self.bytes_read = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._read, name="weight-prefetch", daemon=True)

    @classmethod
    def start(cls, model_path: Path) -> WeightPrefetch | None:
        """Start reading `model_path`'s weights, or return None when the rules above say not to."""
        if os.environ.get(ENV_VAR, "1") == "0":
            return None
        files = weight_files(model_path)
        total = sum(p.stat().st_size for p in files)
        available = available_memory_bytes()
        if not files or available is None:
            return None
        if total > available // 2:
            logger.info(
                "Not prefetching the weights: %.1f GB is more than half the %.1f GB of memory available",
                total / 1e9,
                available / 1e9,
            )
            return None
        logger.info("Reading %.1f GB of weights into the page cache while the workers start", total / 1e9)
        prefetch = cls(files)
        prefetch._thread.start()
        return prefetch

    def _read(self) -> None:
        start = time.perf_counter()
        buffer = bytearray(CHUNK)
        try:
            for path in self.files:
                with open(path, "rb", buffering=0) as file:
                    while not self._stop.is_set() and (n := file.readinto(buffer)):
                        self.bytes_read += n
                if self._stop.is_set():
                    return
        except OSError as exc:  # a file replaced under us: the workers report real load errors
            logger.debug("Weight prefetch stopped: %s", exc)
            return
        seconds = max(time.perf_counter() - start, 1e-9)
        logger.info(
            "Read %.1f GB of weights in %.1f s (%.2f GB/s)",
            self.bytes_read / 1e9,
            seconds,
            self.bytes_read / 1e9 / seconds,
        )

    def stop(self) -> None:
        self._stop.set()

    def join(self, timeout: float | None = None) -> None:
        self._thread.join(timeout)
