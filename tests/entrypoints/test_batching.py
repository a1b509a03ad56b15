"""Request batching through a real engine (tiny Qwen-Image, worker processes on the CPU, fp32).

A batch is one pipeline call with a row per request: a list of prompts (of different lengths, so
the text padding and compaction differ per row), one CPU generator per row (each request's own
seed), and mixed negative prompts. Each row must equal the same request run alone: the rows'
latents are drawn from their own generators, and the transformer runs rows whose text compaction
differs in one forward with each row's attention seeing its own valid text, so the only difference
allowed is float reassociation in the batched GEMMs (atol 1e-5 on pixels in [0, 1]). Under CFG
parallel x Ulysses 2 the uncond group swaps the prompt lists and SP rank 0 encodes a batch of
prompts for its peers.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from vllm_omni import Omni
from vllm_omni.diffusion.engine.batching import batch_key
from vllm_omni.diffusion.request import GenerationParams, LoraRequest

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)

PROMPTS = ["a cat", "a red bicycle leaning against a blue wall in the rain, photographed at dusk", "two dogs"]
NEGATIVES = ["blurry", "low quality, watermark, oversaturated colours", "blurry"]
SEEDS = [3, 11, 5]


def requests(engine, negative: bool):
    return [
        engine.preprocess(
            GenerationParams(
                prompt,
                negative_prompt=neg if negative else None,
                height=48,
                width=80,
                num_inference_steps=2,
                seed=seed,
                output_type="np",
            )
        )
        for prompt, neg, seed in zip(PROMPTS, NEGATIVES, SEEDS)
    ]


def assert_batch_equals_alone(engine, negative: bool) -> None:
    rows = requests(engine, negative)
    assert len({batch_key(r, engine.spec) for r in rows}) == 1
    batched = engine.step_batch(rows)
    assert [out.request_id for out in batched] == [r.request_id for r in rows]
    assert all(out.batch_size == 3 for out in batched)
    for request, out in zip(requests(engine, negative), batched):
        alone = engine.step(request)
        assert alone.seed == out.seed
        np.testing.assert_allclose(out.images[0], alone.images[0], atol=1e-5, rtol=0)
    # Different seeds give different images: the rows are not copies of one another.
    assert np.abs(batched[0].images[0] - batched[2].images[0]).max() > 1e-3


@pytest.fixture(scope="module")
def engine():
    with Omni("tiny/qwen-image") as omni:
        yield omni.engine


@pytest.mark.parametrize("negative", [True, False], ids=["true-cfg", "no-cfg"])
def test_a_batched_request_equals_the_same_request_run_alone(engine, negative):
    assert_batch_equals_alone(engine, negative)


def test_a_batch_under_cfg_parallel_and_ulysses_equals_each_request_alone():
    with Omni("tiny/qwen-image", ulysses_degree=2, cfg_parallel_size=2) as omni:
        assert_batch_equals_alone(omni.engine, negative=True)


def test_requests_that_cannot_share_a_forward_have_different_or_no_batch_keys(engine):
    base = dict(height=48, width=80, num_inference_steps=2)
    key = batch_key(engine.preprocess(GenerationParams("a", **base)), engine.spec)
    assert key is not None
    for change in (
        dict(height=64),
        dict(num_inference_steps=3),
        dict(negative_prompt="blurry"),  # true CFG: two forwards per step
        dict(true_cfg_scale=6.0, negative_prompt="blurry"),
    ):
        assert batch_key(engine.preprocess(GenerationParams("a", **{**base, **change})), engine.spec) != key
    assert batch_key(engine.preprocess(GenerationParams("a", n=2, **base)), engine.spec) is None
    # LoRA: only requests with the same adapter at the same scale share a forward (its weights are merged per call).
    request = engine.preprocess(GenerationParams("a", **base))
    loras = [LoraRequest("a", "/adapters/a"), LoraRequest("a", "/adapters/a", 0.5), LoraRequest("b", "/adapters/b")]
    keys = [batch_key(dataclasses.replace(request, lora=lora), engine.spec) for lora in [None, *loras]]
    assert len(set(keys)) == 4
    other = engine.preprocess(GenerationParams("other prompt", seed=9, **base))
    assert batch_key(dataclasses.replace(other, lora=LoraRequest("a", "/adapters/a")), engine.spec) == keys[1]
    with pytest.raises(ValueError, match="cannot share"):
        engine.step_batch(
            [
                engine.preprocess(GenerationParams("a", **base)),
                engine.preprocess(GenerationParams("b", height=64, width=80)),
            ]
        )


def test_two_http_requests_sent_at_once_share_a_call_and_each_gets_its_own_image(engine, tmp_path):
    """`vllm-omni serve --max-batch-size 2 --batch-wait-ms 60000`: the first request waits for
    company (not for the minute: the second fills the batch), and each answer is its own request's."""
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI
    from server_process import HTTP_TIMEOUT_S, decode_image, start_server

    args = ["tiny/qwen-image", "--max-batch-size", "2", "--batch-wait-ms", "60000", "--video-dir", str(tmp_path)]
    server = start_server(args, tmp_path / "server.log")
    try:
        client = OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=HTTP_TIMEOUT_S)

        def send(i: int):
            body = {"num_inference_steps": 2, "seed": SEEDS[i], "response_format": "b64_json"}
            return client.images.generate(model="tiny/qwen-image", prompt=PROMPTS[i], size="80x48", extra_body=body)

        with ThreadPoolExecutor(2) as pool:
            responses = list(pool.map(send, range(2)))
        assert "(a batch of 2)" in server.log()
    finally:
        server.close()
    for i, response in enumerate(responses):
        image = np.asarray(decode_image(response.data[0].b64_json).convert("RGB"), dtype=np.int16)
        params = GenerationParams(PROMPTS[i], height=48, width=80, num_inference_steps=2, seed=SEEDS[i])
        alone = engine.step(engine.preprocess(dataclasses.replace(params, output_type="uint8"))).images[0]
        assert np.abs(image - alone.astype(np.int16)).max() <= 1  # PNG of uint8 pixels; 1: rounding


def test_omni_batches_calls_from_two_threads_and_each_thread_sees_its_own_output(engine):
    """`Omni(max_batch_size=2, batch_wait_ms=60000)`: the first call waits for company (not for the
    minute: the second call fills the batch); each thread gets its own image and its own last_output."""
    from concurrent.futures import ThreadPoolExecutor

    args = dict(height=48, width=80, num_inference_steps=2, output_type="np")
    with Omni("tiny/qwen-image", max_batch_size=2, batch_wait_ms=60_000) as omni:

        def call(i: int):
            image = omni.generate(PROMPTS[i], seed=SEEDS[i], **args)[0]
            return image, omni.last_output

        with ThreadPoolExecutor(2) as pool:
            results = list(pool.map(call, range(2)))
        assert omni.last_output is None  # this thread made no call
    for i, (image, output) in enumerate(results):
        assert output.batch_size == 2 and output.seed == SEEDS[i]
        alone = engine.step(engine.preprocess(GenerationParams(PROMPTS[i], seed=SEEDS[i], **args))).images[0]
        np.testing.assert_allclose(image, alone, atol=1e-5, rtol=0)  # float pixels: reassociation only
    assert results[0][1].request_id != results[1][1].request_id


@pytest.mark.parametrize(
    ("model", "size"),
    [
        ("tiny/flux2", dict(height=48, width=64)),
        ("tiny/wan2.2-t2v", dict(height=48, width=80, num_frames=5)),  # both experts, CFG
        ("tiny/hunyuan-video-1.5", dict(height=144, width=208, num_frames=5)),  # the guider, two text encoders
    ],
)
def test_every_other_batchable_family_gives_each_row_its_request_alone(model, size):
    with Omni(model) as omni:
        engine = omni.engine

        def rows():
            return [
                engine.preprocess(GenerationParams(prompt, num_inference_steps=2, seed=seed, output_type="np", **size))
                for prompt, seed in zip(PROMPTS[:2], SEEDS[:2])
            ]

        assert engine.spec.batchable
        for request, out in zip(rows(), engine.step_batch(rows())):
            np.testing.assert_allclose(out.images[0], engine.step(request).images[0], atol=1e-5, rtol=0)
