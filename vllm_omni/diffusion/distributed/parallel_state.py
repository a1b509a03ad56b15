"""Process groups for one diffusion worker: the world, its SP and CFG groups, and a CPU control group.

The worker calls `initialize_parallel_state` once after it starts; models and the
attention layer read the groups through `get_parallel_state()`. Ranks are laid out
cfg-major: rank = cfg_rank * sequence_parallel_size + sp_rank, so an SP group is a
run of consecutive ranks (consecutive GPUs, the fastest links).

Inside an SP group of ulysses_degree x ring_degree ranks (USP), the Ulysses groups are runs of
consecutive ranks and the ring groups stride across them: sp_rank = ring_rank * ulysses_degree +
ulysses_rank. The all-to-alls stay on the closest GPUs (within a node, where the Ray executor gives a
node consecutive ranks), and the ring's send/recv crosses the slower links. Since a stream is split
over the SP group in rank order, a Ulysses group's all-to-all leaves each of its ranks one contiguous
block of the sequence (the ring's key/value block), for its share of the heads.

A decision that changes what a rank executes next is agreed by exactly the ranks it concerns,
over a CPU (gloo) control group, so it never waits behind queued GPU work (on CPU runs the
world and SP groups already are gloo and serve as their own control groups):
- `any_rank` / `every_rank` over the world: stop at this step (the cancel check, which every
  rank reaches at the end of every denoising step).
- `every_sp_rank` over the rank's SP group: replay a CUDA graph or run eagerly. A graph holds
  its SP group's all-to-alls and ring passes, so only that group must agree (its Ulysses and ring
  ranks alike: the SP group holds both); the CFG groups run different prompts, miss their graph
  caches at different requests, and must not meet in this decision.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from vllm_omni.diffusion.config import DiffusionParallelConfig
from vllm_omni.diffusion.distributed.comm import SimulatedGroup


@dataclass
class ParallelState:
    config: DiffusionParallelConfig
    rank: int
    world_size: int
    sp_group: dist.ProcessGroup | SimulatedGroup | None  # None when this process is alone in its SP group
    cfg_group: dist.ProcessGroup | None
    control_group: dist.ProcessGroup | None = None  # gloo, every rank; None when alone (or simulated)
    sp_control_group: dist.ProcessGroup | None = None  # gloo, this rank's SP group; None when alone in it
    # Within the SP group: the all-to-all's group and the ring's (None where its degree is 1). With one of the
    # degrees at 1 the other's group is the SP group itself (filled in when not given).
    ulysses_group: dist.ProcessGroup | SimulatedGroup | None = None
    ring_group: dist.ProcessGroup | SimulatedGroup | None = None

    def __post_init__(self) -> None:
        if self.config.ring_degree == 1 and self.ulysses_group is None:
            self.ulysses_group = self.sp_group
        if self.config.ulysses_degree == 1 and self.ring_group is None:
            self.ring_group = self.sp_group

    @property
    def sp_world_size(self) -> int:
        return self.config.sequence_parallel_size

    @property
    def sp_rank(self) -> int:
        return self.rank % self.sp_world_size

    @property
    def ulysses_rank(self) -> int:
        return self.sp_rank % self.config.ulysses_degree

    @property
    def ring_rank(self) -> int:
        return self.sp_rank // self.config.ulysses_degree

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
    timeout: timedelta | None = None,
) -> ParallelState:
    """Join the world (when it has more than one rank) and build the SP, CFG and control groups, and within
    each SP group its Ulysses and ring groups.

    `init_method` is a torch.distributed URL such as ``tcp://127.0.0.1:29500``; it may
    be None only for a world of one. `timeout` bounds the rendezvous and every collective
    of every group (None: torch's default); a rank whose peer never arrives then fails
    instead of waiting forever.
    """
    global _STATE
    world_size = config.world_size
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
    sp_group = cfg_group = control_group = sp_control_group = ulysses_group = ring_group = None
    if world_size > 1:
        if init_method is None:
            raise ValueError("init_method is required for a world of more than one rank")
        bounded = {} if timeout is None else {"timeout": timeout}
        if not dist.is_initialized():
            dist.init_process_group(
                backend=default_backend(device), init_method=init_method, rank=rank, world_size=world_size, **bounded
            )
        sp = config.sequence_parallel_size
        gloo = dist.get_backend() == "gloo"
        # Every rank must create every group, in the same order.
        for cfg_index in range(config.cfg_parallel_size):
            ranks = list(range(cfg_index * sp, (cfg_index + 1) * sp))
            group = dist.new_group(ranks, **bounded) if sp > 1 else None
            control = group if gloo or sp == 1 else dist.new_group(ranks, backend="gloo", **bounded)
            if rank in ranks:
                sp_group, sp_control_group = group, control
            ulysses, ring = config.ulysses_degree, config.ring_degree
            if ulysses > 1 and ring > 1:  # USP: one group per run of ulysses ranks, one per stride
                base = cfg_index * sp
                for ring_index in range(ring):
                    ranks = [base + ring_index * ulysses + u for u in range(ulysses)]
                    group = dist.new_group(ranks, **bounded)
                    if rank in ranks:
                        ulysses_group = group
                for ulysses_index in range(ulysses):
                    ranks = [base + r * ulysses + ulysses_index for r in range(ring)]
                    group = dist.new_group(ranks, **bounded)
                    if rank in ranks:
                        ring_group = group
        for sp_index in range(sp):
            ranks = [cfg_index * sp + sp_index for cfg_index in range(config.cfg_parallel_size)]
            group = dist.new_group(ranks, **bounded) if len(ranks) > 1 else None
            if rank in ranks:
                cfg_group = group
        if gloo:
            control_group = dist.group.WORLD
        else:
            control_group = dist.new_group(list(range(world_size)), backend="gloo", **bounded)
    _STATE = ParallelState(
        config=config,
        rank=rank,
        world_size=world_size,
        sp_group=sp_group,
        cfg_group=cfg_group,
        control_group=control_group,
        sp_control_group=sp_control_group,
        ulysses_group=ulysses_group,
        ring_group=ring_group,
    )
    return _STATE


def initialize_simulated_parallel_state(config: DiffusionParallelConfig, rank: int = 0) -> ParallelState:
    """Act as `rank` of an SP group that exists only in shape (benchmarks on one GPU; see comm.SimulatedGroup)."""
    global _STATE
    if config.cfg_parallel_size != 1:
        raise ValueError("a simulated group covers sequence parallelism only (cfg_parallel_size=1)")
    group = SimulatedGroup(config.sequence_parallel_size) if config.sequence_parallel_size > 1 else None
    ulysses = SimulatedGroup(config.ulysses_degree) if config.ulysses_degree > 1 else None
    ring = SimulatedGroup(config.ring_degree) if config.ring_degree > 1 else None
    _STATE = ParallelState(
        config=config,
        rank=rank,
        world_size=config.world_size,
        sp_group=group,
        cfg_group=None,
        ulysses_group=ulysses,
        ring_group=ring,
    )
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


def get_control_group() -> dist.ProcessGroup | None:
    """The CPU (gloo) group over every rank for control decisions; None in a process alone."""
    return None if _STATE is None else _STATE.control_group


def _agree(flag: bool, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> bool:
    if group is None:
        return bool(flag)
    value = torch.tensor([int(bool(flag))], dtype=torch.int32)
    dist.all_reduce(value, op=op, group=group)
    return bool(value.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when `flag` is True on at least one (e.g. "stop": a cancel seen by any rank).

    A collective over the control group: every rank of the world must call it at the same point.
    """
    return _agree(flag, dist.ReduceOp.MAX, get_control_group())


def most_of_ranks(value: int) -> int:
    """The largest of every rank's `value` (e.g. the costliest placement any rank needs), on every rank.

    A collective over the control group: every rank of the world must call it at the same point.
    """
    group = get_control_group()
    if group is None:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return int(tensor.item())


def any_rank_each(*flags: bool) -> tuple[bool, ...]:
    """`any_rank` of several flags in one collective (a step's stop and whether a request waits to run inside it)."""
    group = get_control_group()
    if group is None:
        return tuple(bool(flag) for flag in flags)
    values = torch.tensor([int(bool(flag)) for flag in flags], dtype=torch.int32)
    dist.all_reduce(values, op=dist.ReduceOp.MAX, group=group)
    return tuple(bool(value) for value in values.tolist())


def every_rank(flag: bool) -> bool:
    """True on every rank only when `flag` is True on all of them (e.g. "every rank captured its graph").

    A collective over the control group: every rank of the world must call it at the same point.
    """
    return _agree(flag, dist.ReduceOp.MIN, get_control_group())


def same_on_every_rank(value: int) -> bool:
    """True on every rank when every rank gave the same `value` (e.g. a fingerprint of what it is about to run).

    One collective over the control group (a MIN of value and -value): every rank of the world must call it at the
    same point.
    """
    group = get_control_group()
    if group is None:
        return True
    values = torch.tensor([value, -value], dtype=torch.int64)
    dist.all_reduce(values, op=dist.ReduceOp.MIN, group=group)
    return int(values[0]) == value and -int(values[1]) == value


def every_sp_rank(flag: bool) -> bool:
    """True on every rank of this rank's SP group only when `flag` is True on all of them.

    A collective over the SP group's control group (e.g. "every rank of my SP group captured its
    graph"): every rank of the SP group, and no other, must call it at the same point.
    """
    return _agree(flag, dist.ReduceOp.MIN, None if _STATE is None else _STATE.sp_control_group)


def destroy_parallel_state() -> None:
    global _STATE
    _STATE = None
    if dist.is_initialized():
        dist.destroy_process_group()
