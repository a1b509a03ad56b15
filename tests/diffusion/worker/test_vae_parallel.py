"""The VAE decode split over 2 and 3 gloo ranks equals the single-rank tiled decode, bit for bit; by default a
decode that one rank cannot allocate untiled is tiled (and split) on every rank.

Real VAE classes of the tiny models (a video VAE with a per-tile feature cache, Wan2.2's; one
without, HunyuanVideo 1.5's; an image VAE, FLUX.2's), in fp32, with small tiles so that a small
latent makes a tile grid the rank count does not divide. Only rank 0 (the answering rank) gets
the pixels; the others get zeros of the same shape.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state
from vllm_omni.diffusion.model_source import resolve_model_path
from vllm_omni.diffusion.worker.forward_chain import install_decode_split
from vllm_omni.diffusion.worker.memory_plan import UNTILED_DECODE_BYTES_PER_PIXEL, untiled_decode_bytes
from vllm_omni.diffusion.worker.vae_parallel import DecodeSplitVAE, decode_split_class

# tiny model, VAE class, latent shape, tiling: 5 x 5 = 25 tiles each, which neither 2 nor 3 ranks divide
CASES = {
    "wan": (
        "tiny/wan2.2-t2v",
        "AutoencoderKLWan",
        (1, 16, 2, 25, 25),
        dict(
            tile_sample_min_height=64,
            tile_sample_min_width=64,
            tile_sample_stride_height=48,
            tile_sample_stride_width=48,
        ),
    ),
    "hunyuan": (
        "tiny/hunyuan-video-1.5",
        "AutoencoderKLHunyuanVideo15",
        (1, 8, 2, 13, 13),
        dict(tile_sample_min_height=64, tile_sample_min_width=64, tile_latent_min_height=4, tile_latent_min_width=4),
    ),
    "flux2": ("tiny/flux2", "AutoencoderKLFlux2", None, None),
}
_vaes: dict = {}
MEASURED = Path(__file__).resolve().parents[3] / "benchmarks" / "results" / "vae_decode.json"


def _vae(case: str):
    if case not in _vaes:
        import diffusers

        name, cls, _, tiling = CASES[case]
        vae = decode_split_class(getattr(diffusers, cls)).from_pretrained(resolve_model_path(name), subfolder="vae")
        vae.eval()
        if tiling is None:  # FLUX.2's VAE tiles at its config's sample size: make it small
            vae.enable_tiling()
            vae.tile_sample_min_size, vae.tile_latent_min_size = 32, 4
        else:
            vae.enable_tiling(**tiling)
        _vaes[case] = vae
    return _vaes[case]


def _latent(case: str) -> torch.Tensor:
    shape = CASES[case][2]
    if shape is None:
        vae = _vae(case)
        shape = (1, vae.config.latent_channels, 13, 13)
    return torch.randn(shape, generator=torch.Generator().manual_seed(0))


def decode_on_rank(case: str) -> tuple[int, torch.Tensor, int]:
    """Worker side: the split decode on this rank; (rank, output, tiles seen)."""
    state = get_parallel_state()
    vae = _vae(case)
    seen = []
    group = torch.distributed.group.WORLD
    install_decode_split(vae, state.rank, state.world_size, group, state.control_group, True, on_tile=seen.append)
    try:
        with torch.no_grad():
            out = vae.decode(_latent(case), return_dict=False)[0]
    finally:
        vae.decode_split = None  # the reference decode (rank 0's process) is the VAE's own
    return state.rank, out, len(seen)


@pytest.mark.parametrize("case", sorted(CASES))
def test_split_decode_equals_the_single_rank_tiled_decode(sp_pool, case):
    vae = _vae(case)
    with torch.no_grad():
        expected = vae.decode(_latent(case), return_dict=False)[0]
    results = sp_pool.run(decode_on_rank, case)
    tiles = {seen for _, _, seen in results}
    assert len(tiles) == 1 and tiles.pop() % sp_pool.world_size != 0  # every rank saw every tile start
    for rank, out, _ in results:
        assert out.shape == expected.shape
        if rank == 0:
            assert torch.equal(out, expected)
        else:
            assert not out.any()


def decode_by_default_on_rank(case: str, short_ranks: tuple[int, ...]) -> tuple[int, torch.Tensor, int]:
    """Worker side: the default decode (`enabled=None`) on a rank that can allocate the untiled decode's peak
    unless it is one of `short_ranks`; (rank, output, tiles seen)."""
    state = get_parallel_state()
    vae = _vae(case)
    seen = []
    group = torch.distributed.group.WORLD
    fits = lambda nbytes: state.rank not in short_ranks  # noqa: E731
    install_decode_split(vae, state.rank, state.world_size, group, state.control_group, None, seen.append, fits)
    vae.use_tiling = False  # as a pipeline loads it: the split turns tiling on for the decodes it tiles
    try:
        with torch.no_grad():
            out = vae.decode(_latent(case), return_dict=False)[0]
    finally:
        vae.decode_split, vae.use_tiling = None, True
    return state.rank, out, len(seen)


def test_one_rank_short_of_memory_for_the_untiled_decode_tiles_it_on_every_rank(sp_pool):
    """The last rank alone cannot allocate the untiled decode: every rank tiles and splits (agreed at the decode;
    had the others decoded whole, the split's gather would hang), and the output is the tiled decode."""
    vae = _vae("hunyuan")
    with torch.no_grad():
        tiled = vae.decode(_latent("hunyuan"), return_dict=False)[0]  # _vae turned its tiling on
    results = sp_pool.run(decode_by_default_on_rank, "hunyuan", (sp_pool.world_size - 1,))
    assert all(seen > 0 for _, _, seen in results)
    assert torch.equal(next(out for rank, out, _ in results if rank == 0), tiled)


def test_ranks_that_can_allocate_the_untiled_decode_decode_whole(sp_pool):
    vae = _vae("hunyuan")
    vae.use_tiling = False
    try:
        with torch.no_grad():
            whole = vae.decode(_latent("hunyuan"), return_dict=False)[0]
    finally:
        vae.use_tiling = True
    results = sp_pool.run(decode_by_default_on_rank, "hunyuan", ())
    for _, out, seen in results:
        assert seen == 0 and torch.equal(out, whole)


def decode_running_out_untiled_on_rank(case: str, failing_rank: int) -> tuple[int, torch.Tensor, int]:
    """Worker side: the default decode, its untiled attempt running out of memory on `failing_rank` alone (as a
    CUDA out-of-memory error reads; the CPU cannot run out); (rank, output, tiles seen)."""
    state = get_parallel_state()
    vae = _vae(case)
    seen = []
    group = torch.distributed.group.WORLD
    split = install_decode_split(vae, state.rank, state.world_size, group, state.control_group, None, seen.append)
    vae.use_tiling = False

    def decode(z, *args, **kwargs):
        if state.rank == failing_rank and not vae.use_tiling:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 23.49 GiB.")
        return super(DecodeSplitVAE, vae).decode(z, *args, **kwargs)  # the VAE class's own

    try:
        with torch.no_grad():
            out = split(decode, _latent(case), return_dict=False)[0]
    finally:
        vae.decode_split, vae.use_tiling = None, True
    return state.rank, out, len(seen)


@pytest.mark.parametrize("case", sorted(CASES))
def test_on_one_rank_an_untiled_decode_out_of_memory_is_decoded_again_tiled(case):
    """Every VAE diffusers can tile gets the backstop on one rank too, measured or not (FLUX.2's is not)."""
    vae = _vae(case)
    with torch.no_grad():
        tiled = vae.decode(_latent(case), return_dict=False)[0]
    split = install_decode_split(vae, 0, 1, None, None, None, None)
    vae.use_tiling = False
    attempts = []

    def decode(z, *args, **kwargs):
        attempts.append(vae.use_tiling)
        if not vae.use_tiling:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 23.49 GiB.")
        return super(DecodeSplitVAE, vae).decode(z, *args, **kwargs)

    try:
        with torch.no_grad():
            out = split(decode, _latent(case), return_dict=False)[0]
    finally:
        vae.decode_split, vae.use_tiling = None, True
    assert attempts == [False, True] and torch.equal(out, tiled)


def test_an_untiled_decode_out_of_memory_on_one_rank_is_decoded_again_tiled_on_every_rank(sp_pool):
    """The backstop behind the estimate: the ranks agree after the untiled attempt, and every one decodes tiled
    (split), so rank 0 answers with the tiled decode and no rank waits alone in the split's gather."""
    vae = _vae("hunyuan")
    with torch.no_grad():
        tiled = vae.decode(_latent("hunyuan"), return_dict=False)[0]
    results = sp_pool.run(decode_running_out_untiled_on_rank, "hunyuan", sp_pool.world_size - 1)
    assert all(seen > 0 for _, _, seen in results)
    assert torch.equal(next(out for rank, out, _ in results if rank == 0), tiled)


@pytest.mark.parametrize(
    "case", [c for c in json.loads(MEASURED.read_text()) if c["vae"] in UNTILED_DECODE_BYTES_PER_PIXEL]
)
def test_the_untiled_decode_estimate_reproduces_its_h200_measurement(case):
    """memory_plan.untiled_decode_bytes at the benchmark's latents (benchmarks/vae_decode.py, real-size VAEs built
    on the meta device, bf16) is within 5 % of the peak measured there."""
    import diffusers

    with torch.device("meta"):
        vae = getattr(diffusers, case["vae"])().to(torch.bfloat16)
    estimate = untiled_decode_bytes(vae, tuple(case["latent"]))
    assert estimate == pytest.approx(case["untiled_peak_gib"] * 2**30, rel=0.05)
