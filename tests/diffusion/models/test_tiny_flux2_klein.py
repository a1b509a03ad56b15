"""FLUX.2 klein end to end on CPU: the tiny models with the real `Flux2KleinPipeline` / `Flux2KleinKVPipeline`.

Our SP transformer swapped in must give diffusers' images (text-to-image, references, klein base's CFG),
the KV pipeline with our processors must give diffusers' KV pipeline's images, its cached steps must equal
recomputing the references, and under SP the KV pipeline must give the single process's images.
"""

from __future__ import annotations

import dataclasses
import pathlib

import numpy as np
import pytest
import torch
from diffusers import Flux2KleinKVPipeline, Flux2KleinPipeline
from PIL import Image

from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state, use_parallel_state
from vllm_omni.diffusion.models.flux2 import pipeline as flux2_pipeline
from vllm_omni.diffusion.models.flux2.tiny import tiny_model_path
from vllm_omni.diffusion.models.registry import TINY_MODELS
from vllm_omni.diffusion.request import DiffusionRequest

# 13 x 11 = 143 image tokens; references 5 x 5 + 4 x 6 = 49 tokens; 512 text tokens: 2 and 3 ranks pad them.
HEIGHT, WIDTH = 208, 176
CLASSES = {"tiny/flux2-klein": Flux2KleinPipeline, "tiny/flux2-klein-kv": Flux2KleinKVPipeline}
FAMILY = flux2_pipeline.FAMILY


def _image(width: int, height: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


REFERENCES = [_image(80, 80, seed=0), _image(96, 64, seed=1)]


def _load(name: str, ours: bool, **config) -> Flux2KleinPipeline | Flux2KleinKVPipeline:
    folder = tiny_model_path(name)
    components = {}
    if ours:
        components["transformer"] = FAMILY.denoisers["transformer"].from_pretrained(folder, subfolder="transformer")
    pipe = CLASSES[name].from_pretrained(folder, **components, **config)
    if ours:
        FAMILY.prepare_pipeline(pipe)  # as the runner does once it has loaded the pipeline
    pipe.set_progress_bar_config(disable=True)
    return pipe


@pytest.fixture(scope="module")
def pipes() -> dict:
    return {(name, ours): _load(name, ours) for name in CLASSES for ours in (False, True)}


def _request(**fields) -> DiffusionRequest:
    values = dict(request_id="r", prompt="a red fox in the snow", height=HEIGHT, width=WIDTH, num_inference_steps=3)
    return DiffusionRequest(**{**values, **fields})


def _run(pipe, request: DiffusionRequest, name: str) -> np.ndarray:
    kwargs = FAMILY.call_kwargs(pipe, request, TINY_MODELS[name] if name != "tiny/flux2-klein" else _DISTILLED)
    with torch.inference_mode():
        out = pipe(**kwargs, generator=torch.Generator("cpu").manual_seed(request.seed), output_type="np")
    return out.images


def _distilled_spec():
    from vllm_omni.diffusion.models.registry import spec_for

    return spec_for("Flux2KleinPipeline", {"is_distilled": True})


_DISTILLED = _distilled_spec()


@pytest.mark.parametrize("name", sorted(CLASSES))
@pytest.mark.parametrize("references", [0, 2], ids=["t2i", "references"])
def test_our_transformer_gives_the_reference_images(pipes, name, references):
    request = _request(num_images=2, images=REFERENCES[:references] or None)
    expected = _run(pipes[name, False], request, name)
    actual = _run(pipes[name, True], request, name)
    assert actual.shape == (2, HEIGHT, WIDTH, 3)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)
    assert not np.array_equal(actual[0], actual[1])  # two images per prompt, two latents
    if references:
        without = _run(pipes[name, True], _request(num_images=2), name)
        assert np.abs(actual - without).max() > 1e-3  # the references are used


def test_klein_base_runs_cfg_and_matches_the_reference():
    """klein base (no `is_distilled`): CFG against the empty prompt, two forwards a step, as diffusers does."""
    from vllm_omni.diffusion.models.registry import spec_for

    spec = spec_for("Flux2KleinPipeline", {})
    assert spec.takes("guidance_scale") and not spec.cfg_parallel and spec.default_steps == 50
    reference, ours = (_load("tiny/flux2-klein", o, is_distilled=False) for o in (False, True))
    request = _request(guidance_scale=2.5, images=REFERENCES[:1])
    kwargs = FAMILY.pipeline_kwargs(request, spec)
    outs = []
    for pipe in (reference, ours):
        with torch.inference_mode():
            outs.append(pipe(**kwargs, generator=torch.Generator().manual_seed(0), output_type="np").images)
    np.testing.assert_allclose(outs[1], outs[0], rtol=0, atol=1e-5)
    assert FAMILY.runs_cfg(ours, kwargs) and not FAMILY.runs_cfg(ours, {**kwargs, "guidance_scale": 1.0})
    with torch.inference_mode():
        embeds = FAMILY.encode_text(ours, kwargs, ours.device)
    assert set(embeds) == {"prompt_embeds", "negative_prompt_embeds"}


def test_kv_cached_steps_equal_recomputing_the_references(pipes):
    """Every cached step's prediction equals the first-step forward ([references, image], K/V recomputed)
    at that step's inputs: the KV mode changes the cost, not the result (diffusers' definition of it)."""
    pipe = pipes["tiny/flux2-klein-kv", True]
    transformer, checked, first = pipe.transformer, [], {}

    def recompute(module, args, kwargs, output):
        if kwargs.get("kv_cache_mode") == "extract":
            first.update(kwargs)  # the references' latents and ids
        elif kwargs.get("kv_cache_mode") == "cached":
            refs = first["num_ref_tokens"]
            full = dict(kwargs, kv_cache=None, kv_cache_mode="extract", num_ref_tokens=refs)
            full["hidden_states"] = torch.cat([first["hidden_states"][:, :refs], kwargs["hidden_states"]], dim=1)
            full["img_ids"] = torch.cat([first["img_ids"][:, :refs], kwargs["img_ids"]], dim=1)
            with torch.no_grad():
                torch.testing.assert_close(output[0], module.forward(**full)[0], rtol=0, atol=1e-5)
            checked.append(True)

    handle = transformer.register_forward_hook(recompute, with_kwargs=True)
    try:
        _run(pipe, _request(images=REFERENCES), "tiny/flux2-klein-kv")
    finally:
        handle.remove()
    assert len(checked) == 2  # steps 2 and 3 of 3


def test_pipeline_kwargs_map_the_request(pipes):
    kv_spec = TINY_MODELS["tiny/flux2-klein-kv"]
    assert not kv_spec.takes("guidance_scale") and kv_spec.default_steps == 4 and _DISTILLED.default_steps == 4
    kwargs = FAMILY.pipeline_kwargs(_request(images=REFERENCES), kv_spec)
    assert kwargs["image"] == REFERENCES and "guidance_scale" not in kwargs
    # Step-distilled klein ignores guidance: 1.0 keeps its 4.0 default from warning at every call.
    assert not _DISTILLED.takes("guidance_scale")
    assert FAMILY.call_kwargs(pipes["tiny/flux2-klein", True], _request(), _DISTILLED)["guidance_scale"] == 1.0
    with pytest.raises(ValueError, match="at most 10 reference images"):
        FAMILY.pipeline_kwargs(_request(images=REFERENCES * 6), kv_spec)


def test_our_processors_replace_the_kv_pipelines_own(pipes):
    processors = pipes["tiny/flux2-klein-kv", True].transformer.attn_processors.values()
    assert all(type(p).__module__ == "vllm_omni.diffusion.models.flux2.transformer" for p in processors)


# ---- under SP (gloo workers) ----------------------------------------------------------------

_worker_pipes: dict = {}


def sp_generate(name: str, mode: str, request: DiffusionRequest) -> np.ndarray:
    """Worker side: the KV pipeline with our transformer, under the worker's SP group in `mode`."""
    if name not in _worker_pipes:
        _worker_pipes[name] = _load(name, ours=True)
    state = get_parallel_state()
    flags = {"mask": dict(mask_sp_padding=True), "trim": {}}[mode]
    config = state.config.replace(**{"mask_sp_padding": False, "trim_sp_padding": True, **flags})
    with use_parallel_state(dataclasses.replace(state, config=config)):
        return _run(_worker_pipes[name], request, name)


@pytest.mark.parametrize("mode", ["trim", "mask"])
def test_kv_pipeline_under_sp_matches_single_process(sp_pool, pipes, mode):
    name = "tiny/flux2-klein-kv"
    request = _request(images=REFERENCES)
    expected = _run(pipes[name, True], request, name)
    for images in sp_pool.run(sp_generate, name, mode, request):
        np.testing.assert_allclose(images, expected, rtol=0, atol=1e-5)


def test_tiny_folders_are_klein(pipes):
    for name in CLASSES:
        folder = pathlib.Path(tiny_model_path(name))
        assert (folder / "text_encoder" / "config.json").read_text().count("Qwen3ForCausalLM") == 1
    pipe = pipes["tiny/flux2-klein", True]
    assert pipe.config.is_distilled and not pipe.transformer.config.guidance_embeds
    embeds, _ = pipe.encode_prompt("a red fox", device=torch.device("cpu"))
    assert embeds.shape == (1, 512, pipe.transformer.config.joint_attention_dim)
