"""The VAE decode split over the ranks of a worker group (SP and CFG ranks together).

Holds the split's logic; forward_chain.py loads the pipeline's VAE as a `DecodeSplitVAE` subclass of
its class and installs the split on it, the runner passes the cancel check (`on_tile`).

Every rank reaches the pipeline's VAE decode with the same latents. With tiling on, diffusers'
`tiled_decode` cuts the latent into overlapping tiles, decodes each with `vae.decoder` (a causal
video VAE frame by frame, its feature cache cleared at each tile), then blends the tiles into the
output. `ParallelTiledDecode` runs the VAE's own `tiled_decode` twice, answering its decoder calls
(a `TilePass` on the VAE for the length of one run: the decoder's hook and the subclass's
`clear_cache`, `blend_v`, `blend_h` consult it):

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
import functools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook

from vllm_omni.diffusion.distributed.parallel_state import any_rank
from vllm_omni.diffusion.worker.memory_guard import is_out_of_memory, release_cached_memory
from vllm_omni.diffusion.worker.memory_plan import untiled_decode_bytes
from vllm_omni.logger import init_logger

logger = init_logger(__name__)


class _TilesDecoded(Exception):
    """Raised at the first blend call of the decode pass: every tile has been through the decoder."""


class TilePass:
    """One run of a VAE's own `tiled_decode` with its decoder calls going to `answer(tile, call, decode, *args)`.

    A tile starts at each decoder call of a VAE without a feature cache, and at the first call after
    each `clear_cache()` of one with (causal video VAEs clear it per tile).
    """

    def __init__(
        self,
        answer: Callable[..., torch.Tensor],
        tile_start: Callable[[int], None] | None,
        cached: bool,
        stop_at_blend: bool = False,
        count: list[int] | None = None,
    ) -> None:
        self.answer, self.tile_start, self.cached = answer, tile_start, cached
        self.stop_at_blend, self.count = stop_at_blend, count
        self.tile, self.call, self.new_tile = -1, 0, not cached

    def cache_cleared(self) -> None:
        self.new_tile = True

    def blend(self) -> None:
        if self.stop_at_blend:
            raise _TilesDecoded

    def decoder_call(self, decode: Callable[..., torch.Tensor], *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.new_tile or not self.cached:
            self.tile += 1
            self.call = 0
            self.new_tile = False
            if self.tile_start is not None:
                self.tile_start(self.tile)
        out = self.answer(self.tile, self.call, decode, *args, **kwargs)
        self.call += 1
        if self.count is not None:
            self.count[self.tile] += 1
        return out


class DecodeSplitVAE:
    """Mixin placed before a diffusers VAE class (`decode_split_class`): the split's entry points.

    `decode` goes through `decode_split` (a VAEDecodeSplit) where one is set, `tiled_decode` through
    its ParallelTiledDecode; during a `tile_pass` the blends report to it. Unset, the VAE is its class.
    """

    decode_split: VAEDecodeSplit | None = None  # set by forward_chain.install_decode_split
    tile_pass: TilePass | None = None  # set by ParallelTiledDecode for one run of `own_tiled_decode`

    def decode(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if self.decode_split is None:
            return super().decode(z, *args, **kwargs)
        return self.decode_split(super().decode, z, *args, **kwargs)

    def tiled_decode(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        split = self.decode_split
        if split is None or split.parallel is None:
            return super().tiled_decode(z, *args, **kwargs)
        return split.parallel(z, *args, **kwargs)

    def own_tiled_decode(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """The VAE class's own `tiled_decode` (diffusers' loop and blending)."""
        return super().tiled_decode(z, *args, **kwargs)

    def blend_v(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.tile_pass is not None:
            self.tile_pass.blend()
        return super().blend_v(*args, **kwargs)

    def blend_h(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        if self.tile_pass is not None:
            self.tile_pass.blend()
        return super().blend_h(*args, **kwargs)


class FeatureCacheTiles:
    """Mixin for a VAE with a feature cache cleared per tile (`clear_cache`): a clear starts a tile."""

    tile_pass: TilePass | None = None

    def clear_cache(self, *args: Any, **kwargs: Any) -> Any:
        if self.tile_pass is not None:
            self.tile_pass.cache_cleared()
        return super().clear_cache(*args, **kwargs)


@functools.cache
def decode_split_class(vae_class: type) -> type:
    """`vae_class` with the split's entry points (same config, same parameter names, same decode unset)."""
    mixins = (DecodeSplitVAE, FeatureCacheTiles) if hasattr(vae_class, "clear_cache") else (DecodeSplitVAE,)
    return type(f"{vae_class.__name__}WithDecodeSplit", (*mixins, vae_class), {})


class DecoderCalls(ModelHook):
    """The hook on a DecodeSplitVAE's `decoder`: its calls go to the VAE's current TilePass, if any."""

    NAME = "vllm_omni.vae_decoder_calls"

    def __init__(self, vae: DecodeSplitVAE) -> None:
        super().__init__()
        self.vae = vae

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        tile_pass = self.vae.tile_pass
        if tile_pass is None:
            return self.fn_ref.original_forward(*args, **kwargs)
        return tile_pass.decoder_call(self.fn_ref.original_forward, *args, **kwargs)


class ParallelTiledDecode:
    """A DecodeSplitVAE's `tiled_decode` as the split decode described above (forward_chain installs it).

    `group`: the data group (NCCL on GPUs); `control_group`: gloo, for the tiles' shapes. With
    `group=None` and `world > 1` the instance acts as `rank` of a simulated group: it decodes that
    rank's share and returns None (benchmarks time one rank's work on one GPU). The VAE's decoder
    must carry the DecoderCalls hook (forward_chain.install_decode_split).
    """

    def __init__(
        self,
        vae: DecodeSplitVAE,
        rank: int,
        world: int,
        group: Any = None,
        control_group: Any = None,
        on_tile: Callable[[int], None] | None = None,
    ) -> None:
        if not isinstance(vae, DecodeSplitVAE):
            raise TypeError(f"{type(vae).__name__} is not a DecodeSplitVAE (decode_split_class builds one)")
        self.vae, self.rank, self.world = vae, rank, world
        self.group, self.control_group = group, control_group
        self.on_tile = on_tile  # called at every tile start, on every rank; may raise to stop

    def __call__(self, z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        owned, calls = self._decode_share(z, *args, **kwargs)
        if calls is None:  # one tile, no blend: decode it here as the VAE would
            return self.vae.own_tiled_decode(z, *args, **kwargs)
        if self.group is None:
            return None  # simulated rank: its share is decoded, nothing to assemble
        outputs = self._gather(owned, calls, z)
        with self._answering(TilePass(lambda tile, call, *_, **__: outputs[tile][call], None, self._cached)):
            return self.vae.own_tiled_decode(z, *args, **kwargs)

    @property
    def _cached(self) -> bool:
        return isinstance(self.vae, FeatureCacheTiles)

    def _decode_share(self, z: torch.Tensor, *args: Any, **kwargs: Any):
        """Pass 1: {tile: [output of each decoder call]} for this rank's tiles, and every tile's call count."""
        owned: dict[int, list[torch.Tensor]] = {}
        calls: list[int] = []  # decoder calls per tile, every tile

        def answer(tile: int, call: int, decode: Callable[..., torch.Tensor], *call_args: Any, **call_kwargs: Any):
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
            with self._answering(TilePass(answer, tile_start, self._cached, stop_at_blend=True, count=calls)):
                self.vae.own_tiled_decode(z, *args, **kwargs)
        except _TilesDecoded:
            return owned, calls
        return owned, None

    @contextlib.contextmanager
    def _answering(self, tile_pass: TilePass) -> Iterator[None]:
        """For the length of one `own_tiled_decode`: the VAE's decoder calls and blends go to `tile_pass`."""
        self.vae.tile_pass = tile_pass
        try:
            yield
        finally:
            self.vae.tile_pass = None

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


# By default the split is on for videos (latents of several frames) on this many ranks or more:
# below it a rank's share is not faster than the untiled decode (benchmarks/vae_decode.py).
AUTO_MIN_RANKS = 4


class VAEDecodeSplit:
    """A DecodeSplitVAE's `decode`: tiled when the split is on for this latent, its tiles split by `parallel`.

    `enabled`: True / False, or None for the default: videos on AUTO_MIN_RANKS ranks or more, and any latent
    whose untiled decode the rank could not allocate now (`fits`, memory_guard.allocation_check; the untiled
    peak measured per VAE class, memory_plan.untiled_decode_bytes); and, as a backstop, a decode that ran out of
    memory untiled is run again tiled. With several ranks, each of those is agreed where every rank reaches it
    (before the decode, after its untiled attempt): one short of memory tiles them all, so a split's collectives
    are reached by every rank. The VAE's own tiling setting stays off otherwise, so its encode (an edit's source
    image) is never tiled. A latent of one tile still decodes whole (the VAE's own rule). `parallel`: None on one
    rank (tiled, not split).
    """

    def __init__(
        self,
        vae: torch.nn.Module,
        parallel: ParallelTiledDecode | None,
        world: int,
        enabled: bool | None,
        fits: Callable[[int], bool] | None = None,
    ):
        self.vae, self.parallel, self.world, self.enabled, self.fits = vae, parallel, world, enabled, fits

    def splits(self, z: torch.Tensor) -> bool:
        if self.enabled is not None:
            return self.enabled
        if z.dim() == 5 and z.shape[2] > 1 and self.world >= AUTO_MIN_RANKS:
            return True
        need = untiled_decode_bytes(self.vae, tuple(z.shape))
        if need is None or self.fits is None:  # alike on every rank: the VAE's class, the kind of device
            return False
        short = not self.fits(need)
        if short:
            logger.info("The untiled VAE decode (%.2f GiB) does not fit on this rank now: tiling it", need / 2**30)
        return self._agreed(short)

    def _agreed(self, flag: bool) -> bool:
        return any_rank(flag) if self.parallel is not None else flag

    def __call__(self, decode: Callable[..., Any], z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        """`decode` is the VAE class's own."""
        if self.splits(z):
            return self._tiled(decode, z, *args, **kwargs)
        if self.enabled is not None:
            return decode(z, *args, **kwargs)
        try:
            out, failed = decode(z, *args, **kwargs), None
        except Exception as exc:  # noqa: BLE001 - an out-of-memory error is retried tiled, any other raised
            if not is_out_of_memory(exc):
                raise
            out, failed = None, f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
        if not self._agreed(failed is not None):
            return out
        del out
        logger.warning("The untiled VAE decode ran out of memory (%s): decoding it again, tiled", failed or "on a peer")
        release_cached_memory(z.device)
        return self._tiled(decode, z, *args, **kwargs)

    def _tiled(self, decode: Callable[..., Any], z: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tiling = self.vae.use_tiling
        self.vae.use_tiling = True
        try:
            return decode(z, *args, **kwargs)
        finally:
            self.vae.use_tiling = tiling
