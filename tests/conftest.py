"""Shared fixtures: process pools for SP tests (Ulysses 2 and 3 ranks; ring 2, ring 3 and Ulysses 2 x ring 2, USP;
over gloo), started once per session; and the test
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


# (world size, ring degree): ring 2, ring 3 (Ulysses 1), and Ulysses 2 x ring 2.
RING_TOPOLOGIES = {"r2": (2, 2), "r3": (3, 3), "u2r2": (4, 2)}


@pytest.fixture(scope="session", params=sorted(RING_TOPOLOGIES), ids=sorted(RING_TOPOLOGIES))
def ring_pool(request):
    pool = SPWorkerPool(*RING_TOPOLOGIES[request.param])
    yield pool
    pool.close()
