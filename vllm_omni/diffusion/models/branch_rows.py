"""A CFG step's two denoiser calls as the rows of one call (worker/cfg_batch.py runs it; a family's `cfg_rows`
says how its calls combine, with these helpers).

`stack_branches(cond, uncond)`: the keyword arguments of both calls as one call's, the cond rows first. A tensor
or list with one entry per row (its first dimension the latents' batch) is concatenated, whether the calls share
it (the latents, the timestep) or not (the prompt embeddings); any other value both calls share (a flag, the
attention kwargs) passes as it is. Anything else (an argument one call lacks, rows of different shapes, a
non-row value that differs) gives None: the step runs as two forwards.

`pad_text(cond, uncond, text, mask)`: the branches' text padded to one length, with a mask that marks the
padding, for transformers that keep only the valid text tokens (text_compaction.py): a prompt and a negative
prompt of different lengths then become two rows, each attending to its own text. Cached on the input tensors,
so the padded pair (and the compaction planned on it) is the same object at every step.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_omni.diffusion.models.text_compaction import cached_on_tensors


def same_value(a: Any, b: Any) -> bool:
    """Whether two call arguments are the same: one object, or equal values (tensors compared on the device)."""
    if a is b:
        return True
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
            and a.device == b.device
            and bool(torch.equal(a, b))  # a device sync: only for arguments a pipeline rebuilds per call
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    try:
        return bool(a == b)
    except Exception:  # objects without a meaningful == (a cache object): only identity counts
        return False


def same_arguments(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)


def _is_rows(value: Any, rows: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and value.shape[0] == rows
    return isinstance(value, list) and len(value) == rows


def stack_branches(cond: dict[str, Any], uncond: dict[str, Any], rows_of: str = "hidden_states") -> dict | None:
    """One call's keyword arguments holding both calls' rows (cond first), or None where they do not stack."""
    if cond.keys() != uncond.keys() or not isinstance(cond.get(rows_of), torch.Tensor):
        return None
    rows = cond[rows_of].shape[0]
    stacked: dict[str, Any] = {}
    for name, a in cond.items():
        b = uncond[name]
        if _is_rows(a, rows) and _is_rows(b, rows):
            if isinstance(a, list):
                stacked[name] = a + b
            elif a.shape[1:] == b.shape[1:] and a.dtype == b.dtype:
                stacked[name] = torch.cat([a, b])
            else:
                return None
        elif same_value(a, b):
            stacked[name] = a
        else:
            return None
    return stacked


def pad_text(cond: dict[str, Any], uncond: dict[str, Any], text: str, mask: str) -> tuple[dict, dict]:
    """Both calls' `text` [B, L, D] padded to one length L, `mask` [B, L] marking the real tokens (None: all)."""
    a, b = cond.get(text), uncond.get(text)
    if not isinstance(a, torch.Tensor) or not isinstance(b, torch.Tensor) or a.shape[1] == b.shape[1]:
        return cond, uncond

    def padded() -> tuple[tuple[torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]:
        length = max(a.shape[1], b.shape[1])
        out = []
        for embeds, valid in ((a, cond.get(mask)), (b, uncond.get(mask))):
            if valid is None:
                valid = torch.ones(embeds.shape[:2], dtype=torch.long, device=embeds.device)
            extra = length - embeds.shape[1]
            embeds = torch.nn.functional.pad(embeds, (0, 0, 0, extra))
            out.append((embeds, torch.nn.functional.pad(valid, (0, extra))))
        return out[0], out[1]

    tensors = (a, cond.get(mask), b, uncond.get(mask))
    (ta, ma), (tb, mb) = cached_on_tensors(tensors, ("cfg_pad_text",), padded)
    return {**cond, text: ta, mask: ma}, {**uncond, text: tb, mask: mb}
