"""CPU offload (worker/offload.py) and the memory plan (worker/memory_plan.py).

On CPU the offload hooks run with the CPU as both sides: what these tests prove is that diffusers'
model and group offloading are placed on every component and leave the image bit-identical (one
process, and U2 against U1); what only a GPU shows (weights really leave the device, the memory
saved, the speed) is in the CUDA test below and benchmarks/offload.py. The plan's weights are checked
against what the runner really loads, and a deploy too large for a (simulated) device is refused.
"""

from __future__ import annotations

import dataclasses
import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from diffusers.hooks import HookRegistry

from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.request import DiffusionRequest, RequestError
from vllm_omni.diffusion.worker.memory_plan import ComponentWeights, MemoryPlan, cheapest_placement, plan_for_checkpoint
from vllm_omni.diffusion.worker.runner import PipelineRunner, present_components
from vllm_omni.entrypoints.omni import Omni
from vllm_omni.testing.memory import TEST_GPU_MEMORY_ENV, TEST_MEASURED_STEP_ENV

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

MODEL = "tiny/qwen-image"
WAN = "tiny/wan2.2-t2v"  # two experts, as Wan2.2 A14B
LAYERS = (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Conv3d, torch.nn.Embedding)
GiB = 2**30


def _request() -> DiffusionRequest:
    # 14 x 12 = 168 image tokens (16 pixels a token) and true CFG: two forwards a step.
    return DiffusionRequest(
        request_id="r", prompt="a lighthouse at dusk", negative_prompt="fog", true_cfg_scale=4.0, height=224, width=192,
        num_inference_steps=2, seed=7,
        output_type="np",
    )  # fmt: skip


def _group_offloaded(module: torch.nn.Module) -> bool:
    return HookRegistry.check_if_exists_or_initialize(module).get_hook("group_offloading") is not None


@pytest.fixture(scope="module")
def path():
    return resolve_model_path(MODEL)


@pytest.fixture(scope="module")
def reference(path):
    runner = PipelineRunner(path, read_pipeline_spec(path), torch.device("cpu"), torch.float32, rank=0)
    return runner, runner.run(_request(), lambda step: None)


@pytest.mark.parametrize(("mode", "resident"), [("encoders", 0), ("model", 0), ("layerwise", 0), ("layerwise", 1)])
def test_offload_places_diffusers_hooks_on_every_component_and_keeps_the_image(path, reference, mode, resident):
    runner = PipelineRunner(
        path, read_pipeline_spec(path), torch.device("cpu"), torch.float32, 0, cpu_offload=mode,
        resident_blocks={"transformer": resident},
    )  # fmt: skip
    modules = {name: c for name, c in runner.pipe.components.items() if isinstance(c, torch.nn.Module)}
    assert set(modules) >= {"transformer", "text_encoder", "vae"}
    for name, module in modules.items():
        if mode in ("model", "encoders"):  # accelerate's hook: the component moves onto the device when it is called
            assert type(getattr(module, "_hf_hook", None)).__name__ == "ComponentOnload", name
            staying = runner.model_offload.homes.get(id(module)) is None  # no CPU home: it stays on the device
            assert staying == (mode == "encoders" and name in runner.denoisers), name
        else:  # diffusers' group offloading: a denoiser's blocks each a group, every layer of the others
            blocks = runner.denoisers[name].transformer_blocks if name in runner.denoisers else None
            groups = list(blocks) if blocks is not None else [m for m in module.modules() if isinstance(m, LAYERS)]
            # The plan's resident blocks (the last of the two here: spread over the forward) join no group.
            offloaded = [_group_offloaded(m) for m in groups]
            expected = [True, not resident] if blocks is not None else [True] * len(groups)
            assert groups and offloaded == expected, (name, offloaded)
    image = runner.run(_request(), lambda step: None)
    # Not bit-identical on CPU: the hooks re-create the weights inside inference mode, for which the CPU GEMM
    # takes another path (its sums round differently, ~1e-6 in float32; the offload moves no value).
    np.testing.assert_allclose(image, reference[1], rtol=0, atol=1e-5)


def test_layerwise_offload_under_ulysses_2_equals_one_process_without_it(reference):
    with Omni(MODEL, ulysses_degree=2, cpu_offload="layerwise", device="cpu") as omni:
        fields = ("prompt", "negative_prompt", "true_cfg_scale", "height", "width", "num_inference_steps", "seed")
        out = omni.generate(**{k: getattr(_request(), k) for k in fields}, output_type="np")
    np.testing.assert_allclose(np.asarray(out[0] if isinstance(out, list) else out), reference[1][0], rtol=0, atol=1e-5)


def test_the_plans_weights_are_what_the_runner_loads(path, reference):
    runner = reference[0]
    plan = plan_for_checkpoint(
        path, present_components(path), ["transformer"], dtype_bytes=4, fp8_reason=None, tokens=4096,
        text_tokens=512, rows=1, sp=1, offload="none", device_total=GiB, device_free=GiB, utilization=1.0,
    )  # fmt: skip
    # Exactly the checkpoint's tensors; the few bytes apart are buffers a model computes when built (not stored).
    assert abs(plan.weights - runner.weight_bytes) <= 1e-4 * runner.weight_bytes, (plan.weights, runner.weight_bytes)
    by_name = {c.name: c for c in plan.components}
    assert len(by_name["transformer"].blocks) == runner.denoisers["transformer"].config.num_layers
    # Serving LoRA adapters: the copy of every block matrix an adapter may touch (worker/lora.py) is planned too.
    matrices = [p for n, p in runner.denoisers["transformer"].named_parameters() if "blocks." in n and p.dim() == 2]
    lora = dataclasses.replace(plan, lora=True)
    assert lora.lora_copy == sum(p.numel() * 4 for p in matrices) and lora.need == plan.need + lora.lora_copy
    # With the served adapters known (no run-time loading), only the weights they adapt.
    adapted = [n for n, p in runner.denoisers["transformer"].named_parameters() if n.endswith("attn.to_q.weight")]
    served = plan_for_checkpoint(
        path, present_components(path), ["transformer"], dtype_bytes=4, fp8_reason=None, tokens=4096,
        text_tokens=512, rows=1, sp=1, offload="none", device_total=GiB, device_free=GiB, utilization=1.0,
        lora=True, lora_adapted=adapted,
    )  # fmt: skip
    params = dict(runner.denoisers["transformer"].named_parameters())
    assert len(adapted) == 2 and served.lora_copy == sum(params[n].numel() * 4 for n in adapted) < lora.lora_copy
    # Interleaving (--max-num-seqs 4): three suspended requests of the largest size, a fifth of a step each.
    nested = plan_for_checkpoint(
        path, present_components(path), ["transformer"], dtype_bytes=4, fp8_reason=None, tokens=4096,
        text_tokens=512, rows=1, sp=1, offload="none", device_total=GiB, device_free=GiB, utilization=1.0,
        in_flight=4,
    )  # fmt: skip
    assert nested.suspended_bytes == 3 * plan.step_bytes // 5 > 0 and nested.weights == plan.weights
    assert nested.need == plan.need + nested.suspended_bytes and "requests run inside others" in nested.line()


@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_fp8_composes_with_offload_and_lora_with_neither(mode):
    EngineArgs(MODEL, quantization="fp8", cpu_offload=mode).validate()  # each layer converted on the GPU (below)
    with pytest.raises(ValueError, match=f"LoRA adapters with --cpu-offload {mode}"):
        EngineArgs(MODEL, cpu_offload=mode, lora_modules="a=/x").validate()


def test_offload_modes_hold_one_component_or_two_of_its_blocks():
    text = ComponentWeights("text_encoder", 16, largest_layer=3)
    denoiser = ComponentWeights("transformer", 40, (9, 9, 9, 9), largest_layer=2)
    vae = ComponentWeights("vae", 1, largest_layer=1)

    def plan(offload: str, free: int = 100, decode: int = 0) -> MemoryPlan:
        return MemoryPlan((text, denoiser, vae), frozenset({"transformer"}), 5, offload, 100, free, 0.5, decode)

    assert plan("none").need == 16 + 40 + 1 + 5
    assert plan("encoders").need == 40 + 16  # the text encoder beside the denoiser, in its phase
    assert plan("model").need == 40 + 5  # the denoiser and its step; the text encoder has left by then
    # The denoiser: its non-block weights, two of its four blocks and the step; the text encoder: two layers.
    # (Within 30, no room for more: no block stays resident.)
    assert plan("layerwise", free=30).need == 40 - 36 + 2 * 9 + 5
    assert plan("none").budget == 50 and plan("none", free=30).budget == 30
    assert not plan("none").fits and plan("model").fits
    # Layerwise within 50 (45 once a tenth is left free): the streamed plan needs 27, so two more blocks (all
    # but the two streamed) stay.
    assert plan("layerwise").resident_blocks() == {"transformer": 2} and plan("layerwise").need == 27 + 18
    assert plan("layerwise", free=42).resident_blocks() == {"transformer": 1}  # 37 - 27 = 10 spare: one block of 9
    assert plan("layerwise", free=30).resident_blocks() == {"transformer": 0} and plan("model").resident_blocks() == {}
    # The resident blocks stay through the VAE decode, planned with the margin its own check asks (1.3, else the
    # decode is tiled and the image differs): an untiled decode of 24 (31.2 with it, more than the streamed step's
    # 27) leaves 45 - 31 = 14, one block, where without the margin two would stay; one of 20 (26) leaves two.
    assert plan("layerwise", decode=24).resident_blocks() == {"transformer": 1}
    assert plan("layerwise", decode=20).resident_blocks() == {"transformer": 2}


def test_a_deploy_too_large_for_the_device_is_refused_at_start_naming_the_numbers(monkeypatch):
    # The tiny transformer is 96 wide: one step of 4096 + 512 tokens is 4608 x 96 x 4 bytes x 20 = 33.75 MiB,
    # beside 7.1 MiB of weights; half the step at Ulysses 2 fits in 0.9 of 30 MiB.
    monkeypatch.setenv(TEST_GPU_MEMORY_ENV, "30MiB")
    with pytest.raises(Exception) as info:
        Omni(MODEL, device="cpu", max_tokens_per_step=4096, max_n=1)
    message = str(info.value)
    assert "the deploy does not fit" in message and "needs 40.8 MiB of 27.0 MiB (0.9 of 30.0 MiB" in message, message
    assert "short by 13.8 MiB; would fit: --ulysses-degree 2 (24.0 MiB)" in message, message
    assert "--max-tokens-per-step 2304" in message, message
    # Interleaving: at 2048 tokens one request fits (25.8 MiB), but 7 suspended ones (a fifth of a step each) do not.
    with pytest.raises(Exception) as info:
        Omni(MODEL, device="cpu", max_tokens_per_step=2048, max_n=1, scheduling_policy="fair", max_num_seqs=8)
    message = str(info.value)
    assert "requests run inside others 26.2 MiB" in message, message
    assert "would fit: --max-num-seqs 1 (25.8 MiB)" in message, message


@pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")
@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_fp8_with_offload_converts_on_the_device_and_keeps_the_fp8_image(path, mode, monkeypatch):
    """The runner's FP8-with-offload path on CPU, the CPU as both sides: each FP8 layer converted on the device
    while its denoiser waits on the CPU, the offload hooks over FP8 weights, the request in the grad mode FP8
    offload runs in, and the image of FP8 without offload, bit for bit. Test doubles stand in for what only a GPU
    has (torchao's and our capability checks; the tiny model's widths below the rule's floor); that the weights
    really travel is the GPU test below and, with the meta device as the GPU, test_quantization.py's."""
    from torchao.quantization import quant_api
    from torchao.utils import TorchAOBaseTensor

    from vllm_omni.diffusion.worker import quantization

    monkeypatch.setattr(quant_api, "_check_hardware_support", lambda granularity: None)
    monkeypatch.setattr(quantization, "check_quantization", lambda method, device, dtype: None)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: quantization.MIN_CAPABILITY)
    monkeypatch.setattr(quantization, "FP8_RULE", dataclasses.replace(quantization.FP8_RULE, min_features=16))
    cpu, spec = torch.device("cpu"), read_pipeline_spec(path)
    want = PipelineRunner(path, spec, cpu, torch.bfloat16, 0, quantization="fp8").run(_request(), lambda step: None)
    runner = PipelineRunner(path, spec, cpu, torch.bfloat16, 0, quantization="fp8", cpu_offload=mode)
    layers = runner.denoisers["transformer"].modules()
    converted = [m for m in layers if isinstance(getattr(m, "weight", None), TorchAOBaseTensor)]
    assert len(converted) == 24 and runner.grad_mode is torch.no_grad
    np.testing.assert_array_equal(runner.run(_request(), lambda step: None), want)


# ---- on a GPU (skipped elsewhere): the weights really leave it, compiled blocks stay, the image is kept -------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_a_gpu_model_offload_keeps_one_component_there_and_copies_nothing_back():
    """ModelOffload: the component called last is on the GPU, the others wait on the CPU in the very pinned tensors
    they were given (moving one out drops its GPU copy: nothing is copied back, as accelerate's `.to("cpu")` does
    into new pageable memory), with their values."""
    from vllm_omni.diffusion.worker.offload import ModelOffload

    first, second = torch.nn.Linear(4, 4), torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4).eval())
    values = [t.detach().clone() for m in (first, second) for t in m.state_dict().values()]
    offload = ModelOffload(torch.device("cuda", 0))
    offload.install(SimpleNamespace(components={"a": first, "b": second, "tokenizer": object()}))
    homes = {id(m): [t.data_ptr() for t in m.state_dict().values()] for m in (first, second)}
    assert all(t.is_pinned() for m in (first, second) for t in m.state_dict().values())

    def devices(module: torch.nn.Module) -> set[str]:
        return {t.device.type for t in module.state_dict().values()}

    first(torch.ones(2, 4))  # its forward moves it in (accelerate's hook), the input too
    assert devices(first) == {"cuda"} and devices(second) == {"cpu"}
    second(torch.ones(2, 4))
    assert devices(first) == {"cpu"} and devices(second) == {"cuda"}
    assert [t.data_ptr() for t in first.state_dict().values()] == homes[id(first)]
    offload.onload(first)
    assert [t.data_ptr() for t in second.state_dict().values()] == homes[id(second)]
    got = [t.detach().cpu() for m in (first, second) for t in m.state_dict().values()]
    assert all(torch.equal(a, b) for a, b in zip(got, values))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("mode", "resident"), [("encoders", 0), ("model", 0), ("layerwise", 0), ("layerwise", 1)])
def test_on_a_gpu_offloaded_weights_wait_on_the_cpu_and_compiled_blocks_give_the_image(path, mode, resident):
    device = torch.device("cuda", 0)
    spec = read_pipeline_spec(path)
    eager = PipelineRunner(path, spec, device, torch.float32, 0, enforce_eager=True)
    want = eager.run(_request(), lambda step: None)
    del eager
    torch.cuda.empty_cache()
    runner = PipelineRunner(
        path, spec, device, torch.float32, 0, cpu_offload=mode, resident_blocks={"transformer": resident}
    )  # compiled blocks; CUDA graphs only where the denoisers stay (encoders)
    got = runner.run(_request(), lambda step: None)
    assert (runner.graph_captures > 0) == (mode == "encoders")
    # The request's weights moved in, timed on the stream (the step log's onload); none under layerwise's hooks.
    assert ("onload" in runner.phase_seconds) == (mode != "layerwise") and runner.phase_seconds.get("onload", 1) > 0
    # Between requests every weight is back on the CPU (a denoiser's blocks too, under layerwise), but for
    # the blocks the plan keeps resident (the last of the two) and, under encoders, the denoiser.
    blocks = runner.denoisers["transformer"].transformer_blocks
    kept = {id(p) for p in blocks[1].parameters()} if resident else set()
    if mode == "encoders":
        kept = {id(p) for p in runner.denoisers["transformer"].parameters()}
        assert {p.device.type for p in runner.denoisers["transformer"].parameters()} == {"cuda"}
    devices = {p.device.type for c in runner.pipe.components.values() if isinstance(c, torch.nn.Module)
               for p in c.parameters() if id(p) not in kept}  # fmt: skip
    assert devices == {"cpu"}, devices
    assert {p.device.type for p in blocks[1].parameters()} == ({"cuda"} if resident or mode == "encoders" else {"cpu"})
    assert PipelineRunner.compiles() > 0
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)  # inductor's fused norms round as in test_runner_cuda
    if mode == "encoders":  # graphs replayed: the same image again
        np.testing.assert_array_equal(runner.run(_request(), lambda step: None), got)


@pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None
    or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (8, 9),
    reason="needs torchao and a CUDA GPU of compute capability 8.9+",
)
@pytest.mark.parametrize("mode", ["model", "layerwise"])
def test_on_a_gpu_fp8_weights_are_converted_there_wait_on_the_cpu_and_give_the_fp8_image(path, mode, monkeypatch):
    from torchao.utils import TorchAOBaseTensor

    from vllm_omni.diffusion.worker import quantization

    # The tiny model's layers are below the rule's size floor: the same names at its widths.
    monkeypatch.setattr(quantization, "FP8_RULE", dataclasses.replace(quantization.FP8_RULE, min_features=16))
    device = torch.device("cuda", 0)
    spec = read_pipeline_spec(path)
    resident = PipelineRunner(path, spec, device, torch.bfloat16, 0, quantization="fp8")  # compiled, graphs
    want = resident.run(_request(), lambda step: None)
    del resident
    torch.cuda.empty_cache()
    runner = PipelineRunner(path, spec, device, torch.bfloat16, 0, quantization="fp8", cpu_offload=mode)
    got = runner.run(_request(), lambda step: None)
    again = runner.run(_request(), lambda step: None)  # the FP8 weights went to the CPU and came back
    fp8 = [m.weight for m in runner.denoisers["transformer"].modules() if isinstance(getattr(m, "weight", None),
           TorchAOBaseTensor)]  # fmt: skip
    assert fp8, "no layer was converted"
    # Between requests the FP8 weights wait on the CPU: their 8-bit data and scales (group offloading restores
    # those in place, leaving the wrapper's own device attribute as it was on the GPU).
    assert {t.device.type for w in fp8 for t in (w.qdata, w.scale)} == {"cpu"}
    assert np.array_equal(got, again)
    # Offload moves the FP8 weights, it does not change them: the image is the resident FP8 one, up to the
    # difference between a compiled block replayed in a CUDA graph and the same block run without one.
    np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


# ---- admission sized by the GPU's memory (engine/admission.py): the envelope, measured, and forwards in a row ----


def _generate_np(omni: Omni, n: int, seed: int) -> np.ndarray:
    return np.stack(omni.generate("a lighthouse", height=48, width=64, num_inference_steps=2, seed=seed, n=n,
                                  output_type="np"))  # fmt: skip


def test_more_images_than_a_forward_holds_run_as_forwards_in_a_row_giving_the_one_call_images(monkeypatch):
    """A (simulated) 16 MiB device holds the tiny model and one row of its 64-token limit beside the 512-token text
    allowance: the envelope's forward holds one 64x48 image (12 tokens + text), so n=3 runs as three pipeline calls
    inside the request. They give the images of one call of three rows (no simulated memory: a CPU is not sized),
    within float reassociation, and image i is the n=1 image of seed + i, which the output reports."""
    monkeypatch.setenv(TEST_GPU_MEMORY_ENV, "16MiB")
    with Omni(MODEL, device="cpu", max_tokens_per_step=64, max_n=4) as omni:
        envelope = omni.engine.envelope
        assert envelope is not None and envelope.max_tokens_per_step == 64 and envelope.rows_for(12) == 1, envelope
        assert "up to 1 image(s) of 128x128" in omni.engine.envelope_text()
        in_a_row = _generate_np(omni, 3, seed=5)
        assert omni.last_output.seeds == [5, 6, 7]
    monkeypatch.delenv(TEST_GPU_MEMORY_ENV)
    with Omni(MODEL, device="cpu", max_n=4) as omni:
        assert omni.engine.envelope is None  # a CPU: nothing to size by
        one_call = _generate_np(omni, 3, seed=5)
        alone = [_generate_np(omni, 1, seed=5 + i)[0] for i in range(3)]
    np.testing.assert_allclose(in_a_row, one_call, atol=1e-5, rtol=0)
    np.testing.assert_allclose(np.stack(alone), one_call, atol=1e-5, rtol=0)


def test_the_default_request_decides_the_start_and_the_measured_step_the_envelope(monkeypatch):
    """The plan must fit the model's default request (1024x1024, one image: 4096 tokens + 512 of text, 33.8 MiB
    of step beside 7.1 MiB of weights in fp32), not the largest the limits admit (4 images at the 81920-token cap):
    within 0.9 of 64 MiB it starts, and its envelope is what the rest holds. The warm-up's measured step (the test
    double: twice the estimate) halves what a forward holds beyond the weights."""
    monkeypatch.setenv(TEST_GPU_MEMORY_ENV, "64MiB")
    spec = read_pipeline_spec(resolve_model_path(MODEL))
    with Omni(MODEL, device="cpu", max_image_size=1040) as omni:  # its measured step: 1040x1040, not 4096x4096
        planned = omni.engine.envelope
    assert 4096 <= planned.max_tokens_per_step < spec.max_tokens_per_step, planned
    assert planned.rows_for(4096) == 1 and planned.max_rows == EngineArgs(MODEL).limits.max_n
    monkeypatch.setenv(TEST_MEASURED_STEP_ENV, "2")
    with Omni(MODEL, device="cpu", max_image_size=1040) as omni:
        measured = omni.engine.envelope
        # Never narrower than the default request, which the plan admitted.
        assert measured.max_tokens_per_step == 4096 and measured.forward_tokens < planned.forward_tokens, measured
        with pytest.raises(RequestError, match="4225 tokens per denoising step .*this deploy's GPU memory holds 4096"):
            omni.generate("a lighthouse", height=1040, width=1040, num_inference_steps=2)
    # 16 MiB cannot hold the default request: refused, naming what would fit.
    monkeypatch.setenv(TEST_GPU_MEMORY_ENV, "16MiB")
    with pytest.raises(Exception, match="the deploy does not fit.*--max-tokens-per-step"):
        Omni(MODEL, device="cpu")


def test_auto_placement_offloads_only_where_the_default_request_does_not_fit_resident(monkeypatch, capfd):
    """cpu_offload="auto" (the default), at Ulysses 2 within 0.9 of 23 MiB (20.7): rank 0's default request needs
    24.0 MiB resident (text encoder 1.1, transformer 2.8, VAE 3.2, its half of the step 16.9, fp32), 19.7 with the
    text encoder and the VAE waiting on the CPU (encoders); rank 1 has no text encoder and needs 22.9 resident. Every
    rank takes the costliest placement any rank needs and says so; the image is the resident one's, bit for bit (the
    CPU as both sides). Served LoRA adapters are merged into the resident denoisers: encoders serves them (20.0 MiB
    with the adapted weights' originals)."""
    monkeypatch.setenv(TEST_GPU_MEMORY_ENV, "23MiB")
    kwargs = dict(height=48, width=64, num_inference_steps=2, seed=4, output_type="np")
    with Omni(MODEL, device="cpu", ulysses_degree=2, max_image_size=512) as omni:
        offloaded = np.stack(omni.generate("a lighthouse", **kwargs))
    log = capfd.readouterr().err
    assert "Worker rank 0: encoders offload chosen (cpu_offload auto)" in log, log[-3000:]
    assert "Worker rank 1: encoders offload chosen" in log
    monkeypatch.delenv(TEST_GPU_MEMORY_ENV)
    with Omni(MODEL, device="cpu", ulysses_degree=2) as omni:
        np.testing.assert_array_equal(np.stack(omni.generate("a lighthouse", **kwargs)), offloaded)
    monkeypatch.setenv(TEST_GPU_MEMORY_ENV, "23MiB")
    with Omni(MODEL, device="cpu", ulysses_degree=2, lora_modules={"a": "tiny/qwen-image-lora"}, max_image_size=512):
        pass
    assert "Worker rank 0: encoders offload chosen" in capfd.readouterr().err


def test_wans_idle_expert_waits_on_the_cpu_where_both_do_not_fit_and_the_video_is_the_resident_one(capfd):
    """Wan2.2 A14B's two experts (the tiny model's): on a device that holds one expert and its step but not both,
    auto chooses model offload, the idle expert waiting on the CPU until its boundary step; the video is the one of
    every weight resident, bit for bit (the CPU as both sides; the swap's seconds only a GPU shows:
    benchmarks/wan22_e2e.py's ours-expert-swap)."""
    from vllm_omni.diffusion.engine.admission import plan_deploy

    limits = dict(max_tokens_per_step=512)  # the warm-up's profile request at most this (it runs on the CPU here)
    needs = {
        mode: plan_deploy(EngineArgs(WAN, device="cpu", dtype="float32", cpu_offload=mode, **limits), GiB).plan.need
        for mode in ("encoders", "model")
    }
    assert needs["model"] < needs["encoders"]  # one expert on the GPU at a time, against both
    memory = int((needs["model"] + needs["encoders"]) / 2 / 0.9)
    kwargs = dict(height=48, width=64, num_frames=5, num_inference_steps=4, seed=3, output_type="np")
    with Omni(WAN, device="cpu", dtype="float32") as omni:
        want = np.asarray(omni.generate("a paper boat", **kwargs)[0])
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(TEST_GPU_MEMORY_ENV, str(memory))
        with Omni(WAN, device="cpu", dtype="float32", **limits) as omni:
            got = np.asarray(omni.generate("a paper boat", **kwargs)[0])
    assert "Worker rank 0: model offload chosen (cpu_offload auto)" in capfd.readouterr().err
    np.testing.assert_array_equal(got, want)


def test_auto_takes_the_cheapest_placement_that_fits_and_with_adapters_one_that_keeps_the_denoisers():
    text, vae = ComponentWeights("text_encoder", 16), ComponentWeights("vae", 1, largest_layer=1)
    experts = [
        ComponentWeights(name, 20, (4, 4, 4, 4, 4), largest_layer=1) for name in ("transformer", "transformer_2")
    ]

    def chosen(budget: int, lora: bool = False) -> str:
        def plan_at(offload: str) -> MemoryPlan:
            return MemoryPlan((text, *experts, vae), frozenset(e.name for e in experts), 5, offload, budget, budget, 1)

        return cheapest_placement(plan_at, lora)

    # Resident 62; encoders 56 (both experts beside the text encoder); model 25 (one expert and its step);
    # layerwise 12 + 5 (one expert's non-block weights, two blocks, the step).
    assert [chosen(b) for b in (62, 56, 30, 20)] == ["none", "encoders", "model", "layerwise"]
    assert chosen(10) == "none"  # nothing fits: the refusal names what would
    assert chosen(56, lora=True) == "encoders" and chosen(30, lora=True) == "none"


def test_layerwise_keeps_room_for_both_cfg_rows_where_they_fit_so_a_cfg_step_streams_the_weights_once():
    """Under layerwise offload every forward streams the blocks to the GPU, so CFG in one pass (worker/cfg_batch.py)
    halves the copies; the plan keeps room for both rows of the default request (1024x1024: 4096 tokens and 512 of
    text each) where they fit, at the cost of resident blocks, and one row where only that fits. The envelope's row
    stays the default request's: the room is for the pair, not for larger images."""
    from vllm_omni.diffusion.engine.admission import fit, plan_deploy

    def deploy(mib: float, **options):
        return plan_deploy(EngineArgs(MODEL, device="cpu", cpu_offload="layerwise", **options), int(mib * 2**20))

    one, both = deploy(64, cfg_one_pass=False), deploy(64)
    assert (one.envelope.rows_for(4096), both.envelope.rows_for(4096)) == (1, 2)
    assert one.envelope.max_tokens_per_step == both.envelope.max_tokens_per_step == 4096
    assert both.plan.step_bytes == 2 * one.plan.step_bytes and "up to 2 image(s) of 1024x1024" in both.description
    request = DiffusionRequest(request_id="r", prompt="a lighthouse", negative_prompt=" ", tokens=4096)
    assert fit(request, both.envelope, cfg_one_pass=True).cfg_one_pass
    assert not fit(request, one.envelope, cfg_one_pass=True).cfg_one_pass
    # --max-n 1 limits the images a forward holds, not a CFG step's two rows of one image.
    single = deploy(64, max_n=1).envelope
    assert single.rows_for(4096) == 1 and fit(request, single, cfg_one_pass=True).cfg_one_pass
    # Between one row's need and two rows': one row, and the deploy still starts.
    between = deploy((one.plan.need + both.plan.need) / 2 / 0.9 / 2**20)
    assert between.starts and between.envelope.rows_for(4096) == 1
    # CFG parallel splits the branches over two groups instead; a deploy that keeps the weights resident widens
    # its envelope anyway.
    assert deploy(64, cfg_parallel_size=2).envelope.rows_for(4096) == 1
