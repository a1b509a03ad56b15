"""CFG parallel: a step's conditional and unconditional forwards run at once on two rank groups.

With classifier-free guidance a pipeline calls the transformer twice per denoising step, first
with the prompt (cond), then with the negative prompt (uncond). Under `cfg_parallel_size=2`
the ranks form two groups (parallel_state.py: rank = cfg_rank * sp_size + sp_rank), each
running the whole pipeline, each possibly Ulysses-parallel inside. The runner hands group 1 the
prompts swapped, so at a step's first call group 0 computes cond and group 1 computes uncond,
at the same time; one all-gather over the CFG group (a rank and its counterpart with the same
SP rank) gives both ranks both predictions. Every rank then returns cond for the first call and
uncond for the second without computing it, so all ranks combine the same two predictions and
keep identical latents. The pipelines stay unchanged; with two experts the exchange
is shared, since a step calls one of them.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook
from diffusers.models.modeling_outputs import Transformer2DModelOutput

from vllm_omni.diffusion.distributed.comm import all_gather


class CFGParallel:
    """A rank's side of the exchange, shared by every denoiser of its pipeline (a step's calls go to one expert)."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        self.group = group
        self.active = False  # this request uses CFG: two calls per step
        self._calls = 0
        self._branches: list[torch.Tensor] = []

    def start_request(self, active: bool) -> None:
        self.active = active
        self.end_step()

    def end_step(self) -> None:
        self._calls = 0
        self._branches = []

    def run(self, forward: Any, *args: Any, **kwargs: Any) -> Any:
        """One denoiser call: computed at the step's first call and exchanged; the second is the peer's."""
        if not self.active:
            # Without CFG a step has one forward: both groups run it (nothing to split).
            return forward(*args, **kwargs)
        return_dict = kwargs.get("return_dict", True)
        if self._calls == 0:
            output = forward(*args, **kwargs)
            sample = output.sample if return_dict else output[0]
            self._branches = all_gather(sample, self.group)  # [cond (group 0), uncond (group 1)]
        elif self._calls > 1:
            raise RuntimeError("CFG parallel expects at most two transformer calls per denoising step")
        sample = self._branches[self._calls]
        self._calls += 1
        return Transformer2DModelOutput(sample=sample) if return_dict else (sample,)


class CFGParallelHook(ModelHook):
    """The exchange on a denoiser's `forward`, through diffusers' hook registry (forward_chain.py installs it)."""

    NAME = "vllm_omni.cfg_parallel"

    def __init__(self, exchange: CFGParallel) -> None:
        super().__init__()
        self.exchange = exchange

    def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        return self.exchange.run(self.fn_ref.original_forward, *args, **kwargs)


def swap_prompts(kwargs: dict[str, Any], default_negative: str) -> dict[str, Any]:
    """Group 1's pipeline arguments: its "prompt" is the negative prompt, so its first call is uncond."""
    swapped = dict(kwargs)
    negative = kwargs.get("negative_prompt")
    if negative is None:  # a batch's prompts are a list: one default per row
        prompt = kwargs["prompt"]
        negative = [default_negative] * len(prompt) if isinstance(prompt, list) else default_negative
    swapped["prompt"] = negative
    swapped["negative_prompt"] = kwargs["prompt"]
    return swapped
