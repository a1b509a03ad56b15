"""The loader's checks before any worker starts: the pipeline spec a checkpoint selects, and the
Ulysses degree against the heads of every denoiser (Wan2.2 A14B has two)."""

from __future__ import annotations

import json

import pytest

from vllm_omni.diffusion.model_source import check_ulysses_degree, read_pipeline_spec


def _folder(tmp_path, index: dict, heads: dict[str, int]):
    (tmp_path / "model_index.json").write_text(json.dumps(index))
    for name, count in heads.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps({"num_attention_heads": count}))
    return tmp_path


def test_the_degree_must_divide_every_experts_heads(tmp_path):
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "X"], "transformer_2": ["diffusers", "X"]}
    folder = _folder(tmp_path, index, {"transformer": 6, "transformer_2": 40})
    check_ulysses_degree(folder, 2)
    with pytest.raises(ValueError, match=r"ulysses_degree=3 does not divide the model's 40 attention heads"):
        check_ulysses_degree(folder, 3)


def test_the_error_names_the_ulysses_and_ring_pairs_the_heads_allow(tmp_path):
    """Z-Image's 30 heads: no Ulysses 4 or 8; 8 ranks split as Ulysses 2 x ring 4 or ring 8 alone."""
    index = {"_class_name": "ZImagePipeline", "transformer": ["diffusers", "X"]}
    folder = _folder(tmp_path, index, {"transformer": 30})
    check_ulysses_degree(folder, 2, ring_degree=4)
    with pytest.raises(ValueError) as error:
        check_ulysses_degree(folder, 8)
    assert "use one of [1, 2, 3, 5, 6, 10, 15, 30]" in str(error.value)
    pairs = "--ulysses-degree 2 --ring-degree 4 or --ulysses-degree 1 --ring-degree 8"
    assert f"for 8 sequence-parallel ranks (ulysses_degree x ring_degree), {pairs}" in str(error.value)
    with pytest.raises(ValueError, match="for 12 sequence-parallel ranks .*--ulysses-degree 6 --ring-degree 2 or "):
        check_ulysses_degree(folder, 4, ring_degree=3)


def test_ltx2_s_heads_must_split_over_every_sp_rank_ring_ranks_included(tmp_path):
    """LTX-2's cross-stream attention exchanges heads over the whole SP group: its spec says so, and Ulysses 2 x
    ring 3 (6 ranks) is refused for 32 heads though Ulysses 2 divides them; Ulysses 2 x ring 4 runs."""
    index = {"_class_name": "LTX2Pipeline", "transformer": ["diffusers", "X"]}
    folder = _folder(tmp_path, index, {"transformer": 32})
    over_sp_group = read_pipeline_spec(folder).heads_over_sp_group
    (tmp_path / "z").mkdir()
    z_image = read_pipeline_spec(_folder(tmp_path / "z", {"_class_name": "ZImagePipeline"}, {}))
    assert over_sp_group and not z_image.heads_over_sp_group
    check_ulysses_degree(folder, 2, ring_degree=3)  # Ulysses alone: what every other family needs
    check_ulysses_degree(folder, 2, ring_degree=4, over_sp_group=over_sp_group)
    with pytest.raises(ValueError, match=r"all 6 sequence-parallel ranks, .*size of \[1, 2, 4, 8, 16, 32\]"):
        check_ulysses_degree(folder, 2, ring_degree=3, over_sp_group=over_sp_group)


def test_an_absent_expert_is_not_checked(tmp_path):
    index = {"_class_name": "WanPipeline", "transformer": ["diffusers", "X"], "transformer_2": [None, None]}
    check_ulysses_degree(_folder(tmp_path, index, {"transformer": 24}), 3)  # 5B: 24 heads, no transformer_2


def test_one_class_selects_its_spec_by_the_model_index(tmp_path):
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "expand_timesteps": False}))
    assert read_pipeline_spec(tmp_path).size_multiple == 16  # A14B
    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "WanPipeline", "expand_timesteps": True}))
    five_b = read_pipeline_spec(tmp_path)
    assert (five_b.size_multiple, five_b.default_fps, five_b.family) == (32, 24, "wan22")


def test_qwen_image_layered_is_refused_at_start_naming_the_pipeline_and_why(tmp_path):
    from vllm_omni import Omni

    (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": "QwenImageLayeredPipeline"}))
    with pytest.raises(ValueError, match="'QwenImageLayeredPipeline' is not served: it returns several RGBA layers"):
        Omni(str(tmp_path))
