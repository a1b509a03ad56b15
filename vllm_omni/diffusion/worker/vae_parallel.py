"""The VAE decode split over the ranks of a worker group (SP and CFG ranks together).

Every rank reaches the pipeline's VAE decode with the same latents. With tiling on, diffusers'
`tiled_decode` cuts the latent into overlapping tiles, decodes each with `vae.decoder` (a causal
video VAE frame by frame, its feature cache cleared at each tile), then blends the tiles into the
output. `ParallelTiledDecode` runs the VAE's own `tiled_decode` twice, answering its decoder calls:

1. Decode: tile t belongs to rank t % world. A rank decodes its own tiles and answers the others'
   decoder calls with empty placeholders; the first blend call (the loop is over) ends the pass.
2. Assemble: the decoded tiles are gathered on rank 0, the rank that answers the request, which
   runs `tiled_decode` again with every decoder call answered from them, so diffusers' own loop
   and blending build the output: it equals the single-rank tiled decode bit for bit. The other
   ranks assemble zeros of the same shapes (their result is discarded).

A latent of one tile never reaches `tiled_decode` (the VAE decodes it whole) or, if it does,
finishes the first pass without a blend; every rank then decodes it alone, as without this.
Every rank sees every tile start, so a cancel check there (`on_tile`) is reached by all ranks
alike. Which tiles a rank decodes, and whether the pass splits at all, follow from the latent's
shape, which every rank shares: nothing else needs agreeing.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist


class _TilesDecoded(Exception):
    """Raised at the first blend call of the decode pass: every tile has been through the decoder."""


class ParallelTiledDecode:
    """Replaces a VAE's `tiled_decode` (runner.py installs it) with the split decode described above.

    `group`: the data group (NCCL on GPUs); `control_group`: gloo, for the tiles' shapes. With
    `group=None` and `world > 1` the instance acts as `rank` of a simulated group: it decodes that
    rank's share and returns None (benchmarks time one rank's work on one GPU).
    """

    def __init__(
        self,
        vae: torch.nn.Module,
        rank: int,
        world: int,
        group: Any = None,
        control_group: Any = None,
        on_tile: Callable[[int], None] | None = None,
    ) -> None:
        self.vae, self.rank, self.world = vae, rank, world
        self.group, self.control_group = group, control_group
        self.on_tile = on_tile  # called at every tile start, on every rank; may raise to stop
        self.tiled_decode = vae.tiled_decode  # the VAE's own method

    def __call__(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        owned, calls = self._decode_share(z, *args, **kwargs)
        if calls is None:  # one tile, no blend: decode it here as the VAE would
            return self.tiled_decode(z, *args, **kwargs)
        if self.group is None:
            return None  # simulated rank: its share is decoded, nothing to assemble
        outputs = self._gather(owned, calls, z)
        with self._answering(lambda tile, call, *_, **__: outputs[tile][call], tile_start=None):
            return self.tiled_decode(z, *args, **kwargs)

    def _decode_share(self, z: torch.Tensor, *args: Any, **kwargs: Any):
        """Pass 1: {tile: [output of each decoder call]} for this rank's tiles, and every tile's call count."""
        owned: dict[int, list[torch.Tensor]] = {}
        calls: list[int] = []  # decoder calls per tile, every tile
        decode = self.vae.decoder.forward  # bound before `_answering` replaces it

        def answer(tile: int, call: int, *call_args: Any, **call_kwargs: Any) -> torch.Tensor:
            if tile % self.world != self.rank:
                return z.new_empty((0,) * z.dim())  # concatenates with its kind; never blended
            out = decode(*call_args, **call_kwargs)
            owned.setdefault(tile, []).append(out)
            return out

        def tile_start(tile: int) -> None:
            calls.append(0)
            if self.on_tile is not None:
                self.on_tile(tile)

        try:
            with self._answering(answer, tile_start, stop_at_blend=True, count=calls):
                self.tiled_decode(z, *args, **kwargs)
        except _TilesDecoded:
            return owned, calls
        return owned, None

    @contextlib.contextmanager
    def _answering(
        self,
        answer: Callable[..., torch.Tensor],
        tile_start: Callable[[int], None] | None,
        stop_at_blend: bool = False,
        count: list[int] | None = None,
    ) -> Iterator[None]:
        """For the length of one `tiled_decode`: decoder calls go to `answer(tile, call, *args)`.

        A tile starts at each decoder call of a VAE without a feature cache, and at the first
        call after each `clear_cache()` of one with (Wan's, Qwen-Image's: they clear it per tile).
        """
        vae, decoder = self.vae, self.vae.decoder
        cached = hasattr(vae, "clear_cache")
        position = {"tile": -1, "call": 0, "new_tile": not cached}
        clear_cache = vae.clear_cache if cached else None

        def on_clear(*args: Any, **kwargs: Any) -> Any:
            position["new_tile"] = True
            return clear_cache(*args, **kwargs)

        def on_decoder(*args: Any, **kwargs: Any) -> torch.Tensor:
            if position["new_tile"] or not cached:
                position["tile"] += 1
                position["call"] = 0
                position["new_tile"] = False
                if tile_start is not None:
                    tile_start(position["tile"])
            out = answer(position["tile"], position["call"], *args, **kwargs)
            position["call"] += 1
            if count is not None:
                count[position["tile"]] += 1
            return out

        def blend_stop(*args: Any, **kwargs: Any) -> Any:
            raise _TilesDecoded

        patched = {"forward": (decoder, on_decoder)}
        if cached:
            patched["clear_cache"] = (vae, on_clear)
        if stop_at_blend:
            patched["blend_v"] = (vae, blend_stop)
            patched["blend_h"] = (vae, blend_stop)
        for name, (owner, replacement) in patched.items():
            setattr(owner, name, replacement)
        try:
            yield
        finally:
            for name, (owner, _) in patched.items():
                delattr(owner, name)  # back to the class's method

    def _gather(self, owned: dict[int, list[torch.Tensor]], calls: list[int], z: torch.Tensor):
        """Every tile's outputs on rank 0 (zeros of their shapes elsewhere): [tile][call] -> tensor."""
        mine = [(tile, call, tuple(out.shape)) for tile, outs in sorted(owned.items()) for call, out in enumerate(outs)]
        shapes: list[list[tuple[int, int, tuple[int, ...]]]] = [[] for _ in range(self.world)]
        dist.all_gather_object(shapes, mine, group=self.control_group)
        dtype = next(self.vae.decoder.parameters()).dtype  # of every decoded tile, also on a rank with none
        sizes = [sum(_numel(shape) for _, _, shape in entries) for entries in shapes]
        buffer = torch.zeros(max(sizes), dtype=dtype, device=z.device)
        flat = [out.reshape(-1) for _, outs in sorted(owned.items()) for out in outs]
        if flat:
            buffer[: sizes[self.rank]] = torch.cat(flat)
        received = [torch.empty_like(buffer) for _ in range(self.world)] if self.rank == 0 else None
        dist.gather(buffer, received, dst=0, group=self.group)
        outputs: list[list[torch.Tensor | None]] = [[None] * n for n in calls]
        for source, entries in enumerate(shapes):
            offset = 0
            for tile, call, shape in entries:
                n = _numel(shape)
                if self.rank == 0:
                    outputs[tile][call] = received[source][offset : offset + n].view(shape)
                else:
                    outputs[tile][call] = buffer.new_zeros(shape)
                offset += n
        return outputs


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape)


# By default the split is on for videos (latents of several frames) on this many ranks or more.
# Measured on an H200 (benchmarks/vae_decode.py, docs/benchmarks.md): one rank's share of 4 takes
# 0.39x (HunyuanVideo 1.5 848x480x121), 0.52x and 0.67x (Wan 720p, 480p, 81 frames) of the untiled
# decode, and a share of 2 is slower than it for Wan. Images gain at most 0.04 s (Qwen-Image
# 1328x1328 at 8 ranks), not worth tiling's change of pixels.
AUTO_MIN_RANKS = 4


class VAEDecodeSplit:
    """Wraps `vae.decode`: tiles it when the split is on for this latent, and splits the tiles.

    `enabled`: True / False, or None for the default (videos on AUTO_MIN_RANKS ranks or more).
    The VAE's own tiling setting stays off otherwise, so its encode (an edit's source image) is
    never tiled. A latent of one tile still decodes whole (the VAE's own rule).
    """

    def __init__(self, vae: torch.nn.Module, split: ParallelTiledDecode, enabled: bool | None) -> None:
        self.vae, self.split, self.enabled = vae, split, enabled
        self.decode = vae.decode  # the VAE's own method

    def splits(self, z: torch.Tensor) -> bool:
        if self.enabled is not None:
            return self.enabled
        return z.dim() == 5 and z.shape[2] > 1 and self.split.world >= AUTO_MIN_RANKS

    def __call__(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if not self.splits(z):
            return self.decode(z, *args, **kwargs)
        tiling = self.vae.use_tiling
        self.vae.use_tiling = True
        try:
            return self.decode(z, *args, **kwargs)
        finally:
            self.vae.use_tiling = tiling


def install_decode_split(
    vae: torch.nn.Module,
    rank: int,
    world: int,
    group: Any,
    control_group: Any,
    enabled: bool | None,
    on_tile: Callable[[int], None],
) -> VAEDecodeSplit | None:
    """Put the split decode on `vae` (the runner calls it once): `vae.decode` decides, per latent,
    and `vae.tiled_decode` splits. None where it does not apply: one rank (with `enabled=True`,
    the decode is tiled but not split), or a VAE diffusers cannot tile."""
    if enabled is False or not hasattr(vae, "tiled_decode") or not hasattr(vae, "use_tiling"):
        return None
    split = ParallelTiledDecode(vae, rank, world, group, control_group, on_tile)
    if world > 1:
        vae.tiled_decode = split
    elif not enabled:
        return None
    wrapper = VAEDecodeSplit(vae, split, enabled)
    vae.decode = wrapper
    return wrapper
