"""What one request leaves on the runner's shared objects, put aside while another request runs inside it.

Interleaving nests requests: the worker runs a request that arrived while another was running to its end
inside the running one's step callback (worker.RankServer), then the outer one goes on from its next
step. A diffusers pipeline keeps its loop's state in the locals of its own `__call__` frame (latents,
prompt embeddings, generators, the step counter, a reference stream's keys, a condition image's
cache), and that frame just waits on the stack. What a pipeline call leaves on shared objects is saved
by `put_aside` and brought back by `RequestState.restore`: the pipeline's attributes (guidance scale,
current timestep, ...), the state of its scheduler and guider (timesteps, step index, a multistep
solver's history), the step cache's per-context states in diffusers' hooks, and plain per-request
objects (the CFG exchange, the step cache's record). The runner adds its own fields and merges the outer
request's adapter again (runner.PipelineRunner.suspended).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import torch
from diffusers.guiders.guider_utils import BaseGuidance
from diffusers.hooks import HookRegistry
from diffusers.schedulers.scheduling_utils import SchedulerMixin

from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.worker.forward_chain import StepReportingScheduler


@dataclass
class RequestState:
    """One suspended request's share of the shared objects (restore it once, after the inner request ended)."""

    pipe: Any
    pipeline: dict[str, Any]  # its attributes
    components: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)  # objects, their deep-copied state
    objects: list[tuple[Any, dict[str, Any]]] = field(default_factory=list)  # objects, their attributes
    hook_states: list[tuple[Any, dict, Any]] = field(default_factory=list)  # diffusers StateManagers' caches

    def restore(self) -> None:
        for target, state in ((self.pipe, self.pipeline), *self.components, *self.objects):
            vars(target).clear()
            vars(target).update(state)
        for manager, cache, context in self.hook_states:
            diffusers_compat.set_manager_state(manager, cache, context)


def _stateful_components(pipe: Any) -> list[Any]:
    """The pipeline's components that keep per-call state: schedulers and guiders (a step-reporting wrapper's too)."""
    found = []
    for value in pipe.components.values():
        if isinstance(value, StepReportingScheduler):
            found.append(value.scheduler)
        if isinstance(value, (SchedulerMixin, BaseGuidance)):
            found.append(value)
    return found


def _hook_managers(modules: list[torch.nn.Module]) -> list[Any]:
    """The state managers of the stateful diffusers hooks on `modules` and their submodules (the step cache's)."""
    managers: dict[int, Any] = {}
    for root in modules:
        for module in root.modules():
            registry = diffusers_compat.hook_registry(module)
            if not isinstance(registry, HookRegistry):
                continue
            for hook in registry.hooks.values():
                manager = getattr(hook, "state_manager", None)
                if diffusers_compat.is_stateful(hook) and manager is not None:
                    managers[id(manager)] = manager
    return list(managers.values())


def put_aside(pipe: Any, denoisers: list[torch.nn.Module], objects: list[Any]) -> RequestState:
    """Save what the running request left on `pipe`, its components, the hooks of `denoisers` and on `objects`
    (plain per-request objects, by their attributes); the hooks' states are detached, so the next request starts
    with empty ones and cannot reset these in place."""
    state = RequestState(pipe, dict(vars(pipe)))
    for component in _stateful_components(pipe):
        state.components.append((component, copy.deepcopy(vars(component))))
    for target in objects:
        if isinstance(target, StepReportingScheduler):
            state.objects.append((target, dict(vars(target))))  # its counter and callback; the scheduler is above
        elif target is not None:
            state.objects.append((target, copy.copy(vars(target))))
    for manager in _hook_managers(denoisers):
        state.hook_states.append((manager, *diffusers_compat.manager_state(manager)))
        diffusers_compat.set_manager_state(manager, {}, None)
    return state
