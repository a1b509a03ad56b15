"""The family contract (models/family.py) as the runner applies it, on every tiny model.

Every denoiser a pipeline has is a declared SP class, loaded and wrapped by the runner: counted,
and (with graphs on) replayed through CUDAGraphForward. A family that leaves one undeclared
fails at load, naming it, instead of running it unsharded.
"""

from __future__ import annotations

import pytest
import torch
from diffusers.hooks import HookRegistry

from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.models.family import FamilyPipeline, SequenceParallelTransformer, is_denoiser
from vllm_omni.diffusion.models.registry import TINY_MODELS
from vllm_omni.diffusion.models.wan22.pipeline import Wan22Family
from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward
from vllm_omni.diffusion.worker.forward_chain import CountForwards
from vllm_omni.diffusion.worker.runner import PipelineRunner
from vllm_omni.testing.graphs import TEST_GRAPHS_ENV
from vllm_omni.testing.hooks import rank_hooks


def _runner(name: str) -> PipelineRunner:
    path = resolve_model_path(name)
    spec = read_pipeline_spec(path)
    return PipelineRunner(path, spec, torch.device("cpu"), torch.float32, rank=1, hooks=rank_hooks(1))  # as a worker


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_every_denoiser_is_declared_loaded_and_wrapped(name, monkeypatch):
    monkeypatch.setenv(TEST_GRAPHS_ENV, "simulate")  # graphs on, as on GPUs
    runner = _runner(name)
    assert isinstance(runner.family, FamilyPipeline)
    denoisers = {n: c for n, c in runner.pipe.components.items() if c is not None and is_denoiser(c)}
    assert denoisers and denoisers.keys() == runner.denoisers.keys()
    for component, model in denoisers.items():
        assert model is runner.denoisers[component]
        assert type(model) is runner.family.denoisers[component]
        # The SP transformer contract (models/family.py): forward_sharded declared by the mixin, implemented here.
        assert isinstance(model, SequenceParallelTransformer)
        assert type(model).forward_sharded is not SequenceParallelTransformer.forward_sharded
        assert isinstance(model.sharded_wrapper, CUDAGraphForward)
        assert HookRegistry.check_if_exists_or_initialize(model).get_hook(CountForwards.NAME) is not None
    # diffusers names the head count num_attention_heads; Z-Image names it n_heads.
    heads = {n: m.config.get("num_attention_heads", m.config.get("n_heads")) for n, m in denoisers.items()}
    assert runner.attention_heads == heads and all(isinstance(h, int) for h in heads.values())
    if name in ("tiny/wan2.2-t2v", "tiny/wan2.2-i2v"):
        assert set(denoisers) == {"transformer", "transformer_2"}  # both experts of A14B


def test_an_undeclared_denoiser_fails_the_load(monkeypatch):
    monkeypatch.setattr(Wan22Family, "denoisers", {"transformer": Wan22Family.denoisers["transformer"]})
    with pytest.raises(ValueError, match=r"\['transformer_2'\].*unsharded"):
        _runner("tiny/wan2.2-t2v")
