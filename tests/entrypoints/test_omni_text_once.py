"""Text encoded once per SP group: rank 0 of each group (of each CFG group under CFG parallel)
encodes the prompts and broadcasts the embeddings; its peers load no text encoder and give the
same images. Real worker processes on the CPU; their load lines say what each rank holds.
"""

from __future__ import annotations

import os
import re

import numpy as np

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

import pytest

from vllm_omni import Omni  # noqa: E402

pytestmark = pytest.mark.slow  # whole engines with worker processes (Omni)


def test_only_sp_rank_0_of_each_cfg_group_loads_the_text_encoder_and_images_are_unchanged(capfd):
    # In this process: the workers start after capfd, so their load lines land in it.
    args = dict(height=208, width=272, num_inference_steps=2, seed=3, output_type="np", negative_prompt="dull")
    with Omni("tiny/qwen-image") as omni:
        expected = omni.generate("a red bicycle against a blue wall", **args)[0]
    with Omni("tiny/qwen-image", ulysses_degree=2, cfg_parallel_size=2) as omni:
        actual = omni.generate("a red bicycle against a blue wall", **args)[0]
    err = capfd.readouterr().err
    assert float(np.abs(actual - expected).max()) <= 1e-5
    loads = dict(re.findall(r"Worker rank (\d) loaded .*? MiB of weights(.*)", err))
    # The U1 engine's rank 0, then ranks 0-3 of the CFG 2 x Ulysses 2 engine (rank = cfg_rank * 2 + sp_rank).
    without = {rank for rank, rest in loads.items() if "without text_encoder, tokenizer" in rest}
    assert loads.keys() == {"0", "1", "2", "3"} and without == {"1", "3"}, loads
    found = re.findall(r"Worker rank (\d) loaded .*?: (\S+) MiB of weights", err)
    weights = {int(rank): float(mib.replace(",", "")) for rank, mib in found}
    assert weights[1] < weights[2]  # the encoder's weights are not there
