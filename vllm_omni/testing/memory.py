"""A simulated device memory for the memory plan's tests (worker/memory_plan.py `plan_rank`, through testing/hooks.py).

VLLM_OMNI_TEST_GPU_MEMORY='TOTAL[,FREE]' (bytes, or with a KiB/MiB/GiB suffix) makes every rank plan
against a device of that size, on a CPU too, so a deploy that cannot fit is refused there as on a GPU.
VLLM_OMNI_TEST_MEASURED_STEP='FACTOR' stands in for the warm-up's measured step where no GPU measures one
(worker.py, through testing/hooks.py): the step measures FACTOR times the plan's estimate.
"""

from __future__ import annotations

import os

from vllm_omni import envs

TEST_GPU_MEMORY_ENV = envs.TEST_GPU_MEMORY
TEST_MEASURED_STEP_ENV = envs.TEST_MEASURED_STEP
_UNITS = {"kib": 2**10, "mib": 2**20, "gib": 2**30}


def _bytes(text: str) -> int:
    text = text.strip().lower()
    for suffix, unit in _UNITS.items():
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * unit)
    return int(text)


def simulated_device_memory() -> tuple[int, int] | None:
    """(total, free) from VLLM_OMNI_TEST_GPU_MEMORY; None when it is not set."""
    text = os.environ.get(TEST_GPU_MEMORY_ENV)
    if not text:
        return None
    total, _, free = text.partition(",")
    return _bytes(total), _bytes(free) if free else _bytes(total)


def simulated_step_factor() -> float | None:
    """How many times the plan's estimate a measured step is (VLLM_OMNI_TEST_MEASURED_STEP); None when it is not set."""
    text = os.environ.get(TEST_MEASURED_STEP_ENV)
    return None if not text else float(text)
