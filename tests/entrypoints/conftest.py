"""Serving tests: markers. The servers themselves are module fixtures in each test_serve_*.py."""

from __future__ import annotations


def pytest_configure(config) -> None:
    config.addinivalue_line(
        "markers",
        "vllm: runs `vllm serve ... --omni` through vLLM's real CLI, in its own virtualenv "
        "(~/.cache/vllm_omni/vllm-venv); select alone with `-m vllm`",
    )
