"""The forward chain: the one module that wraps a denoiser, a scheduler step or a VAE decode.

The runner (runner.py) calls it once per loaded pipeline; the levers keep their logic in their own
modules (cfg_parallel.py, cfg_batch.py, step_cache.py, cuda_graphs.py, vae_parallel.py) and are wired here, in
this order, outermost first:

    denoiser(...)        diffusers hooks on `forward` (HookRegistry; the last registered runs first):
                           CountForwards -> CFGParallelHook (one branch computed, exchanged) or
                           CFGBatchHook (both branches' rows in one forward) ->
                           BranchContext (the step cache's context)
                         -> the model's own `forward` (host-side preparation) -> `run_sharded`
                         -> `sharded_wrapper`, declared by models/family.py's SequenceParallelTransformer:
                           CachedForward (the step cache's probe) -> CUDAGraphForward (capture, replay)
                         -> `forward_sharded` -> blocks (the first with the step cache's GroupFirstBlockHook)
    scheduler.step(...)  StepReportingScheduler, only for a pipeline without `callback_on_step_end`
    vae.decode(...)      DecodeSplitVAE.decode -> VAEDecodeSplit (tile or not) -> the class's decode
                           -> DecodeSplitVAE.tiled_decode -> ParallelTiledDecode -> the class's own
                           `tiled_decode`, its decoder calls through the DecoderCalls hook

diffusers' hooks wrap only `forward`. A pipeline calls its scheduler's `step` and its VAE's
`decode` by attribute, so those two are declared objects the pipeline holds as its components:
the scheduler a forwarding wrapper (it owns no tensors, and `step` is the only call that changes),
the VAE a subclass of its own class (`decode_split_class`, loaded from the checkpoint like the
original), since the split also answers calls the VAE's `tiled_decode` makes on itself.
`chain_of(denoiser)` lists a denoiser's chain as installed.
"""

from __future__ import annotations

import contextlib
import itertools
import json
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import diffusers
import torch
from diffusers.hooks import FirstBlockCacheConfig, HookRegistry, ModelHook, apply_first_block_cache
from diffusers.hooks.first_block_cache import FBCHeadBlockHook

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.models.family import SequenceParallelTransformer
from vllm_omni.diffusion.worker.cfg_batch import CFGBatch, CFGBatchHook
from vllm_omni.diffusion.worker.cfg_parallel import CFGParallel, CFGParallelHook
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward
from vllm_omni.diffusion.worker.step_cache import BranchContext, CachedForward, CacheRecord, GroupFirstBlockHook
from vllm_omni.diffusion.worker.vae_parallel import (
    DecoderCalls,
    DecodeSplitVAE,
    ParallelTiledDecode,
    VAEDecodeSplit,
    decode_split_class,
)


class CountForwards(ModelHook):
    """Counts a denoiser's forwards (the step log reports what each expert served)."""

    NAME = "vllm_omni.count_forwards"

    def __init__(self, counts: Counter, name: str) -> None:
        super().__init__()
        self.counts, self.name = counts, name

    def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[tuple, dict]:
        self.counts[self.name] += 1
        return args, kwargs


# ---- the denoiser ---------------------------------------------------------------------------------


def install_denoiser_chain(
    denoiser: SequenceParallelTransformer,
    graphs: dict[str, Any] | None,
    cfg: CFGParallel | CFGBatch | None,
    counts: Counter,
    name: str,
    cache: CacheRecord | None = None,
) -> None:
    """Install, on one denoiser, every wrapper its forward goes through (the module doc's order).

    `graphs`: CUDAGraphForward's keyword arguments, None for eager. `cfg`: how a step's two branches run
    (CFG parallel, or one pass). `cache`: the step cache's record, None for none. Installed innermost first.
    """
    head = _install_block_cache(denoiser, cache) if cache is not None else None
    registry = HookRegistry.check_if_exists_or_initialize(denoiser)
    if head is not None:
        registry.register_hook(BranchContext(head), BranchContext.NAME)
    if isinstance(cfg, CFGParallel):
        registry.register_hook(CFGParallelHook(cfg), CFGParallelHook.NAME)
    elif cfg is not None:
        registry.register_hook(CFGBatchHook(cfg), CFGBatchHook.NAME)
    registry.register_hook(CountForwards(counts, name), CountForwards.NAME)
    if graphs is not None:
        # Only the sharded part is replayed: the host-side preparation in `forward` decides shapes
        # and runs eagerly before it.
        graphed = CUDAGraphForward(denoiser.forward_sharded, **graphs)
        # A graph cannot branch on the host: the cache decides before it replays.
        denoiser.sharded_wrapper = graphed if head is None else CachedForward(denoiser.forward_sharded, graphed, head)


def _install_block_cache(denoiser: torch.nn.Module, record: CacheRecord) -> GroupFirstBlockHook:
    """diffusers' First-Block-Cache on the denoiser's blocks, its head hook replaced by the group-deciding one."""
    apply_first_block_cache(denoiser, FirstBlockCacheConfig(threshold=record.config.threshold))
    (registry, hook_name, diffusers_head) = _first_block_cache_head(denoiser)
    registry.remove_hook(hook_name)
    head = GroupFirstBlockHook(diffusers_head.state_manager, record)
    registry.register_hook(head, hook_name)
    return head


def _first_block_cache_head(denoiser: torch.nn.Module) -> tuple[HookRegistry, str, FBCHeadBlockHook]:
    """The registry, name and hook of the one First-Block-Cache head hook among the denoiser's blocks."""
    found = [
        (registry, hook_name, hook)
        for module in denoiser.modules()
        for registry in [diffusers_compat.hook_registry(module)]
        if registry is not None
        for hook_name, hook in registry.hooks.items()
        if isinstance(hook, FBCHeadBlockHook)
    ]
    (head,) = found
    return head


def reset_step_cache(denoiser: torch.nn.Module) -> None:
    """Empty the step cache's state on the denoiser and its blocks (a new request)."""
    HookRegistry.check_if_exists_or_initialize(denoiser).reset_stateful_hooks()


def sharded_graphs(denoiser: SequenceParallelTransformer) -> CUDAGraphForward | None:
    """The CUDAGraphForward around the denoiser's `forward_sharded`, None when it runs eagerly."""
    wrapper = denoiser.sharded_wrapper
    if isinstance(wrapper, CachedForward):
        wrapper = wrapper.graphed
    return wrapper if isinstance(wrapper, CUDAGraphForward) else None


def chain_of(denoiser: SequenceParallelTransformer) -> list[str]:
    """What a call of the denoiser goes through, outermost first: hook names, then the sharded wrappers' types."""
    registry = HookRegistry.check_if_exists_or_initialize(denoiser)
    chain = [*reversed(registry.hooks), "forward"]
    wrapper = denoiser.sharded_wrapper
    if isinstance(wrapper, CachedForward):
        chain.append(type(wrapper).__name__)
        wrapper = wrapper.graphed
    if wrapper is not None:
        chain.append(type(wrapper).__name__)
    return [*chain, "forward_sharded"]


# ---- the scheduler step ---------------------------------------------------------------------------


class StepReportingScheduler:
    """A pipeline's scheduler whose `step` then reports the step's end, for a pipeline without
    `callback_on_step_end`. Every other attribute read is the scheduler's."""

    def __init__(self, scheduler: Any) -> None:
        self.scheduler = scheduler
        self.on_step_end: Callable[[int], None] | None = None
        self.steps = itertools.count()

    def __getattr__(self, name: str) -> Any:  # only for names not found on the wrapper
        return getattr(self.scheduler, name)

    def step(self, *args: Any, **kwargs: Any) -> Any:
        out = self.scheduler.step(*args, **kwargs)
        if self.on_step_end is not None:
            self.on_step_end(next(self.steps))
        return out

    @contextlib.contextmanager
    def reporting(self, step_end: Callable[[int], None]) -> Iterator[None]:
        """`step_end(step)` after every step of one pipeline call, counted from 0."""
        self.on_step_end, self.steps = step_end, itertools.count()
        try:
            yield
        finally:
            self.on_step_end = None


def install_step_report(pipe: Any, has_step_callback: bool) -> StepReportingScheduler | None:
    """The pipeline's scheduler as a StepReportingScheduler where it has no step callback; else None."""
    if has_step_callback:
        return None
    reporting = StepReportingScheduler(pipe.scheduler)
    pipe.register_modules(scheduler=reporting)
    return reporting


# ---- the VAE decode -------------------------------------------------------------------------------


def load_decode_split_vae(path: str | Path, dtype: torch.dtype, enabled: bool | None) -> Any:
    """The checkpoint's VAE as its DecodeSplitVAE subclass where the split or tiling can apply, else None
    (the pipeline loads its own). The pipeline is then loaded with it as its `vae`."""
    entry = json.loads((Path(path) / "model_index.json").read_text()).get("vae")
    vae_class = getattr(diffusers, entry[1], None) if isinstance(entry, list) and entry[0] == "diffusers" else None
    if vae_class is None or not _may_tile(vae_class, enabled):
        return None
    return decode_split_class(vae_class).from_pretrained(path, subfolder="vae", dtype=dtype)


def _may_tile(vae_class: type, enabled: bool | None) -> bool:
    """Whether the decode may be tiled: a VAE diffusers can tile, and not turned off. Split over several ranks or
    asked for, it is; by default, where the untiled decode would not fit or ran out of memory (VAEDecodeSplit)."""
    return enabled is not False and hasattr(vae_class, "tiled_decode")


def install_decode_split(
    vae: Any,
    rank: int,
    world: int,
    group: Any,
    control_group: Any,
    enabled: bool | None,
    on_tile: Callable[[int], None] | None,
    fits: Callable[[int], bool] | None = None,
) -> VAEDecodeSplit | None:
    """The split decode on a DecodeSplitVAE (the runner calls it once; benchmarks and tests again):
    `vae.decode` decides, per latent, and `vae.tiled_decode` splits. None where it does not apply (`_may_tile`;
    on one rank the decode is tiled, not split). `fits(nbytes)`: whether the rank can allocate that much now
    (memory_guard.allocation_check), for the default's rule."""
    if not isinstance(vae, DecodeSplitVAE) or not hasattr(vae, "use_tiling") or not _may_tile(type(vae), enabled):
        return None
    registry = HookRegistry.check_if_exists_or_initialize(vae.decoder)
    if registry.get_hook(DecoderCalls.NAME) is None:
        registry.register_hook(DecoderCalls(vae), DecoderCalls.NAME)
    parallel = ParallelTiledDecode(vae, rank, world, group, control_group, on_tile) if world > 1 else None
    vae.decode_split = VAEDecodeSplit(vae, parallel, world, enabled, fits)
    return vae.decode_split
