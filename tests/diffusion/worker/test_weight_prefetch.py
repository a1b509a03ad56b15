"""The engine's weight prefetch: what it reads, in which order, and when it stays out of the way."""

from __future__ import annotations

from pathlib import Path

import pytest

from vllm_omni.diffusion.worker import weight_prefetch
from vllm_omni.diffusion.worker.weight_prefetch import WeightPrefetch, weight_files


def _checkpoint(root: Path) -> dict[str, int]:
    sizes = {
        "vae/diffusion_pytorch_model.safetensors": 3_000,
        "text_encoder/model-00001-of-00002.safetensors": 70_000,
        "text_encoder/model-00002-of-00002.safetensors": 5_000,
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors": 40_000,
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors": 50_000,
        "scheduler/scheduler_config.json": 300,
        "tokenizer/vocab.json": 2_000,
        "model_index.json": 200,
    }
    for name, size in sizes.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(bytes(size))
    return sizes


def test_the_transformer_weights_come_first_then_the_rest_and_no_configs(tmp_path):
    _checkpoint(tmp_path)
    assert [str(p.relative_to(tmp_path)) for p in weight_files(tmp_path)] == [
        "transformer/diffusion_pytorch_model-00001-of-00002.safetensors",
        "transformer/diffusion_pytorch_model-00002-of-00002.safetensors",
        "text_encoder/model-00001-of-00002.safetensors",
        "text_encoder/model-00002-of-00002.safetensors",
        "vae/diffusion_pytorch_model.safetensors",
    ]


def test_every_weight_byte_is_read_once(tmp_path, monkeypatch):
    sizes = _checkpoint(tmp_path)
    monkeypatch.setattr(weight_prefetch, "CHUNK", 4096)  # several chunks per file
    prefetch = WeightPrefetch.start(tmp_path)
    assert prefetch is not None
    prefetch.join(timeout=30)
    assert prefetch.bytes_read == sum(size for name, size in sizes.items() if name.endswith(".safetensors"))


def test_stop_ends_the_reading_early(tmp_path):
    _checkpoint(tmp_path)
    prefetch = WeightPrefetch(weight_files(tmp_path))
    prefetch.stop()  # before it starts: it reads nothing
    prefetch._thread.start()
    prefetch.join(timeout=30)
    assert prefetch.bytes_read == 0


@pytest.mark.parametrize(
    "available, env, starts",
    [
        (10**9, None, True),
        (2 * 168_000, None, True),  # the weights (168 kB) are exactly half of it
        (2 * 168_000 - 2, None, False),  # more than half: they would evict each other
        (None, None, False),  # no /proc/meminfo: no way to tell
        (10**9, "0", False),  # switched off
    ],
)
def test_started_only_when_the_weights_fit_in_half_the_available_memory(tmp_path, monkeypatch, available, env, starts):
    _checkpoint(tmp_path)
    monkeypatch.setattr(weight_prefetch, "available_memory_bytes", lambda: available)
    if env is None:
        monkeypatch.delenv(weight_prefetch.ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(weight_prefetch.ENV_VAR, env)
    prefetch = WeightPrefetch.start(tmp_path)
    assert (prefetch is not None) == starts
    if prefetch is not None:
        prefetch.join(timeout=30)


def test_available_memory_is_read_from_meminfo():
    available = weight_prefetch.available_memory_bytes()
    if not Path("/proc/meminfo").is_file():
        assert available is None
    else:
        assert available is not None and available > 0
