"""Worker-side scaffolding the model tests share for SP runs on gloo workers (tests/sp_pool.py):
the three padding modes, a per-process model cache, and a context that runs in one mode and records warnings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator

import torch
from sp_padding import random_sp_padding

from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state, use_parallel_state
from vllm_omni.logger import reset_warning_once

MODES = {
    "mask": DiffusionParallelConfig(mask_sp_padding=True),
    "trim": DiffusionParallelConfig(),
    "none": DiffusionParallelConfig(trim_sp_padding=False),
}
_worker_models: dict = {}


def worker_model(load: Callable[[str], torch.nn.Module], folder: str) -> torch.nn.Module:
    """`load(folder)` in eval mode, loaded once per worker process."""
    if (load, folder) not in _worker_models:
        _worker_models[load, folder] = load(folder).eval()
    return _worker_models[load, folder]


class _Warnings(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextlib.contextmanager
def sp_mode(mode: str, random_padding: bool = False, reset_warnings: bool = False) -> Iterator[list[str]]:
    """The worker's SP group in padding `mode` (random padding if asked); yields the list of warnings logged inside.

    `reset_warnings` forgets the warnings already given once, so this run logs them again."""
    state = get_parallel_state()
    config = MODES[mode].replace(ulysses_degree=state.config.ulysses_degree, ring_degree=state.config.ring_degree)
    warnings, root = _Warnings(), logging.getLogger("vllm_omni")
    if reset_warnings:
        reset_warning_once()
    root.addHandler(warnings)
    try:
        with random_sp_padding(random_padding), use_parallel_state(dataclasses.replace(state, config=config)):
            yield warnings.messages
    finally:
        root.removeHandler(warnings)
