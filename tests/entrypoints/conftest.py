"""Serving and offline-engine tests: markers, and the `Omni` engines a module's tests share.

The servers themselves are module fixtures in each test_serve_*.py."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "vllm: runs `vllm serve ... --omni` through vLLM's real CLI, in its own virtualenv "
        "(~/.cache/vllm_omni/vllm-venv); select alone with `-m vllm`",
    )


@pytest.fixture(scope="module")
def omni_engines():
    """get(model, degree=1, mode="trim", cfg=1): an Omni engine started on first use, shared by the
    module's tests and closed at its end (worker start-up dominates these tests' time)."""
    from vllm_omni import Omni

    started: dict[tuple, Omni] = {}

    def get(model: str, degree: int = 1, mode: str = "trim", cfg: int = 1) -> Omni:
        key = (model, degree, mode, cfg)
        if key not in started:
            started[key] = Omni(
                model,
                ulysses_degree=degree,
                cfg_parallel_size=cfg,
                mask_sp_padding=mode == "mask",
                trim_sp_padding=mode != "none",
            )
        return started[key]

    yield get
    # Each close waits for its workers to leave; together they wait once.
    with ThreadPoolExecutor(max_workers=max(len(started), 1)) as pool:
        list(pool.map(lambda omni: omni.close(), started.values()))
