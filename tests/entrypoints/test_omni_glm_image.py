"""GLM-Image through the offline engine on its tiny model: SP equals one process at padded sizes
(the AR stage runs on one rank, its prior tokens are broadcast), with a source image too (its
keys and values cached per rank), the unmasked mode close and
warning once per worker, and the size rule (multiples of 32, refused before any worker runs).
CPU workers over gloo.
"""

from __future__ import annotations

import io
import json
import os
import re
import threading

import conformance
import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.config import EngineLimits  # noqa: E402
from vllm_omni.diffusion.engine.preprocess import RequestPreprocessor  # noqa: E402
from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path  # noqa: E402
from vllm_omni.diffusion.request import GenerationParams, RequestCancelled, RequestError  # noqa: E402
from vllm_omni.entrypoints.openai.errors import request_error  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

MODEL = "tiny/glm-image"
# The cond pass's glyph text is 'OPEN' (4 bytes and </s>: 5 tokens), the uncond pass's "" (1 token):
# both pad at Ulysses 2 and 3. 64x64 is 4 x 4 image tokens (2 x 2 on the AR's 32-pixel grid): padded at 3.
PROMPT = "a poster with the title 'OPEN' on a white wall"
SIZE = dict(height=64, width=64)


engines = conformance.engines_fixture(MODEL)


_generate = conformance.generator(PROMPT, **SIZE, num_inference_steps=2, seed=3, output_type="np")


@pytest.mark.parametrize(("degree", "mode"), [(2, "trim"), (3, "trim"), (2, "mask")])
def test_sp_equals_single_process_at_padded_size(engines, degree, mode):
    expected = _generate(engines())
    assert expected.shape == (1, 64, 64, 3)
    np.testing.assert_allclose(_generate(engines(degree, mode)), expected, rtol=0, atol=1e-5)


def test_sp_equals_single_process_without_cfg_and_with_several_images(engines):
    # 96x64 is 6 x 4 image tokens (divisible by 2 and 3): only the glyph text pads. No CFG: one pass.
    kwargs = dict(height=64, width=96, guidance_scale=1.0, n=2)
    expected = _generate(engines(), **kwargs)
    assert expected.shape == (2, 64, 96, 3)
    np.testing.assert_allclose(_generate(engines(3, "trim"), **kwargs), expected, rtol=0, atol=1e-5)
    assert np.abs(expected - _generate(engines(), height=64, width=96)).max() > 1e-3  # CFG matters


def test_the_seed_chooses_the_prior_tokens(engines):
    assert np.abs(_generate(engines(2, "trim")) - _generate(engines(2, "trim"), seed=4)).max() > 1e-3


def test_sizes_off_the_32_pixel_grid_are_refused_naming_size_before_any_worker_runs(engines):
    path = resolve_model_path(MODEL)
    preprocess = RequestPreprocessor(read_pipeline_spec(path), EngineLimits(), path)  # no workers at all
    for height, width in [(64, 80), (48, 64)]:  # multiples of 16 (a token) but not of 32
        with pytest.raises(RequestError, match="not a multiple of 32") as caught:
            preprocess(GenerationParams(prompt=PROMPT, height=height, width=width), "r", 1)
        assert caught.value.param in ("height", "width") and request_error(caught.value).param == "size"
    omni = engines()
    with pytest.raises(RequestError, match=r"^width=80 is not a multiple of 32") as caught:
        omni.generate(PROMPT, height=64, width=80, num_inference_steps=2)
    assert request_error(caught.value, "80x64").param == "size"
    request = preprocess(GenerationParams(prompt=PROMPT), "r", 1)  # the pipeline's default, given explicitly
    assert (request.width, request.height) == (1024, 1024)


@pytest.mark.parametrize(("field", "value"), [("negative_prompt", "blurry"), ("true_cfg_scale", 4.0)])
def test_fields_glm_image_does_not_take_are_refused_by_name(engines, field, value):
    with pytest.raises(ValueError, match=f"{field} is not accepted by GlmImagePipeline"):
        engines().generate(PROMPT, **SIZE, num_inference_steps=2, **{field: value})


def _png(width: int, height: int) -> bytes:
    gradient = np.linspace(0, 255, width * height, dtype=np.uint8).reshape(height, width, 1).repeat(3, 2)
    buffer = io.BytesIO()
    Image.fromarray(gradient).save(buffer, format="PNG")
    return buffer.getvalue()


def test_image_to_image_under_sp_equals_single_process_at_padded_sizes(engines):
    """A 64x32 source: 4 x 2 DiT tokens, cached as keys and values, padded at Ulysses 3 like the 64x64 output."""
    source = _png(64, 32)
    expected = _generate(engines(), image=source)
    assert expected.shape == (1, 64, 64, 3)
    assert np.abs(expected - _generate(engines())).max() > 1e-3  # the source conditions the image
    for degree, mode in [(2, "trim"), (3, "trim"), (2, "mask")]:
        np.testing.assert_allclose(_generate(engines(degree, mode), image=source), expected, rtol=0, atol=1e-5)


def test_a_source_sets_the_default_size_on_the_32_pixel_grid_and_elongated_ones_are_refused():
    path = resolve_model_path(MODEL)
    preprocess = RequestPreprocessor(read_pipeline_spec(path), EngineLimits(), path)  # no workers at all
    request = preprocess(GenerationParams(prompt=PROMPT, image=_png(100, 70)), "r", 1)
    assert (request.width, request.height) == (96, 64)
    with pytest.raises(RequestError, match="more than 4:1 apart") as caught:
        preprocess(GenerationParams(prompt=PROMPT, image=_png(160, 32)), "r", 1)
    assert caught.value.param == "image"


def test_unmasked_padding_is_close_not_equal_and_warns_once_per_worker(engines, capfd):
    expected = _generate(engines())
    with Omni(MODEL, ulysses_degree=2, trim_sp_padding=False) as omni:
        outputs = [_generate(omni), _generate(omni)]
    conformance.assert_engine_unmasked_padding_warns_once_per_worker(outputs, expected, capfd.readouterr().err)


def test_the_ar_runs_once_on_rank_0_reports_every_token_and_a_cancel_in_it_stops_the_group(monkeypatch, capfd):
    """U2: rank 0 alone loads and runs the AR, reporting each token (the job's progress, the stall
    deadline); a cancel between its decode steps stops rank 0 there and its peer in the broadcast
    it waits in, with no restart."""
    hold = "hold the AR at its fifth token"
    fault = {"kind": "pause", "rank": 0, "step": 5, "phase": "encode", "prompt": hold}
    monkeypatch.setenv("VLLM_OMNI_TEST_FAULT", json.dumps(fault))
    with Omni(MODEL, ulysses_degree=2) as omni:
        engine = omni.engine
        progress: list[tuple] = []
        request = engine.preprocess(GenerationParams(PROMPT, **SIZE, num_inference_steps=2, seed=3))
        engine.step(request, on_progress=lambda *report: progress.append(report))
        encode = [report for report in progress if report[2:] == ("encode",)]
        total = encode[0][1]  # 16x16 preview tokens, 2x2 image tokens on the 32-pixel grid, the end token
        assert total == 16 * 16 + 2 * 2 + 1 and [done for done, *_ in encode] == list(range(1, total + 1))
        assert progress[-1] == (2, 2, "denoise")  # then the denoising steps
        log = capfd.readouterr().err
        assert re.search(r"Worker rank 1 loaded .*without vision_language_encoder, processor", log), log[-3000:]
        assert log.count(f"encode {total}/{total} token(s)") == 1  # one AR for the request, on rank 0

        held = engine.preprocess(GenerationParams(hold, **SIZE, num_inference_steps=2, seed=3))
        reached = threading.Event()

        def on_progress(done, total, *phase):
            if phase == ("encode",) and done >= 4:
                reached.set()

        result: dict = {}
        thread = threading.Thread(target=lambda: result.setdefault("out", _run(engine, held, on_progress)))
        thread.start()
        assert reached.wait(120)
        engine.cancel(held.request_id)
        thread.join(120)
        assert isinstance(result["out"], RequestCancelled), result
        assert "while encoding" in str(result["out"]) and engine.restarts == 0
        assert _generate(omni).shape == (1, 64, 64, 3)  # the group goes on


def _run(engine, request, on_progress):
    try:
        return engine.step(request, on_progress=on_progress)
    except RequestCancelled as exc:
        return exc
