"""Process groups for one diffusion worker: the world, its SP groups and its CFG groups.

The worker calls `initialize_parallel_state` once after it starts; models and the
attention layer read the groups through `get_parallel_state()`. Ranks are laid out
cfg-major: rank = cfg_rank * sequence_parallel_size + sp_rank, so an SP group is a
run of consecutive ranks (consecutive GPUs, the fastest links).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.distributed as dist

from vllm_omni.diffusion.data import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.comm import SimulatedGroup


@dataclass
class ParallelState:
    config: DiffusionParallelConfig
    rank: int
    world_size: int
    sp_group: dist.ProcessGroup | SimulatedGroup | None  # None when this process is alone in its SP group
    cfg_group: dist.ProcessGroup | None

    @property
    def sp_world_size(self) -> int:
        return self.config.sequence_parallel_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_world_size

    @property
    def cfg_rank(self) -> int:
        return self.rank // self.sp_world_size


_STATE: ParallelState | None = None


def default_backend(device: torch.device | str) -> str:
    return "nccl" if torch.device(device).type == "cuda" else "gloo"


def initialize_parallel_state(
    config: DiffusionParallelConfig,
    rank: int = 0,
    init_method: str | None = None,
    device: torch.device | str = "cpu",
) -> ParallelState:
    """Join the world (when it has more than one rank) and build the SP and CFG groups.

    `init_method` is a torch.distributed URL such as ``tcp://127.0.0.1:29500``; it may
    be None only for a world of one.
    """
    global _STATE
    world_size = config.world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    sp_group = cfg_group = None
    if world_size > 1:
        if init_method is None:
            raise ValueError("init_method is required for a world of more than one rank")
        if not dist.is_initialized():
            dist.init_process_group(
                backend=default_backend(device), init_method=init_method, rank=rank, world_size=world_size
            )
        sp = config.sequence_parallel_size
        # Every rank must create every group, in the same order.
        for cfg_index in range(config.cfg_parallel_size):
            ranks = list(range(cfg_index * sp, (cfg_index + 1) * sp))
            group = dist.new_group(ranks) if sp > 1 else None
            if rank in ranks:
                sp_group = group
        for sp_index in range(sp):
            ranks = [cfg_index * sp + sp_index for cfg_index in range(config.cfg_parallel_size)]
            group = dist.new_group(ranks) if len(ranks) > 1 else None
            if rank in ranks:
                cfg_group = group
    _STATE = ParallelState(config=config, rank=rank, world_size=world_size, sp_group=sp_group, cfg_group=cfg_group)
    return _STATE


def initialize_simulated_parallel_state(config: DiffusionParallelConfig, rank: int = 0) -> ParallelState:
    """Act as `rank` of an SP group that exists only in shape (benchmarks on one GPU; see comm.SimulatedGroup)."""
    global _STATE
    if config.cfg_parallel_size != 1:
        raise ValueError("a simulated group covers sequence parallelism only (cfg_parallel_size=1)")
    group = SimulatedGroup(config.sequence_parallel_size) if config.sequence_parallel_size > 1 else None
    _STATE = ParallelState(config=config, rank=rank, world_size=config.world_size, sp_group=group, cfg_group=None)
    return _STATE


@contextlib.contextmanager
def use_parallel_state(state: ParallelState | None) -> Iterator[ParallelState | None]:
    """Temporarily run as `state` (None: a plain single process); tests and benchmarks switch modes with it."""
    global _STATE
    previous, _STATE = _STATE, state
    try:
        yield state
    finally:
        _STATE = previous


def get_parallel_state() -> ParallelState | None:
    """The state set by `initialize_parallel_state`, or None in a plain single process."""
    return _STATE


def destroy_parallel_state() -> None:
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()
