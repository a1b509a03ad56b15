"""CFG in one pass: a step's conditional and unconditional calls run as one forward of both branches' rows.

With classifier-free guidance a diffusers pipeline calls its denoiser twice per step, cond then uncond, each
with one row per image. Two rows in one forward instead run every weight once per step (half the weight reads,
half the launches; under layerwise offload half the weight copies). The pipelines stay unchanged, so the hook
cannot see the second call's arguments at the first call: it predicts them. At a step's two calls it notes
which arguments the calls share (the latents, the timestep) and which are the branch's own (the negative
prompt's embeddings and mask, the same at every step). From the next step on, the first call runs the rows of
both branches (the family's `cfg_rows`: models/branch_rows.py), returns the cond rows and keeps the uncond rows
for the second call, which gets them only when its arguments are the predicted ones (the same objects, or equal
values): the result is the two forwards' either way, within what batching rows changes (GEMM shapes; attention
runs per row where the texts differ). The first step of a request runs two forwards; a prediction that misses
(a pipeline that changes the uncond call between steps) turns the request back to two forwards, with a warning.

Whether a request runs so is the engine's (`DiffusionRequest.cfg_one_pass`: on unless turned off, both branches'
rows fit the deploy's envelope, and neither CFG parallel nor the step cache splits the branches), so every rank
of the group decides the same. One `CFGBatch` serves every denoiser of a pipeline (a step calls one expert).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from diffusers.hooks import ModelHook
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from vllm_omni.diffusion.models.branch_rows import same_arguments, same_value
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

RowsOf = Callable[[dict[str, Any], dict[str, Any]], dict[str, Any] | None]


class CFGBatch:
    """A rank's state of CFG in one pass, per request: what the uncond call takes, and its waiting rows."""

    def __init__(self, rows_of: RowsOf) -> None:
        self.rows_of = rows_of  # the family's `cfg_rows`
        self.active = False
        self.one_pass_steps = 0  # steps of the current request that ran as one forward
        self._calls = 0
        self._cond: dict[str, Any] | None = None
        self._shared: set[str] | None = None  # names of the arguments both calls share; None: nothing learned
        self._own: dict[str, Any] = {}  # the uncond call's own arguments
        self._waiting: tuple[torch.nn.Module, dict[str, Any], Any] | None = None  # (module, predicted args, output)

    def start_request(self, active: bool) -> None:
        self.active, self.one_pass_steps, self._shared, self._own = active, 0, None, {}
        self.end_step()

    def end_step(self) -> None:
        self._calls, self._cond, self._waiting = 0, None, None

    def run(self, module: torch.nn.Module, forward: Callable[..., Any], args: tuple, kwargs: dict[str, Any]) -> Any:
        """One denoiser call of the current step."""
        if not self.active or args:  # positional arguments: not a pipeline this predicts
            return forward(*args, **kwargs)
        self._calls += 1
        if self._calls == 1:
            self._cond = kwargs
            if self._shared is not None and kwargs.keys() == self._shared | self._own.keys():
                uncond = {name: kwargs[name] if name in self._shared else self._own[name] for name in kwargs}
                both = self.rows_of(kwargs, uncond)
                if both is None:  # this request's calls do not stack (the family's `cfg_rows`)
                    self.active = False
                    return forward(**kwargs)
                rows = kwargs["hidden_states"].shape[0]
                cond_out, uncond_out = _split(forward(**both), rows, kwargs.get("return_dict", True))
                self._waiting = (module, uncond, uncond_out)
                return cond_out
            return forward(**kwargs)
        if self._calls == 2:
            waiting, self._waiting = self._waiting, None
            if waiting is not None:
                if waiting[0] is module and same_arguments(kwargs, waiting[1]):
                    self.one_pass_steps += 1
                    return waiting[2]
                # Computed for nothing, and would be again: two forwards for the rest of this request.
                logger.warning("CFG in one pass: the uncond call differs from its prediction; two forwards from here")
                self.active = False
                return forward(**kwargs)
            if self._cond is not None and self._cond.keys() == kwargs.keys():
                self._shared = {name for name in kwargs if same_value(self._cond[name], kwargs[name])}
                self._own = {name: value for name, value in kwargs.items() if name not in self._shared}
        return forward(**kwargs)  # a step's third call (a guider with more branches) runs as it comes


def _split(output: Any, rows: int, return_dict: bool) -> tuple[Any, Any]:
    sample = output.sample if return_dict else output[0]
    parts = (sample[:rows], sample[rows:])
    return tuple(Transformer2DModelOutput(sample=p) if return_dict else (p,) for p in parts)


class CFGBatchHook(ModelHook):
    """CFG in one pass on a denoiser's `forward`, through diffusers' hook registry (forward_chain.py installs it)."""

    NAME = "vllm_omni.cfg_batch"

    def __init__(self, batch: CFGBatch) -> None:
        super().__init__()
        self.batch = batch

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.batch.run(module, self.fn_ref.original_forward, args, kwargs)
