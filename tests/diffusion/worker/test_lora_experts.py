"""Wan2.2 A14B's adapters per expert: a pair of files (HIGH,LOW) merged by the worker's `LoraAdapters` gives each
expert diffusers' output with that expert's file loaded into it (`load_lora_weights(high)` into `transformer`,
`load_lora_weights(low, load_into_transformer_2=True)` into `transformer_2`, PEFT layers unmerged); one file still
goes to both experts; and the base model comes back bit for bit.

One forward of each expert of tiny/wan2.2-t2v, in this process (no workers): the whole request through `Omni` is
in tests/entrypoints/test_omni_lora.py, the checks of a malformed pair here too (the registry, no model loaded).
"""

from __future__ import annotations

import pytest
import torch

from tests.lora_files import make_adapter, pipeline_class
from vllm_omni.diffusion.config import OmniDiffusionConfig
from vllm_omni.diffusion.engine.adapters import LoraRegistry, check_lora_modules
from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.model_source import resolve_model_path
from vllm_omni.diffusion.models.registry import TINY_MODELS
from vllm_omni.diffusion.request import LoraRequest, RequestError
from vllm_omni.diffusion.worker.lora import LoraAdapters

MODEL = "tiny/wan2.2-t2v"
EXPERTS = ("transformer", "transformer_2")
SCALE = 0.7


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    """Two adapters of the tiny model's shape (the experts have the same layers): the high-noise and low-noise files."""
    folder = tmp_path_factory.mktemp("expert-loras")
    path = resolve_model_path(MODEL)
    return {name: str(make_adapter(path, folder / name, seed=seed)) for seed, name in ((21, "high"), (22, "low"))}


def expert_inputs(transformer: torch.nn.Module) -> dict:
    config = transformer.config
    generator = torch.Generator().manual_seed(4)
    # 2 latent frames of 4x6 latents: 2 x 2 x 3 = 12 tokens after the 1x2x2 patches.
    return dict(
        hidden_states=torch.randn(1, config.in_channels, 2, 4, 6, generator=generator),
        timestep=torch.tensor([700.0]),
        encoder_hidden_states=torch.randn(1, 7, config.text_dim, generator=generator),
        return_dict=False,
    )


@pytest.mark.slow  # two pipelines of the tiny model, and one forward of each expert per adapter
def test_each_expert_equals_diffusers_with_its_own_file_and_one_file_still_goes_to_both(files):
    path = resolve_model_path(MODEL)
    cls = pipeline_class(path)
    reference = cls.from_pretrained(path, dtype=torch.float32)
    # The pair as diffusers loads it: the high-noise file plain, the low-noise one into transformer_2.
    reference.load_lora_weights(files["high"], adapter_name="pair")
    reference.load_lora_weights(files["low"], adapter_name="pair", load_into_transformer_2=True)
    # One file into both experts (what a single path does, as today).
    reference.load_lora_weights(files["high"], adapter_name="one")
    reference.load_lora_weights(files["high"], adapter_name="one", load_into_transformer_2=True)

    family = TINY_MODELS[MODEL].family_pipeline()
    ours = {name: family.denoisers[name].from_pretrained(path, subfolder=name, dtype=torch.float32) for name in EXPERTS}
    pipe = cls.from_pretrained(path, dtype=torch.float32, **ours)
    adapters = LoraAdapters(pipe, ours, torch.device("cpu"), 1, 1)  # one kept: a switch drops the other
    inputs = expert_inputs(ours["transformer"])

    def forwards(module_of) -> dict[str, torch.Tensor]:
        with torch.no_grad():
            return {name: module_of(name)(**inputs)[0] for name in EXPERTS}

    expected = {}
    for adapter in ("pair", "one"):
        reference.set_adapters([adapter], [SCALE])
        expected[adapter] = forwards(lambda name: getattr(reference, name))
    base = forwards(ours.__getitem__)
    pair_request = LoraRequest("pair", files["high"], SCALE, 1, path_2=files["low"])
    adapters.activate(pair_request)
    pair = forwards(ours.__getitem__)
    adapters.activate(LoraRequest("one", files["high"], SCALE, 2))
    one = forwards(ours.__getitem__)
    assert [key[0] for key in adapters.kept] == ["one"]  # the LRU dropped the pair, both experts' factors
    adapters.activate(pair_request)  # read again from its two files
    again = forwards(ours.__getitem__)
    adapters.activate(None)
    restored = forwards(ours.__getitem__)

    for name in EXPERTS:
        for adapter, merged in (("pair", pair), ("one", one)):
            change = (expected[adapter][name] - base[name]).abs().max()
            assert change > 100 * (merged[name] - expected[adapter][name]).abs().max(), (adapter, name)
            torch.testing.assert_close(merged[name], expected[adapter][name], rtol=0, atol=1e-5)
        assert torch.equal(restored[name], base[name])  # the base model is back bit for bit
        assert torch.equal(again[name], pair[name])
    # The files differ, so each expert read its own: the low-noise expert is not the high-noise file's.
    assert (pair["transformer_2"] - one["transformer_2"]).abs().max() > 1e-3
    torch.testing.assert_close(pair["transformer"], one["transformer"], rtol=0, atol=0)


def test_a_pair_is_checked_file_by_file_naming_lora_path_and_the_expert(files, tmp_path):
    path = resolve_model_path(MODEL)
    registry = LoraRegistry("WanPipeline", path, list(EXPERTS), 128, {"pair": f"{files['high']},{files['low']}"})
    lora = registry.resolve({"name": "pair", "scale": 0.5})
    assert (lora.path, lora.path_2, lora.paths) == (files["high"], files["low"], (files["high"], files["low"]))
    assert registry.served()["pair"] == f"{files['high']},{files['low']}"
    registry.load("listed", [files["low"], files["high"]])  # the list form (/v1/load_lora_adapter's, YAML's)
    assert registry.resolve("listed").path_2 == files["high"]
    assert registry.resolve({"name": "pair", "path": [files["high"], files["low"]]}) == registry.resolve("pair")
    missing = tmp_path / "low.safetensors"
    cases = [
        (f"{files['high']},{files['low']},{files['high']}", "3 paths in"),
        ([files["high"], files["low"], files["low"]], "3 paths in"),
        (f"{files['high']},", "an empty path"),
        (
            f"{files['high']},{missing}",
            f"adapter 'x' (its low-noise file, for transformer_2): {missing} does not exist",
        ),
        (f"{missing},{files['low']}", "adapter 'x' (its high-noise file, for transformer): "),
    ]
    for given, words in cases:
        with pytest.raises(RequestError) as refused:
            registry.load("x", given)
        assert refused.value.param == "lora_path" and words in str(refused.value), (given, str(refused.value))
    # A model of one denoiser takes one file.
    qwen = LoraRegistry("QwenImagePipeline", resolve_model_path("tiny/qwen-image"), ["transformer"], 128)
    with pytest.raises(RequestError, match="one per expert of a two-expert model") as refused:
        qwen.load("x", f"{files['high']},{files['low']}")
    assert refused.value.param == "lora_path" and "transformer only: give one file" in str(refused.value)


def test_the_flag_the_yaml_and_omni_forms_of_a_pair_and_their_refusals_name_the_field(files, tmp_path):
    pair = f"{files['high']},{files['low']}"
    for given in (
        (f"p={pair}",),
        {"p": [files["high"], files["low"]]},
        {"p": pair},
        {"p": (files["high"], files["low"])},
    ):
        assert EngineArgs.from_kwargs(MODEL, lora_modules=given).engine_config().lora_modules == {"p": pair}
    EngineArgs.check_value("lora_modules", {"p": [files["high"], files["low"]]})  # the deploy YAML's check
    for given in (("p=a,b,c",), {"p": ["a", "b", "c"]}, {"p": ["a", ""]}, {"p": [1, 2]}):
        with pytest.raises(ValueError, match=r"^lora_modules p(=a,b,c)?: (3 paths in|an empty path|expected a path)"):
            OmniDiffusionConfig(model=MODEL, lora_modules=given)
    check_lora_modules({"p": pair})  # the command line's check before the start
    with pytest.raises(ValueError, match=r"--lora-modules p=.*its low-noise file, for transformer_2.*does not exist"):
        check_lora_modules({"p": f"{files['high']},{tmp_path / 'nope.safetensors'}"})
