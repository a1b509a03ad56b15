"""The collectives the SP core and the runner use.

`all_to_all` is the sequence<->head exchange of Ulysses attention: a rank holds a slice of the
sequence with all heads; after it, the whole sequence for a slice of the heads, and the reverse
call brings it back. The tensors exchanged are laid out `[world, ...]`: chunk `i` goes to (or
came from) rank `i`. The attention layer (attention/layer.py) packs and unpacks that layout.
`ring_pass` is ring attention's step: send a key/value block to the next rank of the ring while
receiving the previous rank's, asynchronously, so the block at hand is computed meanwhile.
`all_reduce_max` agrees on FP8 attention's scales. `broadcast_tensors` hands a dict of tensors from one
rank to its group (the prompt embeddings that one rank encodes for its peers).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class SimulatedGroup:
    """Stands in for a group of `size` ranks inside one process, for benchmarks on one GPU.

    Exchanges keep every shape (so a rank does exactly the work of a real Ulysses-N rank)
    but move data locally; the values are this rank's own, so only timings are meaningful.
    """

    def __init__(self, size: int) -> None:
        self.size = size


def group_size(group: dist.ProcessGroup | SimulatedGroup) -> int:
    return group.size if isinstance(group, SimulatedGroup) else dist.get_world_size(group)


def all_to_all(send: torch.Tensor, group: dist.ProcessGroup | SimulatedGroup) -> torch.Tensor:
    """Send `send[i]` to rank i of `group`; return `recv` with `recv[i]` from rank i."""
    if send.shape[0] != group_size(group):
        raise ValueError(f"all_to_all: dim 0 must equal the group size, got {tuple(send.shape)}")
    recv = torch.empty_like(send)
    if isinstance(group, SimulatedGroup):
        recv.copy_(send)
    else:
        dist.all_to_all_single(recv, send.contiguous(), group=group)
    return recv


class RingPass:
    """A ring step in flight (`ring_pass`): `wait()` before reading the received block."""

    def __init__(self, works: list) -> None:
        self._works = works

    def wait(self) -> None:
        for work in self._works:
            work.wait()
        self._works = []


def ring_pass(send: torch.Tensor, recv: torch.Tensor, group: dist.ProcessGroup | SimulatedGroup, rank: int) -> RingPass:
    """Start sending `send` to ring rank `rank + 1` and receiving into `recv` from ring rank `rank - 1` (ranks of
    `group`, in its order); both run while the caller computes, until `wait()`. A simulated group receives its
    own `send` (the shapes of a real ring step, not its values)."""
    if isinstance(group, SimulatedGroup):
        recv.copy_(send)
        return RingPass([])
    size = dist.get_world_size(group)
    ops = [
        dist.P2POp(dist.isend, send, group=group, group_peer=(rank + 1) % size),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % size),
    ]
    return RingPass(dist.batch_isend_irecv(ops))


def all_gather(x: torch.Tensor, group: dist.ProcessGroup | SimulatedGroup) -> list[torch.Tensor]:
    """Every rank's `x`, in rank order."""
    if isinstance(group, SimulatedGroup):
        return [x.clone() for _ in range(group.size)]
    chunks = [torch.empty_like(x) for _ in range(dist.get_world_size(group))]
    dist.all_gather(chunks, x.contiguous(), group=group)
    return chunks


def all_reduce_max(x: torch.Tensor, group: dist.ProcessGroup | SimulatedGroup) -> torch.Tensor:
    """The elementwise maximum of `x` over the ranks of `group`, in place (a simulated group: `x` itself)."""
    if not isinstance(group, SimulatedGroup):
        dist.all_reduce(x, op=dist.ReduceOp.MAX, group=group)
    return x


class SourceFailed(RuntimeError):
    """What `broadcast_tensors`' source raised instead of producing its tensors (`error`, re-raised)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__(str(error))
        self.error = error


def broadcast_tensors(
    tensors: dict[str, torch.Tensor] | BaseException | None,
    src: int,
    group: dist.ProcessGroup,
    control_group: dist.ProcessGroup,
) -> dict[str, torch.Tensor]:
    """`tensors` from global rank `src` on every rank of `group` (names, shapes and dtypes go over the
    gloo `control_group` first, so the receivers can allocate); receivers pass None.

    A source that failed to make them passes its exception instead: every rank then raises
    `SourceFailed` carrying it (the receivers a copy), at this one point all of them reach, so
    none is left waiting for tensors that will not come."""
    if isinstance(tensors, BaseException):
        meta: list = [tensors]
    else:
        meta = [None if tensors is None else {k: (tuple(v.shape), v.dtype, v.device.type) for k, v in tensors.items()}]
    dist.broadcast_object_list(meta, src=src, group=control_group)
    if isinstance(meta[0], BaseException):
        raise SourceFailed(meta[0])
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    out = {}
    for name, (shape, dtype, _) in meta[0].items():
        tensor = tensors[name].contiguous() if tensors is not None else torch.empty(shape, dtype=dtype, device=device)
        dist.broadcast(tensor, src=src, group=group)
        out[name] = tensor
    return out
