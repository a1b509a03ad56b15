"""Shared fixtures: process pools for SP tests (Ulysses 2 and 3 ranks; ring 2, ring 3 and Ulysses 2 x ring 2, USP;
over gloo), started once per session and closed after their last test; and the test
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
# The engines the tests start in this process fork their workers from one forkserver, which imports torch, diffusers
# and the families once (executor/multiproc.py): a worker group starts in about a second instead of a worker's
# imports, most of the suite's time on two cores. Servers and the benchmark scripts start theirs as they ship, with
# spawn (server_process.server_env). On a GPU the tests keep spawn, the default there too.
if not torch.cuda.is_available():
    os.environ.setdefault(envs.WORKER_MULTIPROC_METHOD, "forkserver")


# The pools' processes (half a GiB each) end after the last test that uses them, not with the session: the
# engines and servers later tests start need that memory on a 24 GiB machine.
_OPEN_POOLS: dict[str, SPWorkerPool] = {}
_LAST_USER: dict[str, str] = {}


def pytest_collection_finish(session: pytest.Session) -> None:
    for item in session.items:  # in run order, after deselection
        for name in ("sp_pool", "ring_pool"):
            if name in getattr(item, "fixturenames", ()):
                _LAST_USER[name] = item.nodeid


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    for name, pool in list(_OPEN_POOLS.items()):
        if _LAST_USER.get(name) == item.nodeid:
            pool.close()
            del _OPEN_POOLS[name]


@pytest.fixture(scope="session", params=[2, 3], ids=["sp2", "sp3"])
def sp_pool(request):
    pool = _OPEN_POOLS["sp_pool"] = SPWorkerPool(request.param)
    yield pool
    pool.close()


# (world size, ring degree): ring 2, ring 3 (Ulysses 1), and Ulysses 2 x ring 2.
RING_TOPOLOGIES = {"r2": (2, 2), "r3": (3, 3), "u2r2": (4, 2)}


@pytest.fixture(scope="session", params=sorted(RING_TOPOLOGIES), ids=sorted(RING_TOPOLOGIES))
def ring_pool(request):
    pool = _OPEN_POOLS["ring_pool"] = SPWorkerPool(*RING_TOPOLOGIES[request.param])
    yield pool
    pool.close()
