"""Test only: what a rank holds between requests, for the leak test (`MemoryTrace`).

VLLM_OMNI_TEST_MEMORY_TRACE=<prompt> makes the rank (through testing/hooks.py) measure as each request with
that prompt arrives, that is after the previous request, with nothing of a request alive but the new
one; protocol.Stats carries the figures in its `extras` (tests/entrypoints/test_omni_memory.py).
"""

from __future__ import annotations

import gc
import os

import torch

from vllm_omni import envs
from vllm_omni.diffusion.request import DiffusionRequest

TRACE_ENV = envs.TEST_MEMORY_TRACE


class MemoryTrace:
    """The rank's live Python objects and tensors, after a full collection.

    Counted, not traced: tensor storages come from torch's allocator, which tracemalloc does not
    see, and tracemalloc's byte total moves by a few hundred bytes a request inside torch and
    transformers' native code with no Python object behind it (and slows a collection tenfold).
    Objects are those the collector tracks (containers, tensors, modules); a storage counts once.
    """

    @classmethod
    def from_env(cls) -> MemoryTrace | None:
        prompt = os.environ.get(TRACE_ENV)
        return cls(prompt) if prompt else None

    def __init__(self, prompt: str) -> None:
        self.prompt = prompt

    def measure(self, request: DiffusionRequest) -> dict[str, int] | None:
        """{"objects", "tensors", "tensor_bytes"} now, for a request with the traced prompt; else None."""
        if request.prompt != self.prompt:
            return None
        gc.collect()
        objects = gc.get_objects()
        tensors = [obj for obj in objects if issubclass(type(obj), torch.Tensor)]  # no __class__ lookups
        storages: dict[tuple[str, int], int] = {}
        for tensor in tensors:
            try:
                storage = tensor.untyped_storage()
                storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # sparse layouts; fake and functional tensors (no data)
                continue
        # The two lists themselves are not counted: gc.get_objects() does not hold itself.
        return {"objects": len(objects), "tensors": len(tensors), "tensor_bytes": sum(storages.values())}
