"""Shared fixtures: process pools for SP tests (2 and 3 ranks over gloo), started once per session; and the test
doubles' factory (testing/hooks.py) named for every worker the tests start, which then reads the variables that
switch each double on (diffusion/worker/hooks.py)."""

from __future__ import annotations

import os

import pytest
import torch
from sp_pool import SPWorkerPool

from vllm_omni import envs
from vllm_omni.testing.hooks import FACTORY

torch.set_num_threads(1)
os.environ[envs.TEST_HOOKS] = FACTORY  # inherited by worker processes and forwarded to Ray actors


@pytest.fixture(scope="session", params=[2, 3], ids=["sp2", "sp3"])
def sp_pool(request):
    pool = SPWorkerPool(request.param)
    yield pool
    pool.close()
