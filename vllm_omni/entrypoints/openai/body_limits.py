"""What a request body may be: its deadline, a text field's byte limit (files: `EngineLimits.max_upload_bytes`), and
how many bodies are read at once.

Enforced by routes/bodies.py; set by `vllm-omni serve` (cli/serve.py, which reads the defaults for
`--help`: this module stays free of torch and FastAPI) through `ServerSettings.bodies`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class BodyLimits:
    read_timeout_s: float = 30.0  # the whole body must arrive within this, or 408
    max_field_bytes: int = 1024 * 1024  # one text field's value (prompt, negative_prompt, ...), UTF-8, JSON or form
    # Bodies being read at once, on every route together; more get 429. A body is read before its request takes a
    # queue place, so this (not --max-queue) bounds the memory of uploads in flight: at most this many body caps.
    max_reads: int = 16

    def __post_init__(self) -> None:
        if not (math.isfinite(self.read_timeout_s) and self.read_timeout_s > 0):
            raise ValueError(f"read_timeout_s must be a positive number of seconds, got {self.read_timeout_s}")
        if self.max_field_bytes < 1:
            raise ValueError(f"max_field_bytes must be positive, got {self.max_field_bytes}")
        if self.max_reads < 1:
            raise ValueError(f"max_reads must be positive, got {self.max_reads}")
