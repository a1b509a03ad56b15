"""A pool of real processes joined in one gloo process group, for SP tests on the CPU.

`SPWorkerPool(world_size)` starts one process per rank with `initialize_parallel_state`
(Ulysses degree = world size; `ring_degree=R` splits it as ulysses x ring, USP);
`pool.run(fn, *args)` calls the module-level function `fn` on every rank and returns the
per-rank results, raising with the rank's traceback when one fails. Pools are session fixtures
(conftest.py) so tests share the startup cost.
"""

from __future__ import annotations

import multiprocessing as mp
import socket
import traceback
from datetime import timedelta

TIMEOUT_S = 120


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _worker_main(rank: int, world_size: int, init_method: str, conn, ring_degree: int = 1) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from vllm_omni.diffusion.config import DiffusionParallelConfig
    from vllm_omni.diffusion.distributed.parallel_state import initialize_parallel_state

    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=TIMEOUT_S)
    )
    config = DiffusionParallelConfig(ulysses_degree=world_size // ring_degree, ring_degree=ring_degree)
    initialize_parallel_state(config, rank, init_method)
    while True:
        message = conn.recv()
        if message is None:
            break
        fn, args, kwargs = message
        try:
            conn.send(("ok", fn(*args, **kwargs)))
        except BaseException:  # noqa: BLE001 - the traceback goes back to the test
            conn.send(("error", traceback.format_exc()))


class SPWorkerPool:
    def __init__(self, world_size: int, ring_degree: int = 1) -> None:
        ctx = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self.world_size = world_size
        self.ring_degree = ring_degree
        self.ulysses_degree = world_size // ring_degree
        self.conns, self.procs = [], []
        self.closed = False
        for rank in range(world_size):
            parent, child = ctx.Pipe()
            args = (rank, world_size, init_method, child, ring_degree)
            proc = ctx.Process(target=_worker_main, args=args, daemon=True)
            proc.start()
            self.conns.append(parent)
            self.procs.append(proc)

    def run(self, fn, *args, **kwargs) -> list:
        for conn in self.conns:
            conn.send((fn, args, kwargs))
        results, errors = [], []
        for rank, conn in enumerate(self.conns):
            if not conn.poll(TIMEOUT_S):
                self.close()
                raise TimeoutError(f"rank {rank} did not answer within {TIMEOUT_S} s")
            status, value = conn.recv()
            if status == "error":
                errors.append(f"rank {rank}:\n{value}")
            results.append(value)
        if errors:
            raise RuntimeError("\n".join(errors))
        return results

    def close(self) -> None:
        if self.closed:  # after its last test (conftest.py), and again at the session's end
            return
        self.closed = True
        for conn in self.conns:  # every rank first: a rank may wait for its peers as it leaves the group
            try:
                conn.send(None)
            except (BrokenPipeError, OSError):
                pass
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
