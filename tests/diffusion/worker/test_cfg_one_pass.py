"""CFG in one pass (worker/cfg_batch.py): a step's cond and uncond calls as one forward of both rows.

The hook's logic on a made-up denoiser (what it predicts, when the second call gets the waiting rows, when it
gives up), the row helpers (models/branch_rows.py), the engine's decision (admission.fit), then whole
requests of every tiny CFG model through the runner, one pass against two forwards (fp32, CPU: within what
batching rows changes), and Qwen-Image at a padded size under Ulysses 2 and 3 with simulated CUDA graphs
against one process's two forwards. The step cache and CFG parallel turn it off: tests/entrypoints/
test_omni_step_cache.py asserts that their requests ran no step in one pass; with real CUDA graphs:
test_runner_cuda.py.
"""

from __future__ import annotations

import io
import logging

import numpy as np
import pytest
import torch
from PIL import Image

from vllm_omni.diffusion.config import Envelope
from vllm_omni.diffusion.engine.admission import fit
from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path
from vllm_omni.diffusion.models.branch_rows import pad_text, stack_branches
from vllm_omni.diffusion.models.family import FamilyPipeline
from vllm_omni.diffusion.models.registry import TINY_MODELS
from vllm_omni.diffusion.request import DiffusionRequest
from vllm_omni.diffusion.worker.cfg_batch import CFGBatch
from vllm_omni.testing.graphs import SimulatedGraphs
from vllm_omni.testing.hooks import TestHooks

# ---- the hook on a made-up denoiser ---------------------------------------------------------------------------


class Denoiser:
    """A denoiser whose rows depend on their own text only; records the batch of every forward it runs."""

    def __init__(self) -> None:
        self.batches: list[int] = []

    def __call__(self, hidden_states, encoder_hidden_states, timestep, return_dict=True):
        self.batches.append(hidden_states.shape[0])
        sample = hidden_states * timestep[:, None, None] + encoder_hidden_states.mean(1, keepdim=True)
        return (sample,)


def _step(batch: CFGBatch, model: Denoiser, latents, t, cond_text, uncond_text):
    """One CFG step as a diffusers pipeline makes it: the same latents, a timestep rebuilt for each call."""
    timestep = t.expand(latents.shape[0])
    outputs = []
    for text in (cond_text, uncond_text):
        kwargs = dict(hidden_states=latents, encoder_hidden_states=text, timestep=timestep / 1000, return_dict=False)
        outputs.append(batch.run(model, model, (), kwargs)[0])
        expected = model.__call__.__func__(Denoiser(), **kwargs)[0]  # the same call alone
        torch.testing.assert_close(outputs[-1], expected, rtol=0, atol=1e-6)
    batch.end_step()
    return outputs


def test_from_the_second_step_both_calls_run_as_one_forward_and_each_gets_its_own_rows():
    model, batch = Denoiser(), CFGBatch(stack_branches)
    latents, cond, uncond = torch.randn(2, 5, 3), torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    batch.start_request(True)
    for t in (900.0, 500.0, 100.0):
        _step(batch, model, latents, torch.tensor(t), cond, uncond)
    assert model.batches == [2, 2, 4, 4]  # step 0 learns which arguments are the branch's own
    assert batch.one_pass_steps == 2


def test_an_uncond_call_unlike_its_prediction_runs_as_it_comes_and_the_request_goes_back_to_two_forwards(caplog):
    model, batch = Denoiser(), CFGBatch(stack_branches)
    latents, cond, uncond = torch.randn(1, 5, 3), torch.randn(1, 4, 3), torch.randn(1, 4, 3)
    batch.start_request(True)
    _step(batch, model, latents, torch.tensor(900.0), cond, uncond)
    with caplog.at_level(logging.WARNING, logger="vllm_omni.diffusion.worker.cfg_batch"):
        _step(batch, model, latents, torch.tensor(500.0), cond, uncond + 1)  # the negative text changed
    _step(batch, model, latents, torch.tensor(100.0), cond, uncond + 1)
    assert model.batches == [1, 1, 2, 1, 1, 1]  # the wasted pair, its uncond computed again, then two forwards
    assert batch.one_pass_steps == 0
    assert "differs from its prediction; two forwards from here" in caplog.text
    # The next request predicts again.
    batch.start_request(True)
    for t in (900.0, 500.0):
        _step(batch, model, latents, torch.tensor(t), cond, uncond)
    assert model.batches[6:] == [1, 1, 2] and batch.one_pass_steps == 1


def test_off_for_the_request_or_with_positional_arguments_every_call_runs_as_it_comes():
    model, batch = Denoiser(), CFGBatch(stack_branches)
    latents, cond, uncond = torch.randn(1, 5, 3), torch.randn(1, 4, 3), torch.randn(1, 4, 3)
    batch.start_request(False)
    for t in (900.0, 500.0):
        _step(batch, model, latents, torch.tensor(t), cond, uncond)
    batch.start_request(True)
    for _ in range(2):
        args = (latents, cond, torch.tensor([0.5]))
        batch.run(model, model, args, {})
        batch.run(model, model, args, {})
        batch.end_step()
    assert model.batches == [1] * 8 and batch.one_pass_steps == 0


def test_a_family_whose_calls_do_not_stack_runs_two_forwards():
    model, batch = Denoiser(), CFGBatch(lambda cond, uncond: None)
    latents, cond, uncond = torch.randn(1, 5, 3), torch.randn(1, 4, 3), torch.randn(1, 4, 3)
    batch.start_request(True)
    for t in (900.0, 500.0, 100.0):
        _step(batch, model, latents, torch.tensor(t), cond, uncond)
    assert model.batches == [1] * 6 and batch.one_pass_steps == 0


# ---- the row helpers --------------------------------------------------------------------------------------------


def test_rows_are_concatenated_and_shared_values_pass_while_anything_else_refuses():
    latents, flags = torch.randn(2, 5, 3), {"scale": 1.0}
    cond = dict(hidden_states=latents, text=torch.ones(2, 4, 3), shapes=[(1, 2, 3)] * 2, attention_kwargs=flags)
    uncond = dict(cond, text=torch.zeros(2, 4, 3), attention_kwargs=dict(flags))
    both = stack_branches(cond, uncond)
    assert both["hidden_states"].shape == (4, 5, 3) and torch.equal(both["hidden_states"][2:], latents)
    assert torch.equal(both["text"], torch.cat([cond["text"], uncond["text"]]))
    assert both["shapes"] == [(1, 2, 3)] * 4 and both["attention_kwargs"] is flags
    assert stack_branches(cond, dict(uncond, attention_kwargs={"scale": 2.0})) is None  # a non-row value differs
    assert stack_branches(cond, dict(uncond, text=torch.zeros(2, 6, 3))) is None  # rows of different shapes
    assert stack_branches(cond, {k: v for k, v in uncond.items() if k != "shapes"}) is None


def test_texts_of_different_lengths_are_padded_and_masked_once_per_pair():
    cond = dict(hidden_states=torch.randn(1, 5, 3), text=torch.randn(1, 6, 3), mask=None)
    uncond = dict(hidden_states=cond["hidden_states"], text=torch.randn(1, 2, 3), mask=torch.ones(1, 2))
    a, b = pad_text(cond, uncond, "text", "mask")
    assert a["text"].shape == b["text"].shape == (1, 6, 3)
    assert a["mask"].tolist() == [[1] * 6] and b["mask"].tolist() == [[1, 1, 0, 0, 0, 0]]
    assert torch.equal(b["text"][:, :2], uncond["text"]) and not b["text"][:, 2:].any()
    again = pad_text(cond, uncond, "text", "mask")
    assert again[1]["text"] is b["text"] and again[1]["mask"] is b["mask"]  # text compaction's cache hits
    assert pad_text(cond, dict(uncond, text=torch.randn(1, 6, 3)), "text", "mask")[1]["mask"] is uncond["mask"]


# ---- the engine's decision --------------------------------------------------------------------------------------


def _request(**fields) -> DiffusionRequest:
    return DiffusionRequest(request_id="r", prompt="a kite", tokens=1000, **fields)


@pytest.mark.parametrize(
    ("rows_fit", "num_images", "expected", "chunks"),
    [(2, 1, True, [1]), (1, 1, False, [1]), (4, 2, True, [2]), (3, 2, True, [1, 1]), (1, 2, False, [1, 1])],
)
def test_one_pass_where_a_forward_holds_both_branches_rows_of_an_image(rows_fit, num_images, expected, chunks):
    envelope = Envelope(max_tokens_per_step=1000, forward_tokens=1100 * rows_fit, max_rows=8, text_tokens=100)
    request = fit(_request(num_images=num_images), envelope, cfg_one_pass=True)
    assert request.cfg_one_pass is expected
    assert request.forward_chunks == chunks  # one pass: half the images a forward, each with its uncond row
    two = fit(_request(num_images=num_images), envelope)  # the deploy turned it off, or the request runs no CFG
    assert two.cfg_one_pass is False and two.forward_chunks == [min(rows_fit, num_images)] * (
        num_images // min(rows_fit, num_images)
    )
    assert fit(_request(profile=True), envelope, cfg_one_pass=True).cfg_one_pass is False  # measures one row
    batch = _request(batch=[_request()])  # a batch's rows are its requests'
    assert fit(batch, envelope, cfg_one_pass=True).cfg_one_pass is (rows_fit >= 4)
    assert fit(_request(), None, cfg_one_pass=True).cfg_one_pass is True  # no envelope: nothing sized


# ---- whole requests: every tiny CFG model, one pass against two forwards ----------------------------------------


def _png(width: int, height: int) -> bytes:
    rng = np.random.default_rng(0)
    buffer = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, 3), np.uint8)).save(buffer, format="PNG")
    return buffer.getvalue()


PROMPT = "a red kite over a wide beach at noon"
CFG = dict(negative_prompt="blurry", true_cfg_scale=4.0)
VIDEO = dict(num_frames=5, negative_prompt="blurry")
CASES = {  # tiny model -> request fields that run CFG; prompts and negative prompts of different lengths
    "tiny/qwen-image": dict(height=64, width=80, num_images=2, **CFG),
    "tiny/qwen-image-edit": dict(height=64, width=64, images=[_png(64, 48)], **CFG),
    "tiny/qwen-image-edit-plus": dict(height=64, width=64, images=[_png(40, 56)], **CFG),
    "tiny/qwen-image-2.1": dict(height=64, width=64, num_images=2, **CFG),  # two layouts: two forwards
    "tiny/qwen-image-2.1 same layout": dict(height=64, width=64, true_cfg_scale=4.0, negative_prompt=PROMPT),
    "tiny/hunyuan-video-1.5": dict(height=144, width=176, **VIDEO),
    "tiny/hunyuan-video-1.5-i2v": dict(images=[_png(150, 120)], **VIDEO),
    "tiny/wan2.2-t2v": dict(height=48, width=80, num_images=2, **VIDEO),  # two experts: the switch mid-request
    "tiny/wan2.2-i2v": dict(height=48, width=80, images=[_png(80, 48)], **VIDEO),
    "tiny/wan2.2-ti2v": dict(height=64, width=96, guidance_scale=4.0, num_frames=5),  # the default negative ""
    "tiny/glm-image": dict(height=64, width=64, guidance_scale=1.5),
}
STEPS = 4
TWO_FORWARDS = {"tiny/qwen-image-2.1"}  # its cases' prompts differ in length (the others' too)


def _families_with_cfg() -> set[str]:
    names = set()
    for name in TINY_MODELS:
        family = type(read_pipeline_spec(resolve_model_path(name)).family_pipeline())
        if family.uses_cfg is not FamilyPipeline.uses_cfg:
            assert family.cfg_rows is not FamilyPipeline.cfg_rows, f"{family.__name__} runs CFG but has no cfg_rows"
            names.add(name)
    return names


def test_every_tiny_model_that_runs_cfg_has_a_case():
    assert {name.split()[0] for name in CASES} == _families_with_cfg()


def _run(runner, name: str, one_pass: bool) -> np.ndarray:
    request = DiffusionRequest(
        request_id="r", prompt=PROMPT, num_inference_steps=STEPS, seed=3, output_type="np", cfg_one_pass=one_pass,
        **CASES[name],
    )  # fmt: skip
    assert runner.family.uses_cfg(request)
    return runner.run(request, lambda step: None)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(CASES), ids=[name[5:].replace(" ", "-") for name in sorted(CASES)])
def test_one_pass_gives_the_two_forwards_image(name):
    from vllm_omni.diffusion.worker.runner import PipelineRunner

    path = resolve_model_path(name.split()[0])
    runner = PipelineRunner(path, read_pipeline_spec(path), torch.device("cpu"), torch.float32, rank=0)
    two = _run(runner, name, one_pass=False)
    assert runner.cfg_one_pass_steps == 0
    one = _run(runner, name, one_pass=True)
    # The first step learns which arguments are the branch's own.
    assert runner.cfg_one_pass_steps == (0 if name in TWO_FORWARDS else STEPS - 1)
    np.testing.assert_allclose(one, two, rtol=0, atol=1e-5)


# ---- Ulysses 2 and 3 at a padded size, simulated CUDA graphs -----------------------------------------------------

SP_REQUEST = dict(
    prompt="a cat holding a sign that says hello", height=208, width=272, num_inference_steps=STEPS, seed=7, **CFG
)  # 221 image tokens: padded at 2 and 3 ranks


def _sp_run(one_pass: bool) -> dict:
    from vllm_omni.diffusion.worker.runner import PipelineRunner

    path = resolve_model_path("tiny/qwen-image")
    hooks = TestHooks(0, faults=[], graphs=SimulatedGraphs())  # graphs on, as on GPUs
    runner = PipelineRunner(path, read_pipeline_spec(path), torch.device("cpu"), torch.float32, rank=0, hooks=hooks)
    request = DiffusionRequest(request_id="r", output_type="np", cfg_one_pass=one_pass, **SP_REQUEST)
    image = runner.run(request, lambda step: None)
    return {"image": image, "one_pass_steps": runner.cfg_one_pass_steps, "captures": runner.graph_captures}


@pytest.mark.slow
def test_under_ulysses_with_graphs_one_pass_gives_one_processs_two_forwards_image(sp_pool):
    from vllm_omni.diffusion.worker.runner import PipelineRunner

    path = resolve_model_path("tiny/qwen-image")
    runner = PipelineRunner(path, read_pipeline_spec(path), torch.device("cpu"), torch.float32, rank=0)
    reference = runner.run(DiffusionRequest(request_id="r", output_type="np", **SP_REQUEST), lambda step: None)
    results = sp_pool.run(_sp_run, True)
    for result in results:
        assert result["one_pass_steps"] == STEPS - 1  # every rank, the same steps
        # The first step's two forwards, one row each with its own text length, then both rows: a graph each.
        assert result["captures"] == 3
        np.testing.assert_allclose(result["image"], reference, rtol=0, atol=1e-5)
