"""DiffusionParallelConfig validation and `from_dict` (the deploy YAML path)."""

from __future__ import annotations

import pytest

from vllm_omni.diffusion.config import DiffusionParallelConfig, OmniDiffusionConfig, normalize_dtype_name


def test_defaults_are_the_fast_exact_path():
    config = DiffusionParallelConfig()
    assert (config.mask_sp_padding, config.trim_sp_padding, config.padding_mode) == (False, True, "trim")
    assert config.sequence_parallel_size == 1 and config.world_size == 1


def test_sequence_parallel_size_is_derived_and_checked():
    assert DiffusionParallelConfig(ulysses_degree=4, ring_degree=2).sequence_parallel_size == 8
    assert DiffusionParallelConfig(ulysses_degree=4, cfg_parallel_size=2).world_size == 8
    assert DiffusionParallelConfig(ulysses_degree=8, sequence_parallel_size=8).sequence_parallel_size == 8
    with pytest.raises(ValueError, match="sequence_parallel_size must equal ulysses_degree \\* ring_degree = 4"):
        DiffusionParallelConfig(ulysses_degree=4, sequence_parallel_size=8)


def test_padding_modes():
    assert DiffusionParallelConfig(mask_sp_padding=True).padding_mode == "mask"
    assert DiffusionParallelConfig(mask_sp_padding=True, trim_sp_padding=False).padding_mode == "mask"
    assert DiffusionParallelConfig(trim_sp_padding=False).padding_mode == "none"


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"ulysses_degree": 0}, "ulysses_degree"),
        ({"ulysses_degree": "8"}, "ulysses_degree"),
        ({"ulysses_degree": True}, "ulysses_degree"),
        ({"ring_degree": -1}, "ring_degree"),
        ({"cfg_parallel_size": 3}, "cfg_parallel_size must be 1 or 2"),
        ({"sequence_parallel_size": 0}, "sequence_parallel_size"),
        ({"mask_sp_padding": "yes"}, "mask_sp_padding must be a boolean"),
        ({"trim_sp_padding": 1}, "trim_sp_padding must be a boolean"),
    ],
)
def test_invalid_values_name_the_field_and_allowed_values(kwargs, field):
    with pytest.raises(ValueError, match=field):
        DiffusionParallelConfig(**kwargs)


def test_from_dict_accepts_every_field_and_rejects_unknown_keys():
    config = DiffusionParallelConfig.from_dict(
        {"sequence_parallel_size": 8, "ulysses_degree": 8, "ring_degree": 1, "mask_sp_padding": True}
    )
    assert config.ulysses_degree == 8 and config.padding_mode == "mask"
    assert DiffusionParallelConfig.from_dict(None) == DiffusionParallelConfig()
    with pytest.raises(
        ValueError, match="unknown parallel_config key\\(s\\): 'mask_padding'.*allowed keys: ulysses_degree"
    ):
        DiffusionParallelConfig.from_dict({"ulysses_degree": 2, "mask_padding": True})
    with pytest.raises(ValueError, match="must be a mapping"):
        DiffusionParallelConfig.from_dict([("ulysses_degree", 2)])


def test_replace_rederives_sequence_parallel_size():
    config = DiffusionParallelConfig(ulysses_degree=2).replace(ulysses_degree=4)
    assert config.sequence_parallel_size == 4


def test_omni_config_validation():
    import torch

    assert OmniDiffusionConfig("m", dtype=torch.bfloat16).dtype == "bfloat16"
    assert normalize_dtype_name("fp16") == "float16"
    with pytest.raises(ValueError, match="dtype must be one of float32, bfloat16, float16"):
        OmniDiffusionConfig("m", dtype="int8")
    with pytest.raises(ValueError, match="device must be 'cpu' or 'cuda'"):
        OmniDiffusionConfig("m", device="tpu")
    with pytest.raises(ValueError, match="model must be"):
        OmniDiffusionConfig("  ")
