"""Step caching through diffusers' First-Block-Cache, decided for the whole SP group.

Holds the hooks and the per-request record; forward_chain.py installs them on a denoiser, the
runner starts and ends requests and steps on the record, the engine merges the ranks' reports.

diffusers' First-Block-Cache (`diffusers.hooks.apply_first_block_cache`) runs a denoiser's first
block at every step and measures how much that block's residual changed since the last computed
step: below `threshold` the remaining blocks are skipped, and the residual they added last time is
reused. diffusers measures the tensor it holds, which under SP is one rank's shard: ranks whose
shards changed by different amounts would take different branches, and one would wait in an
all-to-all the others never reach. So the head block's hook here (`GroupFirstBlockHook`, a
subclass of diffusers' own) sums |change| and |previous| over the real rows of every rank's shard
(the SP padding left out, sequence_parallel.real_rows), adds the sums up over the SP group and only
then divides: every rank of the group gets the number one process gets, and takes the same branch.
The other blocks keep diffusers' hooks.

Classifier-free guidance: diffusers' pipelines run cond and uncond in cache contexts of their own
(`cache_context("cond")`), each with its own cache and its own decisions; `BranchContext` names
the calls of a step the same way for a pipeline that sets no context. Under CFG
parallel each group runs one branch and decides it as one process would; the groups never meet in
a cache decision, since a skip changes nothing outside the group's own SP collectives.

CUDA graphs: a graph cannot branch on the host, so with graphs on the forward goes through
`CachedForward`: the forward runs eagerly up to the decision (the probe). A skipped step finishes
there, eagerly (the embeddings, the first block, the reused residual, the final projection: no
replay); a computed step stops the probe and replays the whole forward's graph, which runs the
first block again (one block in 60 on a 60-block model) and stores the new residuals, copied out of the
graph's memory afterwards so that no cache holds what a graph overwrites at its next replay.

`CacheRecord` keeps, per request, which steps each branch computed or skipped: the worker reports
it, the engine merges the ranks' records into the output (`DiffusionOutput.step_cache`) and the log.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Callable, Hashable
from typing import Any

import torch
from diffusers.hooks import ModelHook
from diffusers.hooks.first_block_cache import FBCHeadBlockHook
from diffusers.hooks.hooks import CacheContext

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.config import StepCacheConfig
from vllm_omni.diffusion.distributed.sequence_parallel import IMAGE, group_sum, real_rows
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

BRANCHES = ("cond", "uncond")  # the calls of a CFG step, in the order pipelines make them
SCRATCH = CacheContext("vllm_omni.graph")  # where a graphed forward's hooks write (CachedForward)


class CacheRecord:
    """One rank's cache decisions in the current request: branch -> {step: computed}, shared by its denoisers."""

    def __init__(self, config: StepCacheConfig) -> None:
        self.config = config
        self.threshold = config.threshold  # the current request's (its cache_threshold)
        self.step_index = 0  # the current request's denoising step
        self.calls = 0  # computed calls in this step (BranchContext's names)
        self.swapped = False  # CFG parallel group 1: its "cond" context runs the negative prompt
        self.decisions: dict[str, dict[int, bool]] = {}
        self.changes: list[float] = []  # the first block's relative changes this request (the median is reported)

    def start_request(self, threshold: float, swapped: bool) -> None:
        self.step_index, self.calls, self.threshold, self.swapped, self.decisions = 0, 0, threshold, swapped, {}
        self.changes = []

    def end_step(self) -> None:
        self.step_index += 1
        self.calls = 0

    def add(self, context: str, computed: bool, change: float = math.inf) -> None:
        context = context.removeprefix("pred_")  # diffusers' guiders name them pred_cond, pred_uncond
        if self.swapped and context in BRANCHES:
            context = BRANCHES[1 - BRANCHES.index(context)]
        self.decisions.setdefault(context, {})[self.step_index] = computed
        if math.isfinite(change):
            self.changes.append(change)

    def summary(self) -> dict[str, Any]:
        """What the worker reports: branch -> {step: computed}, and the changes measured."""
        return {"decisions": {b: dict(steps) for b, steps in self.decisions.items()}, "changes": list(self.changes)}

    def report(self) -> dict[str, Any]:
        """This rank's decisions as a response reports them (the step log's)."""
        return step_cache_report(self.config.policy, self.threshold, [self.summary()])


def relative_change(current: torch.Tensor, previous: torch.Tensor) -> float:
    """mean |current - previous| / mean |previous| over the real tokens of the whole SP group (dim 1)."""
    current, previous = real_rows(current, 1, IMAGE), real_rows(previous, 1, IMAGE)
    sums = torch.stack([(current - previous).abs().sum(), previous.abs().sum()]).double()
    change, scale = group_sum(sums).tolist()  # the group's totals: the same on every rank
    return change / scale if scale > 0 else math.inf


class ComputeInGraph(Exception):
    """Raised by the probe at a computed step: the graph of the whole forward replays instead."""


class GroupFirstBlockHook(FBCHeadBlockHook):
    """diffusers' First-Block-Cache head hook, deciding on the group's statistic (`relative_change`).

    forward_chain.py puts it in place of diffusers' own head hook.
    `mode`: "decide" (no graphs: decide and go on), "probe" (CachedForward's eager pass: a computed
    step raises ComputeInGraph) or "replay" (inside the graphed forward: compute, decided already).
    """

    def __init__(self, state_manager: Any, record: CacheRecord) -> None:
        super().__init__(state_manager, record.threshold)  # its own `threshold` unused: the request's is the record's
        self.record = record
        self.mode = "decide"
        self.probed: torch.Tensor | None = None  # the probe's head residual, kept for the next step

    @torch.compiler.disable
    def _should_compute_remaining_blocks(self, hidden_states_residual: torch.Tensor) -> bool:
        if self.mode == "replay":
            return True
        previous = self.state_manager.get_state().head_block_residual
        change = math.inf if previous is None else relative_change(hidden_states_residual, previous)
        computed = change > self.record.threshold
        context = self.state_manager.context.name
        logger.debug("Step cache, step %d (%s): change %.6f, %s", self.record.step_index, context, change, computed)
        self.record.add(context, computed, change)
        if computed and self.mode == "probe":
            self.probed = hidden_states_residual
            raise ComputeInGraph
        return computed


class BranchContext(ModelHook):
    """Gives a denoiser's call the cache context "cond", then "uncond", within a step, where the pipeline
    sets none; the innermost hook, so it sees only the calls that compute (CFG parallel answers the other)."""

    NAME = "vllm_omni.branch_context"

    def __init__(self, head: GroupFirstBlockHook) -> None:
        super().__init__()
        self.head = head

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        record = self.head.record
        record.calls += 1
        if pipeline_context(self.head.state_manager) is not None:  # the pipeline named it
            return self.fn_ref.original_forward(*args, **kwargs)
        name = BRANCHES[record.calls - 1] if record.calls <= len(BRANCHES) else f"call{record.calls}"
        with module.cache_context(name):
            return self.fn_ref.original_forward(*args, **kwargs)


def pipeline_context(manager: Any) -> CacheContext | None:
    """The cache context a state manager holds now; None where none is set."""
    return diffusers_compat.manager_state(manager)[1]


class CachedForward:
    """A denoiser's `forward_sharded` with the step cache and CUDA graphs (see the module doc).

    `eager` is the model's own function, `graphed` its CUDAGraphForward. The graphed forward stores
    its residuals under a scratch cache context; the tensors a capture (or an eager run) wrote there
    are kept per graph key, since a replay writes the same memory again without running any Python.
    """

    def __init__(self, eager: Callable[..., torch.Tensor], graphed: Any, head: GroupFirstBlockHook) -> None:
        self.eager, self.graphed, self.head = eager, graphed, head
        self.written: dict[Hashable, tuple] = {}  # graph key -> the tail residuals its replays write

    def __getattr__(self, name: str) -> Any:  # captures, graphs, disabled: the CUDAGraphForward's
        return getattr(self.graphed, name)

    def __call__(self, **kwargs: Any) -> torch.Tensor:
        manager = self.head.state_manager
        context = pipeline_context(manager)
        if context is None:
            raise RuntimeError("the step cache needs a cache context (BranchContext sets one)")
        self.head.mode = "probe"
        try:
            return self.eager(**kwargs)  # a skipped step ends here
        except ComputeInGraph:
            pass
        finally:
            self.head.mode = "decide"
        key = self.graphed.key(kwargs)
        manager.set_context(SCRATCH)  # one scratch state for every graph: what each wrote is kept per key
        scratch = manager.get_state()
        scratch.tail_block_residuals = None
        self.head.mode = "replay"
        try:
            output = self.graphed(**kwargs)
        finally:
            self.head.mode = "decide"
            manager.set_context(context)
        if scratch.tail_block_residuals is not None:  # Python ran: a capture, or an eager call
            self.written[key] = scratch.tail_block_residuals
        for stale in [k for k in self.written if k != key and k not in self.graphed.graphs]:
            del self.written[stale]  # evicted graphs
        state = manager.get_state()
        state.head_block_residual, self.head.probed = self.head.probed, None
        state.tail_block_residuals = tuple(None if t is None else t.clone() for t in self.written[key])
        return output


def step_cache_report(policy: str, threshold: float, records: list[dict[str, Any]]) -> dict[str, Any]:
    """The ranks' cache records (`CacheRecord.summary`) merged into what a response reports.

    Every rank of an SP group decides alike (and measures the same changes); under CFG parallel
    each group records its own branch. `median_change`: of the first block's relative changes
    the request measured (what a threshold is compared with), None before any was measured.
    """
    steps: dict[str, dict[int, bool]] = {}
    changes: list[float] = []
    for i, record in enumerate(records):
        for branch, decisions in record["decisions"].items():
            steps.setdefault(branch, {}).update(decisions)
        if record["changes"] not in [other["changes"] for other in records[:i]]:
            changes += record["changes"]  # once per group: an SP group's ranks measure the same
    computed = sum(c for decisions in steps.values() for c in decisions.values())
    return {
        "policy": policy,
        "threshold": threshold,
        "forwards_computed": computed,
        "forwards_skipped": sum(len(decisions) for decisions in steps.values()) - computed,
        "skipped_steps": {b: sorted(s for s, c in d.items() if not c) for b, d in sorted(steps.items())},
        "median_change": round(statistics.median(changes), 6) if changes else None,
    }


def step_cache_line(report: dict[str, Any]) -> str:
    """The step log's words for a cache report."""
    skipped = ", ".join(f"{branch} {steps}" for branch, steps in report["skipped_steps"].items() if steps)
    return (
        f"step cache {report['policy']} (threshold {report['threshold']:g}): {report['forwards_computed']} "
        f"forward(s) computed, {report['forwards_skipped']} skipped" + (f" (steps {skipped})" if skipped else "")
    )
