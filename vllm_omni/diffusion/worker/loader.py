"""Model id -> local diffusers folder -> pipeline spec.

A model is a tiny embedded model name (`tiny/qwen-image`, built once into a cache folder),
a local folder with model_index.json, or a hub id already in the Hugging Face cache
(nothing is downloaded here). Torch-free, so the engine can resolve a model before any
worker starts.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vllm_omni.diffusion.models.family import attention_heads
from vllm_omni.diffusion.models.registry import TINY_MODELS, PipelineSpec, spec_for

TINY_PREFIX = "tiny/"


class ModelNotFoundError(ValueError):
    pass


def resolve_model_path(model: str, download_dir: str | None = None) -> Path:
    """The local folder holding `model` (a diffusers pipeline with model_index.json); a hub id is looked up in
    `download_dir` (a Hugging Face cache folder; None: huggingface_hub's)."""
    if model.startswith(TINY_PREFIX):
        spec = TINY_MODELS.get(model)
        if spec is None:
            raise ModelNotFoundError(f"unknown tiny model {model!r}; tiny models: {', '.join(TINY_MODELS)}")
        return spec.family_module("tiny").tiny_model_path(model)
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / "model_index.json").is_file():
            raise ModelNotFoundError(f"{local} is a folder but has no model_index.json (not a diffusers pipeline)")
        return local.resolve()
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, local_files_only=True, cache_dir=download_dir))
    except Exception as exc:  # noqa: BLE001 - any miss means "not available locally"
        cache = os.environ.get("HF_HOME", "~/.cache/huggingface")
        raise ModelNotFoundError(
            f"model {model!r} not found: it is not a tiny model ({', '.join(TINY_MODELS)}), not a local "
            f"folder, and not in the Hugging Face cache ({cache}). "
            f"Download it first (huggingface-cli download {model}) or pass a local folder."
        ) from exc


def read_pipeline_spec(path: Path) -> PipelineSpec:
    try:
        index = json.loads((path / "model_index.json").read_text())
        class_name = index["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelNotFoundError(f"cannot read the pipeline class from {path / 'model_index.json'}: {exc}") from exc
    return spec_for(class_name, index)


def check_ulysses_degree(path: Path, ulysses_degree: int) -> None:
    """ValueError when `ulysses_degree` does not divide the attention heads of a denoiser (read from
    the config.json of every transformer* component, before any worker loads; the workers check the
    loaded models again)."""
    try:
        index = json.loads((path / "model_index.json").read_text())
    except (OSError, ValueError):
        return
    for name in sorted(index):
        if not name.startswith("transformer") or not isinstance(index[name], list) or index[name][0] is None:
            continue
        try:
            heads = attention_heads(json.loads((path / name / "config.json").read_text()))
        except (OSError, ValueError, TypeError):
            continue  # no readable config here: the workers' check still applies
        if isinstance(heads, int) and heads >= 1 and heads % ulysses_degree:
            raise ValueError(ulysses_degree_error(ulysses_degree, heads))


def ulysses_degree_error(ulysses_degree: int, heads: int) -> str:
    divisors = [d for d in range(1, heads + 1) if heads % d == 0]
    return f"ulysses_degree={ulysses_degree} does not divide the model's {heads} attention heads; use one of {divisors}"
