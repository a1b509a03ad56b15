"""The offline engine end to end on the tiny models: SP equals one process, edits, bad input,
failures, cancellation and dead workers. CPU workers over gloo, one thread each.
"""

from __future__ import annotations

import io
import os
import re
import threading
import time
import zlib

import numpy as np
import pytest
from PIL import Image

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.model_source import ModelNotFoundError  # noqa: E402
from vllm_omni.diffusion.request import DiffusionRequest, GenerationParams, RequestCancelled, RequestFailed  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

# 208x272 -> 13x17 = 221 image tokens: padded at Ulysses 2 (by 1) and 3 (by 1).
HEIGHT, WIDTH = 208, 272
PROMPT = "a cat holding a sign that says hello world"


@pytest.fixture(scope="module")
def engines(omni_engines):
    return omni_engines


def _generate(omni: Omni, **kwargs) -> np.ndarray:
    args = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=7, output_type="np")
    args.update(kwargs)
    return np.stack(omni.generate(PROMPT, **args))


# mask_sp_padding through the engine once (U2); each family's mask mode is its transformer tests' subject
@pytest.mark.parametrize(("degree", "mode"), [(2, "trim"), (3, "trim"), (2, "mask")])
def test_sp_generation_equals_single_process_at_padded_size(engines, degree, mode):
    for kwargs in ({}, {"negative_prompt": " ", "true_cfg_scale": 4.0}):
        expected = _generate(engines("tiny/qwen-image"), **kwargs)
        actual = _generate(engines("tiny/qwen-image", degree, mode), **kwargs)
        assert actual.shape == (1, HEIGHT, WIDTH, 3)
        np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


def _edit_source() -> Image.Image:
    gradient = np.linspace(0, 255, 300, dtype=np.uint8)[None, :, None].repeat(200, 0).repeat(3, 2)
    return Image.fromarray(gradient)  # 300x200, not square


def test_edit_with_non_square_source_equals_single_process(engines):
    # The pipeline resizes the 300x200 source to 1248x832 (78x52 = 4056 tokens); with the
    # 13x17 output that is 4277 image-stream tokens, padded at Ulysses 2.
    kwargs = dict(image=_edit_source())
    expected = _generate(engines("tiny/qwen-image-edit"), **kwargs)
    actual = _generate(engines("tiny/qwen-image-edit", 2), **kwargs)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


def test_edit_plus_zero_cond_t_equals_single_process(engines):
    # Edit-2511 style: per-token modulation index sharded with the image stream.
    kwargs = dict(image=[_edit_source().rotate(90, expand=True)])
    expected = _generate(engines("tiny/qwen-image-edit-plus"), **kwargs)
    actual = _generate(engines("tiny/qwen-image-edit-plus", 2), **kwargs)
    np.testing.assert_allclose(actual, expected, rtol=0, atol=1e-5)


def test_seed_is_drawn_reported_and_reproducible(engines):
    omni = engines("tiny/qwen-image")
    first = _generate(omni, seed=None)
    seed = omni.last_output.seed
    assert isinstance(seed, int)
    np.testing.assert_array_equal(_generate(omni, seed=seed), first)
    assert not np.array_equal(_generate(omni, seed=seed + 1), first)


def test_pil_output_and_n_images(engines):
    omni = engines("tiny/qwen-image")
    images = omni.generate(PROMPT, height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=3, n=2)
    assert [im.size for im in images] == [(WIDTH, HEIGHT)] * 2 and images[0].mode == "RGB"


def test_size_is_rounded_down_to_a_multiple_of_16(engines):
    omni = engines("tiny/qwen-image")
    omni.generate(PROMPT, height=HEIGHT + 10, width=WIDTH + 15, num_inference_steps=2, seed=3)
    assert (omni.last_output.height, omni.last_output.width) == (HEIGHT, WIDTH)


def bomb_png(side: int = 7000) -> bytes:
    """A tiny PNG whose header claims side x side pixels (a decompression bomb)."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    data[16:24] = side.to_bytes(4, "big") * 2  # IHDR width and height
    data[29:33] = zlib.crc32(bytes(data[12:29])).to_bytes(4, "big")  # IHDR CRC
    return bytes(data)


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"height": 0, "width": 256}, "height"),
        ({"height": 256, "width": -16}, "width"),
        ({"height": 10**6, "width": 256}, "height must be between"),
        ({"height": "tall", "width": 256}, "height must be an integer"),
        ({"height": 256}, "both height and width"),
        ({"num_inference_steps": 1}, "num_inference_steps must be between 2"),
        ({"num_inference_steps": 100000}, "num_inference_steps"),
        ({"n": 0}, "n must be"),
        ({"guidance_scale": float("nan")}, "guidance_scale"),
        ({"seed": -1}, "seed"),
        ({"image": _edit_source()}, "image is not accepted"),
        ({"prompt": "   "}, "prompt must be a non-empty string"),
    ],
)
def test_bad_generation_input_is_a_value_error_and_engine_stays_usable(engines, kwargs, field):
    omni = engines("tiny/qwen-image")
    prompt = kwargs.pop("prompt", PROMPT)
    with pytest.raises(ValueError, match=field):
        omni.generate(prompt, **kwargs)
    assert omni.generate(PROMPT, height=32, width=32, num_inference_steps=2, seed=0)[0].size == (32, 32)


@pytest.mark.parametrize(
    "image,field",
    [
        (None, "image is required"),
        (b"definitely not an image", "not a readable image"),
        ("/nonexistent/cat.png", "cannot read"),
        (bomb_png(), "pixels; the limit is"),
        (bomb_png(60000), "too many pixels"),
        ([_edit_source()] * 2, "at most 1 image"),
    ],
)
def test_bad_edit_input_is_a_value_error(engines, image, field):
    omni = engines("tiny/qwen-image-edit")
    with pytest.raises(ValueError, match=field):
        omni.generate(PROMPT, image=image, num_inference_steps=2)


def _request(omni: Omni, **changes) -> DiffusionRequest:
    request = omni.engine.preprocess(GenerationParams(PROMPT, height=32, width=32, num_inference_steps=2, seed=0))
    for name, value in changes.items():
        setattr(request, name, value)
    return request


def test_failure_inside_workers_raises_and_engine_stays_usable(engines):
    omni = engines("tiny/qwen-image", 2)
    # Zero steps slip past preprocess only here; the pipeline then fails on every rank.
    with pytest.raises(RequestFailed, match="ZeroDivisionError"):
        omni.engine.executor.execute(_request(omni, num_inference_steps=0))
    assert omni.engine.executor.restarts == 0
    assert omni.generate(PROMPT, height=32, width=32, num_inference_steps=2, seed=0)[0].size == (32, 32)


def _wait_until_running(omni: Omni, request_id: str | None = None) -> None:
    deadline = time.monotonic() + 60
    while not (omni.engine._cancel_tokens if request_id is None else request_id in omni.engine._cancel_tokens):
        assert time.monotonic() < deadline, "the request never started"
        time.sleep(0.01)


def test_cancel_stops_a_running_request_at_the_next_step(engines):
    omni = engines("tiny/qwen-image", 2)
    outcome: dict = {}

    def run():
        try:
            omni.engine.step(
                GenerationParams(PROMPT, height=512, width=512, num_inference_steps=200, seed=0, request_id="to-cancel")
            )
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    _wait_until_running(omni, "to-cancel")
    time.sleep(0.5)  # a few steps in
    omni.engine.cancel("to-cancel")
    thread.join(timeout=60)
    assert not thread.is_alive()
    assert isinstance(outcome.get("error"), RequestCancelled), outcome
    assert omni.generate(PROMPT, height=32, width=32, num_inference_steps=2, seed=0)[0].size == (32, 32)


def test_dead_worker_is_respawned_idle_and_mid_request(engines):
    omni = engines("tiny/qwen-image", 2)  # the module's U2 engine: the later tests get the respawned group
    executor = omni.engine.executor
    restarts = executor.restarts
    executor._procs[1].kill()
    executor._procs[1].join()
    assert not omni.engine.is_healthy()
    assert omni.generate(PROMPT, height=32, width=32, num_inference_steps=2, seed=0)
    assert executor.restarts == restarts + 1 and omni.engine.is_healthy()

    def kill_rank_1_once_running():
        _wait_until_running(omni)
        time.sleep(0.5)
        executor._procs[1].kill()

    killer = threading.Thread(target=kill_rank_1_once_running)
    killer.start()
    with pytest.raises(RequestFailed, match="worker died"):
        omni.generate(PROMPT, height=512, width=512, num_inference_steps=200, seed=0)
    killer.join()
    assert executor.restarts == restarts + 2
    assert omni.generate(PROMPT, height=32, width=32, num_inference_steps=2, seed=0)


def test_start_refuses_what_does_not_exist_yet(monkeypatch):
    from huggingface_hub import constants

    # tiny/qwen-image has 6 heads: no Ulysses 4; the error names the (Ulysses, ring) splits of 4 ranks
    with pytest.raises(ValueError, match="--ulysses-degree 2 --ring-degree 2 or --ulysses-degree 1 --ring-degree 4"):
        Omni("tiny/qwen-image", ulysses_degree=4)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # a hub id not in the cache would be downloaded
    with pytest.raises(ModelNotFoundError, match="not in the Hugging Face cache .* cannot be reached"):
        Omni("no-such-org/no-such-model")
    with pytest.raises(ModelNotFoundError, match="no such folder: './no-such-folder'"):
        Omni("./no-such-folder")
    with pytest.raises(ValueError, match="mask_sp_padding=True needs an attention backend that can mask"):
        Omni("tiny/qwen-image", ulysses_degree=1, mask_sp_padding=True, attention_backend="sdpa")


@pytest.mark.parametrize(("degree", "mode"), [(1, "trim"), (2, "trim")])
def test_cfg_parallel_equals_one_group_at_padded_size(engines, degree, mode):
    """The cond and uncond forwards on two rank groups (each Ulysses-`degree`) give the same image."""
    cfg = {"negative_prompt": "blurry, low quality", "true_cfg_scale": 4.0}
    expected = _generate(engines("tiny/qwen-image", degree, mode), **cfg)
    omni = engines("tiny/qwen-image", degree, mode, cfg=2)
    np.testing.assert_allclose(_generate(omni, **cfg), expected, rtol=0, atol=1e-5)
    # Without CFG a step has one forward: both groups run it, and the result is still the same.
    np.testing.assert_allclose(_generate(omni), _generate(engines("tiny/qwen-image", degree, mode)), rtol=0, atol=1e-5)


def test_cfg_parallel_cancels_at_the_next_step(engines):
    omni = engines("tiny/qwen-image", 1, "trim", cfg=2)
    outcome: dict = {}

    def run():
        try:
            omni.engine.step(
                GenerationParams(
                    PROMPT,
                    negative_prompt="blurry",
                    height=512,
                    width=512,
                    num_inference_steps=200,
                    seed=0,
                    request_id="cfg-cancel",
                )
            )
        except Exception as exc:  # noqa: BLE001
            outcome["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    _wait_until_running(omni, "cfg-cancel")
    omni.engine.cancel("cfg-cancel")
    thread.join(timeout=60)
    assert isinstance(outcome.get("error"), RequestCancelled), outcome
    assert omni.generate(PROMPT, negative_prompt=" ", height=32, width=32, num_inference_steps=2, seed=0)


def test_ulysses_degree_must_divide_the_head_count_checked_before_any_worker_starts(monkeypatch):
    from vllm_omni.diffusion.engine import core as engine

    def no_workers(*args, **kwargs):
        raise AssertionError("workers started for a degree the config already rules out")

    monkeypatch.setattr(engine, "MultiprocExecutor", no_workers)
    # The tiny transformer has 6 heads.
    with pytest.raises(
        ValueError, match=r"ulysses_degree=4 does not divide the model's 6 attention heads; use one of \[1, 2, 3, 6\]"
    ):
        Omni("tiny/qwen-image", ulysses_degree=4)


def test_unmasked_padding_is_close_not_equal_and_warns_once_per_worker(engines, capfd):
    args = dict(height=HEIGHT, width=WIDTH, num_inference_steps=2, seed=7, output_type="np")
    expected = engines("tiny/qwen-image").generate(PROMPT, **args)[0]
    # Started here, after capfd: its workers write into it, and have not warned yet.
    unmasked = engines("tiny/qwen-image", 2, "none")
    capfd.readouterr()  # only what the three requests below write
    for _ in range(3):
        actual = unmasked.generate(PROMPT, **args)[0]
    err = capfd.readouterr().err
    diff = float(np.abs(actual - expected).max())
    assert 0 < diff < 0.5, diff
    warnings = [line for line in err.splitlines() if "unmasked SP padding" in line]
    assert sorted(re.search(r"\[(omni-worker-\d)", w).group(1) for w in warnings) == ["omni-worker-0", "omni-worker-1"]
    # (rank 0's progress bar may share the line: it has no newline until the bar ends)
    assert all(re.search(r"WARNING .*unmasked SP padding.*ulysses_degree=2", w) for w in warnings)
    # Progress bars come from rank 0 only: one finished bar per request. (Counted by the line a closed bar
    # ends: when a step outlasts tqdm's refresh interval, "100%" is printed once more before the close.)
    assert len(re.findall(r"denoising: 100%[^\r\n]*\n", err)) == 3
    assert err.count("DiffusionEngine.step breakdown: preprocess=") == 3


def test_data_parallel_replicas_run_calls_from_two_threads_at_once():
    """Omni(data_parallel_size=2): a short call from a second thread finishes on the idle replica
    while a long one still runs on the other (one replica would run it after the long one)."""
    with Omni("tiny/qwen-image", data_parallel_size=2) as omni:
        assert [e.config.replica for e in omni.engines] == [0, 1]
        done: dict[str, list] = {}

        def long_call() -> None:
            done["long"] = omni.generate(PROMPT, height=32, width=32, num_inference_steps=60, seed=1, output_type="np")

        thread = threading.Thread(target=long_call)
        thread.start()
        while omni.scheduler.running != 1:  # the long call holds one replica
            time.sleep(0.001)
        short = omni.generate(PROMPT, height=32, width=32, num_inference_steps=2, seed=4, output_type="np")[0]
        assert thread.is_alive() and "long" not in done  # finished while the long call still ran
        thread.join()
        again = omni.generate(PROMPT, height=32, width=32, num_inference_steps=2, seed=4, output_type="np")[0]
        np.testing.assert_array_equal(short, again)
