"""Deploy YAML: a model's parallel layout, engine options and request defaults, read and checked.

A deploy file fixes a model's parallel layout and its request defaults:

    stages:
      - stage_id: 0
        devices: "0,1,2,3,4,5,6,7"
        parallel_config: {ulysses_degree: 8, mask_sp_padding: false}
        default_sampling_params: {num_inference_steps: 50, true_cfg_scale: 4.0}
        limits: {max_image_size: 2048}    # any EngineLimits field
        batching: {max_batch_size: 4, batch_wait_ms: 0}   # request batching (BatchingConfig)
        quantization: fp8                 # FP8 matmuls in the denoisers (diffusion/worker/quantization.py)
        cache: {policy: first_block, threshold: 0.08}   # step caching (StepCacheConfig, diffusion/worker/step_cache.py)

The option keys (each section's, and the stage's own such as `quantization`) are `EngineArgs`'
(diffusion/engine/args.py); unknown keys anywhere are errors naming the key and the file.
`vllm-omni serve` and `vllm-omni generate` (entrypoints/cli/) lay the flags given over a deploy's
options (`EngineArgs.from_layers`). Torch-free.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni.diffusion.config import DiffusionParallelConfig, StepCacheConfig
from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "deploy"

_TOP_KEYS = ("stages",)
# A stage's keys besides the options: which stage, which GPUs, the requests' defaults.
_DEPLOY_KEYS = ("stage_id", "devices", "default_sampling_params")
# Checked against ulysses_degree x ring_degree, never set: the parallel config derives it.
_DERIVED_PARALLEL_KEYS = ("sequence_parallel_size",)

# Request fields a deploy may give defaults for, with their types: all of them.
SAMPLING_PARAM_TYPES: dict[str, type] = {f.name: f.type for f in SAMPLING_FIELDS}


class DeployConfigError(ValueError):
    """A deploy file that cannot be used; the message names the file and the key."""


@dataclass
class DeployConfig:
    path: Path
    stage_id: int = 0
    devices: list[int] | None = None
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    # The engine options the file sets, by EngineArgs name (each value checked); flags override them.
    options: dict[str, Any] = field(default_factory=dict)
    _pinned: str | None = field(default=None, init=False, repr=False)  # what apply_devices set

    def apply_devices(self, engine: EngineArgs) -> None:
        """Pin the deploy's GPUs (CUDA_VISIBLE_DEVICES) before any worker starts; CPU runs ignore it.

        The indices count within an existing CUDA_VISIBLE_DEVICES (a scheduler's allocation), as
        CUDA would count them. Called before each replica's engine starts: once pinned, it stays
        (counting again within what it set would pick other GPUs).
        """
        if self.devices is None or engine.device == "cpu":
            return
        if self._pinned is not None and os.environ.get("CUDA_VISIBLE_DEVICES") == self._pinned:
            return
        parallel = engine.parallel_config
        needed = parallel.world_size * parallel.data_parallel_size
        if len(self.devices) < needed:
            raise ValueError(
                f"devices lists {len(self.devices)} GPU(s) but the parallel config needs {needed} "
                f"(world size {parallel.world_size} x data_parallel_size {parallel.data_parallel_size})"
            )
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        chosen = [str(d) for d in self.devices]
        if visible:
            allocated = [v.strip() for v in visible.split(",") if v.strip()]
            if max(self.devices) >= len(allocated):
                raise ValueError(
                    f"devices {self.devices} reach beyond CUDA_VISIBLE_DEVICES={visible} ({len(allocated)} GPU(s))"
                )
            chosen = [allocated[d] for d in self.devices]
        os.environ["CUDA_VISIBLE_DEVICES"] = self._pinned = ",".join(chosen)


def packaged_deploys() -> list[str]:
    """The names of the packaged deploy files (vllm_omni/deploy/NAME.yaml), sorted."""
    return sorted(p.stem for p in PACKAGED_DIR.glob("*.yaml"))


def resolve_deploy_path(name: str) -> Path:
    """A file path, or the name of a packaged deploy (`qwen_image` -> vllm_omni/deploy/qwen_image.yaml)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    packaged = PACKAGED_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if os.sep not in name and packaged.is_file():
        return packaged
    choices = ", ".join(packaged_deploys())
    raise DeployConfigError(f"deploy config {name!r} not found: not a file, nor a packaged deploy ({choices})")


def load_deploy_config(name: str | os.PathLike) -> DeployConfig:
    """Read and check a deploy YAML; every problem is a DeployConfigError naming the key."""
    import yaml

    path = resolve_deploy_path(str(name))
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise DeployConfigError(f"{path}: cannot read it as YAML: {exc}") from None

    def fail(message: str) -> DeployConfigError:
        return DeployConfigError(f"{path}: {message}")

    if not isinstance(data, dict):
        raise fail("expected a mapping with a 'stages' list at the top")
    _reject_unknown(data, _TOP_KEYS, "top-level", fail)
    stages = data.get("stages")
    if not isinstance(stages, list) or not stages:
        raise fail("'stages' must be a non-empty list")
    if len(stages) > 1:
        # The diffusion models served here are one DiT stage; multi-stage pipelines are not built.
        raise fail(f"'stages' has {len(stages)} entries; only single-stage deploys are supported")
    stage = stages[0]
    if not isinstance(stage, dict):
        raise fail("stages[0] must be a mapping")
    option_keys = EngineArgs.yaml_keys()
    sections = tuple(section for section in option_keys if section is not None)
    _reject_unknown(stage, _DEPLOY_KEYS + sections + tuple(option_keys[None]), "stages[0]", fail)

    stage_id = stage.get("stage_id", 0)
    if isinstance(stage_id, bool) or not isinstance(stage_id, int) or stage_id < 0:
        raise fail(f"stages[0].stage_id must be a non-negative integer, got {stage_id!r}")

    defaults = stage.get("default_sampling_params") or {}
    if not isinstance(defaults, dict):
        raise fail(f"stages[0].default_sampling_params must be a mapping, got {type(defaults).__name__}")
    _reject_unknown(defaults, tuple(SAMPLING_PARAM_TYPES), "stages[0].default_sampling_params", fail)
    for key, value in defaults.items():
        problem = _sampling_value_problem(key, value)
        if problem:
            raise fail(f"stages[0].default_sampling_params.{key} {problem}, got {value!r}")

    options: dict[str, Any] = {}
    for section, keys in option_keys.items():
        where = "stages[0]" if section is None else f"stages[0].{section}"
        values = stage if section is None else stage.get(section) or {}
        if not isinstance(values, dict):
            raise fail(f"{where} must be a mapping, got {type(values).__name__}")
        if section is not None:
            derived = _DERIVED_PARALLEL_KEYS if section == "parallel_config" else ()
            _reject_unknown(values, tuple(keys) + derived, where, fail)
        for key, name in keys.items():
            if key in values:
                try:
                    EngineArgs.check_value(name, values[key])  # the check of the config it feeds
                except (TypeError, ValueError) as exc:
                    message = str(exc)
                    # "max_frames must be ..." -> "stages[0].limits.max_frames must be ..."
                    named = message[len(key) :] if message.startswith(f"{key} ") else f": {message}"
                    raise fail(f"{where}.{key}{named}") from None
                options[name] = values[key]
    try:  # the parallel config's own checks across its keys (sequence_parallel_size, replicas' backend)
        DiffusionParallelConfig.from_dict(stage.get("parallel_config") or {})
    except (TypeError, ValueError) as exc:
        raise fail(f"stages[0].parallel_config: {exc}") from None
    if stage.get("cache") and "cache" not in options:
        options["cache"] = StepCacheConfig.policy  # a `cache` mapping turns the step cache on, at its default policy
    width, height = defaults.get("width"), defaults.get("height")
    if "warmup_size" not in options and width and height:
        options["warmup_size"] = (width, height)  # warm up at the size most requests use

    return DeployConfig(
        path=path,
        stage_id=stage_id,
        devices=_parse_devices(stage.get("devices"), fail),
        default_sampling_params=dict(defaults),
        options=options,
    )


def _reject_unknown(mapping: dict, allowed: tuple[str, ...], where: str, fail) -> None:
    unknown = [key for key in mapping if key not in allowed]
    if unknown:
        raise fail(f"unknown {where} key(s): {', '.join(map(repr, unknown))}; allowed keys: {', '.join(allowed)}")


def apply_sampling_defaults(values: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`values` (GenerationParams fields) with the deploy's defaults filling the ones left None."""
    merged = dict(values)
    for key, value in defaults.items():
        if merged.get(key) is None:
            merged[key] = value
    if values.get("true_cfg_scale") is None and merged.get("negative_prompt") is None:
        # True CFG needs a negative prompt; without one the engine samples plainly (scale 1).
        merged["true_cfg_scale"] = None
    return merged


def _sampling_value_problem(key: str, value: Any) -> str | None:
    kind = SAMPLING_PARAM_TYPES[key]
    if kind is str:
        return None if isinstance(value, str) else "must be a string"
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return "must be a number"
    if kind is int:
        if not isinstance(value, int):
            return "must be an integer"
        if key == "seed":
            return None if value >= 0 else "must be >= 0"
        if key == "priority":
            return None
        return None if value >= 1 else "must be >= 1"
    return None if value >= 0 else "must be >= 0"


def _parse_devices(value: Any, fail) -> list[int] | None:
    if value is None:
        return None
    items = value.split(",") if isinstance(value, str) else value if isinstance(value, list) else [value]
    try:
        devices = [int(str(item).strip()) for item in items]
    except ValueError:
        devices = []
    if not devices or any(d < 0 for d in devices) or len(set(devices)) != len(devices):
        raise fail(f'stages[0].devices must list distinct GPU indices, like "0,1" or [0, 1]; got {value!r}')
    return devices
