"""Deploy YAML and the engine settings that the CLI builds from it and from its flags.

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

`load_deploy_config` reads and checks one (unknown keys anywhere are errors naming the key);
`EngineSettings.resolve` lays the command-line flags the user actually gave on top of it.
`vllm-omni serve` and `vllm-omni generate` (entrypoints/cli/) call these. Torch-free.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from vllm_omni.diffusion.config import (
    QUANTIZATION_METHODS,
    BatchingConfig,
    DiffusionParallelConfig,
    EngineLimits,
    StepCacheConfig,
    normalize_dtype_name,
)
from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS

PACKAGED_DIR = Path(__file__).resolve().parent.parent / "deploy"

_TOP_KEYS = ("stages",)
_STAGE_KEYS = (
    "stage_id",
    "devices",
    "parallel_config",
    "default_sampling_params",
    "limits",
    "batching",
    "quantization",
    "cache",
)
_LIMIT_KEYS = tuple(f.name for f in dataclasses.fields(EngineLimits))

# Request fields a deploy may give defaults for, with their types: all of them.
SAMPLING_PARAM_TYPES: dict[str, type] = {f.name: f.type for f in SAMPLING_FIELDS}


class DeployConfigError(ValueError):
    """A deploy file that cannot be used; the message names the file and the key."""


@dataclass
class DeployConfig:
    path: Path
    stage_id: int = 0
    devices: list[int] | None = None
    parallel_config: dict[str, Any] = field(default_factory=dict)  # as written; checked by from_dict
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    limits: dict[str, int] = field(default_factory=dict)  # EngineLimits fields; flags override them
    batching: dict[str, Any] = field(default_factory=dict)  # BatchingConfig fields; flags override them
    quantization: str | None = None  # one of QUANTIZATION_METHODS; --quantization overrides it
    cache: dict[str, Any] | None = None  # StepCacheConfig fields; --cache / --cache-threshold override them


def resolve_deploy_path(name: str) -> Path:
    """A file path, or the name of a packaged deploy (`qwen_image` -> vllm_omni/deploy/qwen_image.yaml)."""
    path = Path(name).expanduser()
    if path.is_file():
        return path
    packaged = PACKAGED_DIR / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if os.sep not in name and packaged.is_file():
        return packaged
    choices = ", ".join(sorted(p.stem for p in PACKAGED_DIR.glob("*.yaml")))
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
    _reject_unknown(stage, _STAGE_KEYS, "stages[0]", fail)

    stage_id = stage.get("stage_id", 0)
    if isinstance(stage_id, bool) or not isinstance(stage_id, int) or stage_id < 0:
        raise fail(f"stages[0].stage_id must be a non-negative integer, got {stage_id!r}")

    parallel = stage.get("parallel_config") or {}
    if not isinstance(parallel, dict):
        raise fail(f"stages[0].parallel_config must be a mapping, got {type(parallel).__name__}")
    try:
        DiffusionParallelConfig.from_dict(parallel)  # unknown keys and bad values fail here, at start
    except (TypeError, ValueError) as exc:
        raise fail(f"stages[0].parallel_config: {exc}") from None

    defaults = stage.get("default_sampling_params") or {}
    if not isinstance(defaults, dict):
        raise fail(f"stages[0].default_sampling_params must be a mapping, got {type(defaults).__name__}")
    _reject_unknown(defaults, tuple(SAMPLING_PARAM_TYPES), "stages[0].default_sampling_params", fail)
    for key, value in defaults.items():
        problem = _sampling_value_problem(key, value)
        if problem:
            raise fail(f"stages[0].default_sampling_params.{key} {problem}, got {value!r}")

    limits = stage.get("limits") or {}
    if not isinstance(limits, dict):
        raise fail(f"stages[0].limits must be a mapping, got {type(limits).__name__}")
    _reject_unknown(limits, _LIMIT_KEYS, "stages[0].limits", fail)
    for key, value in limits.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(f"stages[0].limits.{key} must be a positive integer, got {value!r}")

    batching = _config_mapping(stage, "batching", BatchingConfig, fail) or {}

    quantization = stage.get("quantization")
    if quantization is not None and quantization not in QUANTIZATION_METHODS:
        raise fail(f"stages[0].quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {quantization!r}")

    cache = _config_mapping(stage, "cache", StepCacheConfig, fail)

    return DeployConfig(
        path=path,
        stage_id=stage_id,
        devices=_parse_devices(stage.get("devices"), fail),
        parallel_config=dict(parallel),
        default_sampling_params=dict(defaults),
        limits=dict(limits),
        batching=dict(batching),
        quantization=quantization,
        cache=dict(cache) if cache is not None else None,
    )


def _config_mapping(stage: dict, key: str, cls: type, fail) -> dict | None:
    """`stages[0].<key>`, a mapping of `cls`'s fields (checked by building one), or None when absent."""
    values = stage.get(key)
    if values is None:
        return None
    if not isinstance(values, dict):
        raise fail(f"stages[0].{key} must be a mapping, got {type(values).__name__}")
    _reject_unknown(values, tuple(f.name for f in dataclasses.fields(cls)), f"stages[0].{key}", fail)
    try:
        cls(**values)
    except ValueError as exc:
        raise fail(f"stages[0].{key}: {exc}") from None
    return values


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


@dataclass
class EngineSettings:
    """Everything needed to start an engine, after the YAML and the flags were merged."""

    model: str
    parallel_config: DiffusionParallelConfig
    device: str | None = None
    dtype: str | None = None
    attention_backend: str | None = None
    enforce_eager: bool = False
    quantization: str | None = None
    cache: StepCacheConfig | None = None
    ray_address: str | None = None
    limits: EngineLimits = field(default_factory=EngineLimits)
    batching: BatchingConfig = field(default_factory=BatchingConfig)
    default_sampling_params: dict[str, Any] = field(default_factory=dict)
    devices: list[int] | None = None
    deploy_config: Path | None = None
    warmup: bool | None = None  # None: on CUDA unless enforce_eager
    # Deadlines on the workers (OmniDiffusionConfig); None: its defaults (env var, else 600 / 300 s).
    load_timeout_s: float | None = None
    stall_timeout_s: float | None = None

    @classmethod
    def resolve(
        cls,
        model: str,
        *,
        deploy_config: str | None = None,
        parallel_overrides: dict[str, Any] | None = None,
        device: str | None = None,
        dtype: str | None = None,
        attention_backend: str | None = None,
        enforce_eager: bool = False,
        quantization: str | None = None,
        cache_overrides: dict[str, Any] | None = None,
        ray_address: str | None = None,
        limit_overrides: dict[str, Any] | None = None,
        batching_overrides: dict[str, Any] | None = None,
        warmup: bool | None = None,
        load_timeout_s: float | None = None,
        stall_timeout_s: float | None = None,
    ) -> EngineSettings:
        """YAML first, then every override that is not None (None means "the user did not give it")."""
        deploy = load_deploy_config(deploy_config) if deploy_config else None
        parallel = DiffusionParallelConfig.from_dict(deploy.parallel_config if deploy else None)
        given = {k: v for k, v in (parallel_overrides or {}).items() if v is not None}
        if given:
            parallel = parallel.replace(**given)
        given_limits = {k: v for k, v in (limit_overrides or {}).items() if v is not None}
        limits = EngineLimits(**{**(deploy.limits if deploy else {}), **given_limits})  # checks its values
        given_batching = {k: v for k, v in (batching_overrides or {}).items() if v is not None}
        batching = BatchingConfig(**{**(deploy.batching if deploy else {}), **given_batching})
        given_cache = {k: v for k, v in (cache_overrides or {}).items() if v is not None}
        deploy_cache = deploy.cache if deploy and deploy.cache is not None else None
        if given_cache and "policy" not in given_cache and deploy_cache is None:
            raise ValueError("--cache-threshold needs a cache: give --cache first_block (or stages[0].cache)")
        cache = StepCacheConfig(**{**(deploy_cache or {}), **given_cache}) if given_cache or deploy_cache else None
        if cache is not None and batching.max_batch_size > 1:
            raise ValueError(
                f"--cache with --max-batch-size {batching.max_batch_size}: a batch's rows would share one step "
                "cache; use one of them"
            )
        return cls(
            model=model,
            parallel_config=parallel,
            device=device,
            dtype=None if dtype is None else normalize_dtype_name(dtype),
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            quantization=quantization if quantization is not None else deploy.quantization if deploy else None,
            cache=cache,
            ray_address=ray_address,
            limits=limits,
            batching=batching,
            default_sampling_params=dict(deploy.default_sampling_params) if deploy else {},
            devices=deploy.devices if deploy else None,
            deploy_config=deploy.path if deploy else None,
            warmup=warmup,
            load_timeout_s=load_timeout_s,
            stall_timeout_s=stall_timeout_s,
        )

    def apply_devices(self) -> None:
        """Pin the deploy's GPUs (CUDA_VISIBLE_DEVICES) before any worker starts; CPU runs ignore it.

        The indices count within an existing CUDA_VISIBLE_DEVICES (a scheduler's allocation), as
        CUDA would count them.
        """
        if self.devices is None or self.device == "cpu":
            return
        needed = self.parallel_config.world_size * self.parallel_config.data_parallel_size
        if len(self.devices) < needed:
            raise ValueError(
                f"devices lists {len(self.devices)} GPU(s) but the parallel config needs {needed} "
                f"(world size {self.parallel_config.world_size} x data_parallel_size "
                f"{self.parallel_config.data_parallel_size})"
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
        os.environ["CUDA_VISIBLE_DEVICES"] = ",".join(chosen)

    def engine_config(self, replica: int = 0) -> Any:
        """The `OmniDiffusionConfig` for `DiffusionEngine` (of replica `replica` when data_parallel_size > 1)."""
        from vllm_omni.diffusion.config import OmniDiffusionConfig

        return OmniDiffusionConfig(
            replica=replica,
            model=self.model,
            parallel_config=self.parallel_config,
            device=self.device,
            dtype=self.dtype,
            attention_backend=self.attention_backend,
            enforce_eager=self.enforce_eager,
            quantization=self.quantization,
            cache=self.cache,
            warmup=self.warmup,
            warmup_size=self._warmup_size(),
            ray_address=self.ray_address,
            load_timeout_s=self.load_timeout_s,
            stall_timeout_s=self.stall_timeout_s,
        )

    def _warmup_size(self) -> tuple[int, int] | None:
        """The deploy's default size, which most requests use: warm up at it."""
        width, height = (self.default_sampling_params.get(k) for k in ("width", "height"))
        return (width, height) if width and height else None
