"""LoRA adapters through `Omni` (real worker processes): images equal diffusers' with the same adapter, switching
is exact, SP and CFG parallel equal one process, and the ranks agree on the adapter before the first step; Wan2.2
A14B with a file per expert equals diffusers with each file loaded into its expert.

The adapters are random PEFT adapters made by the tests (tests/lora_files.py). diffusers' reference applies them
unmerged (`load_lora_weights` + `set_adapters`), the engine merges them into the weights (worker/lora.py): equal
within float32 rounding, far below the adapter's own effect.
"""

from __future__ import annotations

import json
import os

import numpy as np
import pytest
import torch

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from tests.lora_files import ATTENTION, kohya_twin, make_adapter, pipeline_class  # noqa: E402
from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.config import EngineLimits  # noqa: E402
from vllm_omni.diffusion.engine.adapters import LoraRegistry  # noqa: E402
from vllm_omni.diffusion.engine.preprocess import RequestPreprocessor  # noqa: E402
from vllm_omni.diffusion.images import decode_image  # noqa: E402
from vllm_omni.diffusion.model_source import resolve_model_path  # noqa: E402
from vllm_omni.diffusion.models.registry import TINY_MODELS  # noqa: E402
from vllm_omni.diffusion.request import GenerationParams, RequestError  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

ATOL = 2e-4  # merged against unmerged float32: ~1e-6; the adapters change pixels by 1e-2 and more
QWEN = "tiny/qwen-image"
HEIGHT, WIDTH = 208, 272  # 13 x 17 = 221 image tokens: padded at Ulysses 2 and 3
SMALL = dict(height=64, width=64, num_inference_steps=2, seed=3, output_type="np")
PADDED = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=5, output_type="np")
# Families with a diffusers LoRA loader besides Qwen-Image, one request each (the Wan2.2 model has both experts).
# Qwen-Image-Edit and Edit-Plus: an edit forward in tests/diffusion/worker/test_lora_edit.py (a whole request: ~30 s).
FAMILIES = {
    "tiny/flux2": dict(height=64, width=64),
    "tiny/wan2.2-t2v": dict(height=64, width=64, num_frames=5),
    "tiny/z-image": dict(height=64, width=64),
}


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    """Three Qwen-Image adapters (A, B, C) and A's kohya-format twin."""
    folder = tmp_path_factory.mktemp("loras")
    path = resolve_model_path(QWEN)
    files = {name: make_adapter(path, folder / name, seed=seed) for seed, name in enumerate("abc")}
    files["a-kohya"] = kohya_twin(path, folder / "a-kohya.safetensors", seed=0)
    return {name: str(file) for name, file in files.items()}


def diffusers_image(
    model: str,
    lora: str | tuple[str, str] | None,
    scale: float,
    prompt: str = "a cat",
    only: str | None = None,
    **fields,
) -> np.ndarray:
    """The image diffusers' own pipeline (its reference transformer) gives, with `lora` applied unmerged to every
    denoiser (`only`: to that one); a pair (HIGH, LOW): each file to its expert, in the order of the denoisers."""
    spec = TINY_MODELS[model]
    path = resolve_model_path(model)
    family = spec.family_pipeline()
    pipe = pipeline_class(path).from_pretrained(path, dtype=torch.float32)
    if lora is not None:
        for index, name in enumerate(family.denoisers):
            if (path / name).is_dir() and only in (None, name):
                extra = {"load_into_transformer_2": True} if name == "transformer_2" else {}
                pipe.load_lora_weights(lora if isinstance(lora, str) else lora[index], adapter_name="x", **extra)
        pipe.set_adapters(["x"], [scale])
    fields.pop("output_type", None)
    # The engine's own checks and defaults (true CFG off without a negative prompt, Wan's frame rule).
    request = RequestPreprocessor(spec, EngineLimits(), path)(GenerationParams(prompt, **fields), "ref", 0)
    if request.images:
        request.images = [decode_image(image, "image") for image in request.images]
    seed = request.seed
    kwargs = family.call_kwargs(pipe, request, spec)
    with torch.inference_mode():
        result = family.pipeline_for(pipe, request)(
            **kwargs, generator=torch.Generator("cpu").manual_seed(seed), output_type="np"
        )
    frames = result.frames if spec.modality == "video" else result.images
    return np.asarray(frames, dtype=np.float32)[0]


@pytest.fixture(scope="module")
def one_process(adapters):
    """One process, simulated CUDA graphs (their captures are counted), one adapter's factors on the "device" and
    two on the CPU: A, B and C in turn evict each other."""
    previous = os.environ.get("VLLM_OMNI_TEST_CUDA_GRAPHS")
    os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"] = "simulate"  # inherited by the worker when it spawns
    modules = {name: adapters[name] for name in ("a", "b", "c", "a-kohya")}
    try:
        with Omni(QWEN, lora_modules=modules, max_loras=1, max_cpu_loras=2) as omni:
            yield omni
    finally:
        if previous is None:
            del os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"]
        else:
            os.environ["VLLM_OMNI_TEST_CUDA_GRAPHS"] = previous


def test_switching_adapters_is_exact_and_captures_no_graph_after_the_first_request(one_process, adapters):
    omni = one_process
    sequence = ["base", "a", "b", "base", "a", "c", "b", "a-kohya", "base"]
    images, captures = [], []
    for name in sequence:
        lora = None if name == "base" else name
        images.append(omni.generate("a cat", lora=lora, **SMALL)[0])
        captures.append(sum(omni.scheduler.engine.rank_counts("graph_captures").values()))
    first = {name: images[sequence.index(name)] for name in sequence}
    for name, image in zip(sequence, images):  # each again, after any switches: bit-identical
        np.testing.assert_array_equal(image, first[name], err_msg=name)
    np.testing.assert_array_equal(first["a-kohya"], first["a"])  # the kohya twin is the same adapter
    assert captures[0] > 0 and len(set(captures)) == 1, captures  # switching recaptured nothing
    for name in ("base", "a", "b"):
        reference = diffusers_image(QWEN, None if name == "base" else adapters[name], 1.0, **SMALL)
        np.testing.assert_allclose(first[name], reference, atol=ATOL, err_msg=name)
    assert np.abs(first["a"] - first["base"]).max() > 1e-2  # the adapter does change the image
    assert np.abs(first["b"] - first["a"]).max() > 1e-2


def test_scale_and_the_adapters_name_as_the_lora_field(one_process, adapters):
    half = one_process.generate("a cat", lora={"name": "a", "scale": 0.5}, **SMALL)[0]
    np.testing.assert_allclose(half, diffusers_image(QWEN, adapters["a"], 0.5, **SMALL), atol=ATOL)
    full = one_process.generate("a cat", lora={"name": "a"}, **SMALL)[0]
    assert np.abs(full - half).max() > 1e-3


@pytest.mark.parametrize("model", FAMILIES)
def test_each_family_with_a_diffusers_loader_gives_diffusers_image(model, tmp_path):
    path = resolve_model_path(model)
    adapter = str(make_adapter(path, tmp_path / "adapter", seed=11))
    fields = dict(FAMILIES[model], num_inference_steps=2, seed=3)
    images = {}
    with Omni(model, lora_modules={"x": adapter}) as omni:
        for lora in (None, {"name": "x", "scale": 0.5}):
            out = omni.generate("a cat", lora=lora, output_type="np", **fields)[0]
            images[lora is not None] = np.asarray(out if not isinstance(out, list) else np.stack(out), np.float32)
    reference = diffusers_image(model, adapter, 0.5, **fields)
    np.testing.assert_allclose(images[True], reference, atol=ATOL)
    assert np.abs(images[True] - images[False]).max() > 1e-3
    if model.startswith("tiny/wan2.2"):  # both experts carry the adapter: on the first one only, the video differs
        first_only = diffusers_image(model, adapter, 0.5, only="transformer", **fields)
        assert np.abs(images[True] - first_only).max() > 1e-3


def test_wan22_a_file_per_expert_gives_diffusers_video_and_a_request_without_it_is_unchanged_after_it(tmp_path):
    """`lora_modules={"NAME": (HIGH, LOW)}` (Omni's form of --lora-modules NAME=HIGH,LOW): the high-noise expert reads
    HIGH, the low-noise one LOW, as diffusers' `load_lora_weights(HIGH)` and `load_lora_weights(LOW,
    load_into_transformer_2=True)` give; the base model's video after it is bit-identical to the one before."""
    model = "tiny/wan2.2-t2v"
    path = resolve_model_path(model)
    high, low = (str(make_adapter(path, tmp_path / name, seed=seed)) for seed, name in ((21, "high"), (22, "low")))
    fields = dict(FAMILIES[model], num_inference_steps=2, seed=3)

    def video(omni: Omni, lora) -> np.ndarray:
        return np.asarray(np.stack(omni.generate("a cat", lora=lora, output_type="np", **fields)[0]), np.float32)

    with Omni(model, lora_modules={"pair": (high, low)}) as omni:
        before = video(omni, None)
        pair = video(omni, {"name": "pair", "scale": 0.5})
        after = video(omni, None)
        assert omni.scheduler.engine.adapters.served() == {"pair": f"{high},{low}"}
    np.testing.assert_array_equal(after, before)
    np.testing.assert_allclose(pair, diffusers_image(model, (high, low), 0.5, **fields), atol=ATOL)
    assert np.abs(pair - before).max() > 1e-3
    # Each expert read its own file: the high-noise file in both experts is another video.
    assert np.abs(pair - diffusers_image(model, high, 0.5, **fields)).max() > 1e-3


@pytest.fixture(scope="module")
def single_padded(one_process):
    """U1's images at the padded size: with A, and with A under true CFG."""
    return {
        "plain": one_process.generate("a cat", lora="a", **PADDED)[0],
        "cfg": one_process.generate("a cat", lora="a", negative_prompt="blurry", true_cfg_scale=4.0, **PADDED)[0],
    }


def test_ulysses_2_with_cfg_parallel_equals_one_process_and_a_rank_that_cannot_merge_fails_the_group(
    adapters, single_padded, monkeypatch
):
    # Rank 3 (CFG group 1's second SP rank) fails to merge the adapter of the request with this prompt: every rank
    # must fail it at the agreement before the first step (none waits in a collective), and serve the next one.
    fault = {"kind": "raise", "rank": 3, "step": 0, "phase": "lora", "prompt": "fail here"}
    monkeypatch.setenv("VLLM_OMNI_TEST_FAULT", json.dumps(fault))
    with Omni(QWEN, ulysses_degree=2, cfg_parallel_size=2, lora_modules={"a": adapters["a"]}) as omni:
        cfg = omni.generate("a cat", lora="a", negative_prompt="blurry", true_cfg_scale=4.0, **PADDED)[0]
        with pytest.raises(Exception, match="not the same on every rank"):
            omni.generate("fail here", lora="a", **PADDED)
        plain = omni.generate("a cat", lora="a", **PADDED)[0]
        assert omni.scheduler.engine.restarts == 0  # failed by agreement, not by a deadline
    np.testing.assert_allclose(cfg, single_padded["cfg"], atol=ATOL)
    np.testing.assert_allclose(plain, single_padded["plain"], atol=ATOL)


def test_ulysses_3_at_a_padded_size_equals_one_process(adapters, single_padded):
    with Omni(QWEN, ulysses_degree=3, lora_modules={"a": adapters["a"]}) as omni:
        plain = omni.generate("a cat", lora="a", **PADDED)[0]
    np.testing.assert_allclose(plain, single_padded["plain"], atol=ATOL)


def test_a_reload_under_the_same_name_and_path_is_read_anew(adapters):
    """The workers key an adapter's factors by name, path and load: a file replaced and loaded again is not served
    from what they kept of the old one."""
    registry = LoraRegistry("QwenImagePipeline", resolve_model_path(QWEN), ["transformer"], 128, {"a": adapters["a"]})
    first = registry.resolve({"name": "a", "scale": 0.5})
    with pytest.raises(RequestError, match="already loaded") as raised:
        registry.load("a", adapters["a"])
    assert raised.value.param == "lora_name"
    registry.unload("a")
    registry.load("a", adapters["a"])
    second = registry.resolve({"name": "a", "scale": 0.5})
    assert (second.name, second.path, second.scale) == (first.name, first.path, first.scale)
    assert second.version > first.version


def test_without_run_time_loading_the_plan_counts_what_the_served_adapters_adapt_and_holds_later_ones_to_it(
    one_process, adapters, tmp_path
):
    """The engine passes the weights its served adapters adapt to the workers' memory plan; an adapter served later
    by path (offline) that adapts any other is refused naming lora_path, as the plan kept no originals for it."""
    registry = one_process.scheduler.engine.adapters
    attention = {f"transformer_blocks.{i}.attn.{name}.weight" for i in range(2) for name in ATTENTION}
    assert registry.adapted_weights() == attention == registry.planned
    assert one_process.scheduler.engine.config.lora_adapted == tuple(sorted(attention))
    mlp = str(make_adapter(resolve_model_path(QWEN), tmp_path / "mlp", seed=5, targets=("img_mlp.net.2",)))
    with pytest.raises(RequestError, match="memory plan keeps originals") as raised:
        registry.resolve({"name": "mlp", "path": mlp})
    assert raised.value.param == "lora_path"
    runtime = LoraRegistry("QwenImagePipeline", resolve_model_path(QWEN), ["transformer"], 128, {"a": adapters["a"]})
    runtime.resolve({"name": "mlp", "path": mlp})  # nothing planned (run-time loading): any adapter may come
    assert runtime.adapted_weights() > attention
