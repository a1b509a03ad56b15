"""The family contract: what a model family declares to the generic runner (worker/runner.py).

Two halves: `FamilyPipeline`, the abstract base of a family's pipeline adapter (its `pipeline.py`
defines `FAMILY`, an instance of a subclass), and `SequenceParallelTransformer`, the mixin every
family transformer (`models/<family>/transformer.py`) inherits, declaring `forward_sharded`.
The runner reads nothing else of a family:

- `denoisers`: every denoiser its pipelines can have, by pipeline component name, with the SP
  class that replaces diffusers' own (`transformer`; a two-expert model adds `transformer_2`, its
  low-noise expert). The runner loads each one a checkpoint has, and compile, CUDA graphs, CFG
  parallel and the Ulysses-divides-heads check apply to every one of them. A pipeline component
  that is a denoiser (see `is_denoiser`) but is not declared makes the load fail: it would run
  unsharded, on every rank, silently slow.
- `call_kwargs(pipe, request, spec)`: a validated request -> the pipeline's `__call__` keyword
  arguments (the runner adds the generator, the output type and the per-step hook). A family
  that must also set per-request state on the pipeline (a guider) does it here.
- `pipeline_for(pipe, request)`: the pipeline that runs `request`: the loaded one, or one built on its
  components (an img2img pipeline for a request with a source image).
- `prepare_pipeline(pipe)`: once, after the runner loads the pipeline with the family's denoisers
  (a family's own attention processors replaced by ours, which take the same arguments).
- `uses_cfg(request)`: whether the request runs two forwards per step (cond, uncond), which CFG
  parallel splits between two rank groups; `default_negative_prompt` is what the pipeline uses
  when such a request gives none (the uncond group's prompt).
- `audio(pipe, result)`: the sound a video pipeline's result carries (`request.Audio`: a waveform per video at
  its sample rate), which the runner hands on with the frames; None (the default): the videos are silent.
- `cfg_rows(cond, uncond)`: the keyword arguments of a CFG step's two denoiser calls as one call's, the cond
  rows first (models/branch_rows.py has the helpers), for CFG in one pass (worker/cfg_batch.py); None (the
  default): the family's steps run two forwards.
- Text encoded once: `encode_text(pipe, kwargs, device, progress=None)` runs the pipeline's own
  `encode_prompt` on the call kwargs, on the runner's `device` (or an autoregressive stage, which samples the prior
  token ids) and returns the tensors, keyed by the `__call__` arguments that take them ({}: this
  request must be encoded by the pipeline itself, on every rank); `with_text(kwargs, embeds)` is
  the call with them in place of the prompts, which a pipeline loaded without its
  `text_encoders` components runs to the same output. `progress(done, total)`, where a family
  reports it (an autoregressive stage: after every generated token, of the total the AR generates), may raise to
  stop the stage.
"""

from __future__ import annotations

import abc
import inspect
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, ClassVar

from vllm_omni.diffusion import diffusers_compat

if TYPE_CHECKING:
    import torch

    from vllm_omni.diffusion.models.spec import PipelineSpec
    from vllm_omni.diffusion.request import Audio, DiffusionRequest


class FamilyPipeline(abc.ABC):
    """Base of every family's `FAMILY`; subclasses set `denoisers` and implement `pipeline_kwargs`."""

    denoisers: ClassVar[Mapping[str, type[torch.nn.Module]]] = {}
    default_negative_prompt: ClassVar[str] = ""
    # Pipeline components that only prompt encoding uses (text encoders, and their tokenizers where the
    # pipeline uses those for nothing else): a rank that gets its embeddings from `encode_text` loads
    # the pipeline without them. Empty: every rank encodes.
    text_encoders: ClassVar[tuple[str, ...]] = ()
    # True: `encode_text` runs for every request, on one process too, so its long stage reports
    # progress and can be cancelled (an autoregressive prior); else only when SP peers wait for its output.
    encodes_first: ClassVar[bool] = False

    @abc.abstractmethod
    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """The pipeline `__call__`'s per-request keyword arguments (None fields: the pipeline's defaults)."""

    def call_kwargs(self, pipe: Any, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """The pipeline call's keyword arguments (a family with per-request pipeline state overrides it)."""
        return self.pipeline_kwargs(request, spec)

    def pipeline_for(self, pipe: Any, request: DiffusionRequest) -> Any:
        """The pipeline that runs `request`: `pipe` itself, or another built on its components (same modules)."""
        return pipe

    def prepare_pipeline(self, pipe: Any) -> None:
        """Called once on the loaded pipeline, before any wrapper is installed; most families need nothing."""
        return None

    def uses_cfg(self, request: DiffusionRequest) -> bool:
        """True when the pipeline runs a conditional and an unconditional forward per step for `request`."""
        return False

    def cfg_rows(self, cond: dict[str, Any], uncond: dict[str, Any]) -> dict[str, Any] | None:
        """A CFG step's cond and uncond denoiser arguments as one forward's rows (cond first); None: two forwards."""
        return None

    @property
    def joins_cfg_rows(self) -> bool:
        """Whether the family may run a CFG step as one forward at all (it defines `cfg_rows`): the memory plan
        then keeps room for both rows where the weights stream every forward."""
        return type(self).cfg_rows is not FamilyPipeline.cfg_rows

    def audio(self, pipe: Any, result: Any) -> Audio | None:
        """The sound of the videos in `result` (what `pipe(...)` returned with output_type="pt"), one waveform per
        video in the order of its frames; None: silent videos."""
        return None

    def encode_text(
        self,
        pipe: Any,
        kwargs: dict[str, Any],
        device: torch.device,
        progress: Callable[[int, int], None] | None = None,
    ) -> dict[str, torch.Tensor]:
        """The prompt embeddings `pipe(**kwargs)` computes, by its own `encode_prompt`, keyed by the
        `__call__` arguments that take them; the negative ones only where the pipeline encodes them.
        {}: no embeddings for this call (the pipeline must encode the prompts itself).

        `progress(done, total)`: called, where a family has a long stage here (an autoregressive
        autoregressive one), as it advances (tokens generated, of the total); an exception it
        raises stops the stage and propagates. Other families ignore it."""
        return {}

    def with_text(self, kwargs: dict[str, Any], embeds: dict[str, torch.Tensor]) -> dict[str, Any]:
        """`kwargs` with `embeds` (from `encode_text`) in place of the prompts, which the pipelines
        refuse alongside their embeddings; unchanged when `embeds` is empty."""
        if not embeds:
            return kwargs
        prompts = {name: None for name in ("prompt", "negative_prompt") if name in kwargs}
        return {**kwargs, **prompts, **embeds}


class SequenceParallelTransformer:
    """Mixin of every family transformer (before diffusers' class): the `forward_sharded` contract.

    A family transformer keeps diffusers' `forward` (same arguments, same output) and splits it in two:
    `forward` does the host-side preparation (text-mask compaction, rotary tables from evicting caches,
    per-row plans), then calls `run_sharded(**kwargs)` inside the SP context; `forward_sharded` is the
    per-step work on this rank's shards. Its contract:

    - keyword arguments only; every tensor it reads is an argument or built inside it (a CUDA graph
      replays it with the tensor arguments copied in: no cache it could outlive, no host sync);
    - its inputs arrive whole (every rank the same full sequence): it shards the token streams itself
      with `shard_with_auto_pad` (distributed/sequence_parallel.py), and the SP layout is the
      context's, not an argument;
    - it returns one tensor, the denoiser's output sample for the whole sequence (gathered with
      `gather_sequence`), the same on every rank of the SP group.

    `run_sharded` is the one call site: it runs `forward_sharded` through `sharded_wrapper`, the wrapper
    the forward chain installs (worker/forward_chain.py: step-cache probe, CUDA graph replay), or
    directly where none is installed.
    """

    # Set once by worker/forward_chain.py; called with forward_sharded's keyword arguments.
    sharded_wrapper: Callable[..., torch.Tensor] | None = None

    def forward_sharded(self, **kwargs: Any) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} does not implement forward_sharded")

    def run_sharded(self, **kwargs: Any) -> torch.Tensor:
        """`forward_sharded(**kwargs)`, through the forward chain's wrapper where one is installed."""
        wrapper = self.sharded_wrapper
        return self.forward_sharded(**kwargs) if wrapper is None else wrapper(**kwargs)

    def forward_reference(self, unsupported: str, **kwargs: Any) -> Any:
        """Diffusers' own forward (the class after this mixin), for inputs that `forward_sharded` does not take
        (`unsupported` names them): they run at one rank only, and are refused under SP."""
        from vllm_omni.diffusion.distributed.sequence_parallel import sequence_parallel_context

        with sequence_parallel_context() as ctx:
            if ctx.enabled:
                raise NotImplementedError(
                    f"{unsupported} is not supported under sequence parallelism (degree {ctx.world_size}); "
                    "it runs with sequence parallelism off"
                )
        return super().forward(**kwargs)  # type: ignore[misc]

    def check_sequence_parallel_processors(self, blocks: Mapping[str, str], processors: tuple[type, ...]) -> None:
        """Under SP, every attention (`blocks`: block list -> attention attribute) must run one of `processors`:
        another attends only to this rank's tokens."""
        for name, attention in blocks.items():
            for index, block in enumerate(getattr(self, name)):
                processor = getattr(block, attention).processor
                if not isinstance(processor, processors):
                    raise RuntimeError(
                        f"{name}.{index}.{attention} has processor {type(processor).__name__}, which attends only to "
                        f"this rank's tokens; under sequence parallelism use "
                        f"{' / '.join(p.__name__ for p in processors)} (or a subclass)"
                    )


def declare_cache_block(block_class: type, hidden_states_index: int, encoder_hidden_states_index: int | None) -> None:
    """Tell diffusers' cache hooks (the step cache, worker/step_cache.py) which of a block's outputs are its
    hidden states and its encoder hidden states, for a block diffusers registers none for."""
    diffusers_compat.register_block_outputs(block_class, hidden_states_index, encoder_hidden_states_index)


def attention_heads(config: Mapping[str, Any]) -> int | None:
    """A denoiser config's attention head count: diffusers' `num_attention_heads` (or `n_heads`); None
    where it has neither."""
    for key in ("num_attention_heads", "n_heads"):
        if key in config:
            return config[key]
    return None


def call_arg(pipe: Any, kwargs: Mapping[str, Any], name: str) -> Any:
    """The value `pipe(**kwargs)` runs with for argument `name`: the given one, else its `__call__` default."""
    if name in kwargs:
        return kwargs[name]
    return inspect.signature(pipe.__call__).parameters[name].default


def is_denoiser(component: Any) -> bool:
    """A pipeline component that runs at every denoising step: a diffusers transformer or UNet model."""
    from diffusers import ModelMixin

    name = type(component).__name__
    return isinstance(component, ModelMixin) and ("Transformer" in name or "UNet" in name)


def undeclared_denoisers(pipe: Any, declared: Mapping[str, Any]) -> list[str]:
    """The pipeline's denoiser components that are not the family's declared SP classes."""
    return [
        name
        for name, component in pipe.components.items()
        if component is not None and is_denoiser(component) and declared.get(name) is not component
    ]
