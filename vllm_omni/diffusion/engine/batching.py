"""The batching rule: which queued requests may share one pipeline call (the scheduler asks it)."""

from __future__ import annotations

import dataclasses
from typing import Any

from vllm_omni.diffusion.request import DiffusionRequest

# DiffusionRequest fields that may differ between requests that share a forward: each row has its own.
PER_ROW_FIELDS = frozenset(
    {"request_id", "prompt", "negative_prompt", "seed", "cancel_token", "preprocess_ms", "batch"}
)


def batch_key(request: DiffusionRequest, spec: Any) -> tuple | None:
    """What must be equal for requests to share a forward (model, size, frames, steps, guidance mode, priority),
    None when this one never shares: source images (each pipeline call encodes its own), several
    images (a batch of its own already), a pipeline that batches no prompts (`PipelineSpec.batchable`)."""
    if not spec.batchable or request.images or request.num_images != 1 or request.batch:
        return None
    shared = tuple(
        (f.name, getattr(request, f.name)) for f in dataclasses.fields(request) if f.name not in PER_ROW_FIELDS
    )
    return (*shared, ("has_negative_prompt", request.negative_prompt is not None))
