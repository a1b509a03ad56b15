"""Shared fixtures: process pools for SP tests (2 and 3 ranks over gloo), started once per session."""

from __future__ import annotations

import pytest
import torch
from sp_pool import SPWorkerPool

torch.set_num_threads(1)


@pytest.fixture(scope="session", params=[2, 3], ids=["sp2", "sp3"])
def sp_pool(request):
    pool = SPWorkerPool(request.param)
    yield pool
    pool.close()
