"""Logging for vllm_omni: one `init_logger(__name__)` per module, with `warning_once`.

Every module logs through a child of the ``vllm_omni`` logger, which writes to the
process's stderr (worker processes inherit it). ``VLLM_LOGGING_LEVEL`` sets the
level (default INFO), so ``VLLM_LOGGING_LEVEL=DEBUG`` shows the auto-pad lines.
"""

from __future__ import annotations

import logging
import os
import sys

_ROOT = "vllm_omni"
_FORMAT = "%(levelname)s %(asctime)s [%(processName)s %(filename)s:%(lineno)d] %(message)s"
_seen_once: set[str] = set()


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever sys.stderr is at the time of the record (test capture, redirected workers)."""

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def _configure_root() -> logging.Logger:
    root = logging.getLogger(_ROOT)
    if not getattr(root, "_vllm_omni_configured", False):
        handler = _StderrHandler()
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("VLLM_LOGGING_LEVEL", "INFO").upper())
        root.propagate = False
        root._vllm_omni_configured = True  # type: ignore[attr-defined]
    return root


class OmniLogger(logging.LoggerAdapter):
    """A logger with `warning_once`: the first call with a given format string logs, later ones do not."""

    def warning_once(self, msg: str, *args) -> None:
        if msg in _seen_once:
            return
        _seen_once.add(msg)
        self.warning(msg, *args, stacklevel=2)


def init_logger(name: str) -> OmniLogger:
    _configure_root()
    if not name.startswith(_ROOT):
        name = f"{_ROOT}.{name}"
    return OmniLogger(logging.getLogger(name), {})


def reset_warning_once() -> None:
    """Forget which one-time warnings fired (tests start each scenario as a fresh process would)."""
    _seen_once.clear()
