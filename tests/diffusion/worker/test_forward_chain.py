"""The forward chain (worker/forward_chain.py): the only place wrappers are installed, and in what order.

No module of the package assigns a method on a live object (compiling a block's `forward` in place
is the one accepted idiom); a denoiser with every lever on lists its wrappers outermost first and
still computes what the bare model computes.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import torch
from tiny_qwen_transformer import QWEN_CONFIG, qwen_inputs

from vllm_omni.diffusion.config import StepCacheConfig
from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel
from vllm_omni.diffusion.worker.cfg_parallel import CFGParallel
from vllm_omni.diffusion.worker.forward_chain import chain_of, install_denoiser_chain
from vllm_omni.diffusion.worker.step_cache import CacheRecord
from vllm_omni.testing.graphs import SimulatedGraphs

PACKAGE = Path(__file__).resolve().parents[3] / "vllm_omni"
METHOD_ASSIGNED = re.compile(r"\.(forward|forward_sharded|step|decode|__call__)\s*=[^=]|setattr\(")
COMPILE_IDIOM = re.compile(r"^\s*module\.forward = torch\.compile\(module\.forward, ")


def test_no_module_assigns_a_method_on_a_live_object():
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if METHOD_ASSIGNED.search(line) and not COMPILE_IDIOM.match(line)
    ]
    assert found == []


def test_the_chain_with_every_lever_lists_its_wrappers_in_order_and_computes_the_bare_model():
    torch.manual_seed(0)
    bare = QwenImageTransformer2DModel(**QWEN_CONFIG).eval()
    model = QwenImageTransformer2DModel(**QWEN_CONFIG).eval()
    model.load_state_dict(bare.state_dict())
    cfg = CFGParallel(group=None)  # no exchange without CFG in the request: no group needed
    cache = CacheRecord(StepCacheConfig(threshold=0.5))
    counts: Counter = Counter()
    graphs = dict(backend=SimulatedGraphs())
    install_denoiser_chain(model, graphs, cfg, counts, "transformer", cache)
    assert chain_of(model) == [
        "vllm_omni.count_forwards",
        "vllm_omni.cfg_parallel",
        "vllm_omni.branch_context",
        "forward",
        "CachedForward",
        "CUDAGraphForward",
        "forward_sharded",
    ]
    cfg.start_request(False)
    cache.start_request(0.5, swapped=False)
    with torch.no_grad():
        expected = bare(**qwen_inputs())[0]
        actual = model(**qwen_inputs())[0]  # the first step computes: a capture, then its output
    torch.testing.assert_close(actual, expected, rtol=0, atol=0)
    assert counts == {"transformer": 1}
    assert cache.summary()["decisions"] == {"cond": {0: True}}
    assert model.sharded_wrapper.captures == 1
