"""Tests for the tiny embedded Qwen-Image models (vllm_omni/diffusion/models/qwen_image/tiny.py).

Each tiny folder is built once per session and loaded with the real diffusers pipelines, so these
tests also check that the folders are complete checkpoints that run end to end on CPU.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from vllm_omni.diffusion.models.qwen_image import tiny
from vllm_omni.diffusion.models.qwen_image.tiny import TINY_MODELS, build_tiny_model, tiny_model_path

HEIGHT, WIDTH = 208, 240


@pytest.fixture(scope="session")
def tiny_folders(tmp_path_factory) -> dict[str, pathlib.Path]:
    root = tmp_path_factory.mktemp("tiny_qwen_image")
    folders = {}
    for name in TINY_MODELS:
        folders[name] = root / name.split("/")[1]
        build_tiny_model(name, folders[name])
    return folders


def _generator() -> torch.Generator:
    return torch.Generator("cpu").manual_seed(0)


def _source_image(width: int, height: int, seed: int) -> Image.Image:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _check_output(images: np.ndarray) -> None:
    assert images.shape == (1, HEIGHT, WIDTH, 3)
    assert np.isfinite(images).all()
    assert images.min() >= 0.0 and images.max() <= 1.0


def _load(name: str, folder: pathlib.Path):
    import diffusers

    pipe = getattr(diffusers, TINY_MODELS[name]).from_pretrained(folder)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def test_generate_runs(tiny_folders):
    pipe = _load("tiny/qwen-image", tiny_folders["tiny/qwen-image"])
    out = pipe(
        prompt="a red fox in the snow",
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        generator=_generator(),
        output_type="np",
    )
    _check_output(out.images)

    out_cfg = pipe(
        prompt="a red fox in the snow",
        negative_prompt=" ",
        true_cfg_scale=2.0,
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        generator=_generator(),
        output_type="np",
    )
    _check_output(out_cfg.images)


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
def test_edit_runs(tiny_folders):
    pipe = _load("tiny/qwen-image-edit", tiny_folders["tiny/qwen-image-edit"])
    out = pipe(
        image=_source_image(200, 150, seed=0),
        prompt="make the sky orange",
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        generator=_generator(),
        output_type="np",
    )
    _check_output(out.images)


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
def test_edit_plus_runs_with_two_images(tiny_folders):
    pipe = _load("tiny/qwen-image-edit-plus", tiny_folders["tiny/qwen-image-edit-plus"])
    assert pipe.transformer.config.zero_cond_t
    out = pipe(
        image=[_source_image(200, 150, seed=0), _source_image(120, 160, seed=1)],
        prompt="the person in picture 1 holds the cup from picture 2",
        height=HEIGHT,
        width=WIDTH,
        num_inference_steps=2,
        generator=_generator(),
        output_type="np",
    )
    _check_output(out.images)


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_template_offsets_drop_exactly_the_prefix(tiny_folders, name):
    pipe = _load(name, tiny_folders[name])
    template, start_idx = pipe.prompt_template_encode, pipe.prompt_template_encode_start_idx
    if name == "tiny/qwen-image":
        tokenizer = pipe.tokenizer
        prompt = "a red apple"
    else:
        # The edit pipelines tokenize through the processor; edit-plus prefixes "Picture N: " blocks.
        tokenizer = pipe.processor.tokenizer
        prompt = "Picture 1: <|vision_start|><|image_pad|><|vision_end|>make it blue"

    ids = tokenizer(template.format(prompt))["input_ids"]
    # What the pipeline keeps: the user turn's content, as tokenized on its own.
    user_content = template.split("<|im_start|>user\n", 1)[1].split("<|im_end|>", 1)[0].format(prompt)
    user_ids = tokenizer(user_content)["input_ids"]
    assert tokenizer.convert_ids_to_tokens(ids[start_idx - 3 : start_idx]) == ["<|im_start|>", "user", "Ċ"]
    assert ids[start_idx] == user_ids[0]
    assert ids[start_idx : start_idx + len(user_ids)] == user_ids

    # Where the user turn is only the prompt, an empty prompt leaves its closing token at the offset.
    if "<|im_start|>user\n{}<|im_end|>" in template:
        empty_ids = tokenizer(template.format(""))["input_ids"]
        assert empty_ids[start_idx] == tokenizer.convert_tokens_to_ids("<|im_end|>")


@pytest.mark.parametrize("name", sorted(TINY_MODELS))
def test_config_ties_and_size(tiny_folders, name):
    from transformers import Qwen2_5_VLConfig, Qwen2Tokenizer

    folder = tiny_folders[name]
    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    vae = json.loads((folder / "vae" / "config.json").read_text())
    text = Qwen2_5_VLConfig.from_pretrained(folder / "text_encoder")
    tokenizer = Qwen2Tokenizer.from_pretrained(folder / "tokenizer")

    # Same token grid as the real model: 8x VAE and 2x2 patches, 1328 px -> 83 tokens.
    assert len(vae["temperal_downsample"]) == 3 and transformer["patch_size"] == 2
    assert 1328 // 2 ** len(vae["temperal_downsample"]) // transformer["patch_size"] == 83
    assert transformer["in_channels"] == 4 * vae["z_dim"] == 64 and transformer["out_channels"] == 16
    assert transformer["num_attention_heads"] % 6 == 0
    assert sum(transformer["axes_dims_rope"]) == transformer["attention_head_dim"]
    assert all(d % 2 == 0 for d in transformer["axes_dims_rope"])
    assert transformer["zero_cond_t"] == (name == "tiny/qwen-image-edit-plus")

    tc = text.text_config
    assert transformer["joint_attention_dim"] == tc.hidden_size == text.vision_config.out_hidden_size
    head_dim = tc.hidden_size // tc.num_attention_heads
    assert sum(tc.rope_parameters["mrope_section"]) == head_dim // 2
    assert tc.vocab_size >= len(tokenizer)
    assert text.image_token_id == tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert text.video_token_id == tokenizer.convert_tokens_to_ids("<|video_pad|>")
    assert text.vision_start_token_id == tokenizer.convert_tokens_to_ids("<|vision_start|>")

    scheduler = json.loads((folder / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler["use_dynamic_shifting"] and scheduler["shift_terminal"] == 0.02
    assert (folder / "processor").is_dir() == (name != "tiny/qwen-image")

    weights = load_file(folder / "transformer" / "diffusion_pytorch_model.safetensors")
    assert all(t.dtype == torch.float32 for t in weights.values())
    size = sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
    assert size < 15 * 2**20


def test_build_is_deterministic(tiny_folders, tmp_path):
    build_tiny_model("tiny/qwen-image", tmp_path / "again")
    weights_file = pathlib.Path("transformer") / "diffusion_pytorch_model.safetensors"
    first = load_file(tiny_folders["tiny/qwen-image"] / weights_file)
    second = load_file(tmp_path / "again" / weights_file)
    assert first.keys() == second.keys()
    assert all(torch.equal(first[k], second[k]) for k in first)


def test_tiny_model_path_builds_once(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_CACHE", str(tmp_path))
    path = tiny_model_path("tiny/qwen-image")
    assert path == tmp_path / "tiny" / "qwen-image-v1"
    index = path / "model_index.json"
    mtime = index.stat().st_mtime_ns

    def no_rebuild(name, folder):
        raise AssertionError("tiny_model_path rebuilt a cached model")

    monkeypatch.setattr(tiny, "build_tiny_model", no_rebuild)
    assert tiny_model_path("tiny/qwen-image", cache_dir=str(tmp_path)) == path
    assert index.stat().st_mtime_ns == mtime
    # Only the finished folder is left behind, no temporary build dirs.
    assert sorted(os.listdir(path.parent)) == ["qwen-image-v1"]


def test_tiny_model_path_discards_build_that_lost_the_race(tiny_folders, tmp_path, monkeypatch):
    target = tmp_path / "tiny" / "qwen-image-v1"

    def build_while_another_process_wins(name, folder):
        shutil.copytree(tiny_folders[name], folder, dirs_exist_ok=True)
        shutil.copytree(tiny_folders[name], target)  # the other process renames first

    monkeypatch.setattr(tiny, "build_tiny_model", build_while_another_process_wins)
    assert tiny_model_path("tiny/qwen-image", cache_dir=str(tmp_path)) == target
    assert (target / "model_index.json").is_file()
    assert sorted(os.listdir(target.parent)) == ["qwen-image-v1"]


def test_unknown_name_raises():
    with pytest.raises(ValueError) as err:
        tiny_model_path("tiny/not-a-model")
    for name in TINY_MODELS:
        assert name in str(err.value)
    with pytest.raises(ValueError):
        build_tiny_model("Qwen/Qwen-Image", "/nonexistent")
