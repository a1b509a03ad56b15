"""`EngineArgs`: every engine option declared once, with the faces and the checks generated from it.

A field carries its help, flag, help group, the config it feeds (which is also its deploy-YAML
place) and whether only a server uses it (`server_only`: no `generate` flag). The `serve`/`generate`
flags, the deploy YAML's keys (entrypoints/deploy_config.py) and `Omni(model, **options)` all come from here;
`validate()` holds every check across options.
Torch-free (only config.py at module level), so `--help` stays fast.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from vllm_omni import envs
from vllm_omni.diffusion.config import (
    ATTENTION_BACKENDS,
    CACHE_POLICIES,
    CPU_OFFLOAD_MODES,
    DTYPES,
    EXECUTOR_BACKENDS,
    MAX_NUM_SEQS,
    QUANTIZATION_METHODS,
    SCHEDULING_POLICIES,
    Admission,
    BatchingConfig,
    DiffusionParallelConfig,
    EngineLimits,
    OmniDiffusionConfig,
    StepCacheConfig,
    normalize_dtype_name,
)

# ---- flag value parsers (argparse `type=`) --------------------------------------------------------


def _number(text: str, cast: Callable[[str], Any], ok: Callable[[Any], bool], expected: str) -> Any:
    try:
        value = cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text!r}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _number(text, int, lambda value: value >= 1, "a positive integer")


def non_negative_int(text: str) -> int:
    return _number(text, int, lambda value: value >= 0, "an integer >= 0")


def positive_seconds(text: str) -> float:
    return _number(text, float, lambda value: math.isfinite(value) and value > 0, "a positive number of seconds")


def non_negative_float(text: str) -> float:
    return _number(text, float, lambda value: math.isfinite(value) and value >= 0, "a number >= 0")


def width_x_height(text: str) -> tuple[int, int]:
    width, sep, height = text.lower().partition("x")
    try:
        size = (int(width), int(height))
    except ValueError:
        size = (0, 0)
    if not sep or min(size) < 1:
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT in pixels, like 1024x1024, got {text!r}")
    return size


def _lora_module_text(value: Any) -> str | None:
    """A mapping's adapter value as the flag writes it: a path, or a pair's list ([high, low]) as 'high,low'; None
    for anything else (the config refuses it)."""
    if isinstance(value, (list, tuple)) and all(isinstance(item, str) for item in value):
        return ",".join(value)
    return value if isinstance(value, str) else None


# ---- declaring an option ----------------------------------------------------------------------

# The config an option feeds -> (its class, its section of a deploy YAML's stage; None: the stage itself).
CONFIGS: dict[str, tuple[type, str | None]] = {
    "parallel": (DiffusionParallelConfig, "parallel_config"),
    "engine": (OmniDiffusionConfig, None),
    "limits": (EngineLimits, "limits"),
    "batching": (BatchingConfig, "batching"),
    "cache": (StepCacheConfig, "cache"),
}

PARALLEL = "parallelism (world size = cfg_parallel_size * ulysses_degree * ring_degree)"
ENGINE = "engine"
MODEL = "model source"
LIMITS = "limits (requests beyond them are refused with 400 naming the field)"
QUEUE = "queue and batching"
LORA = "LoRA adapters"

_UNSET = object()


def option(
    config: str,
    help: str,
    group: str,
    *,
    key: str | None = None,
    default: Any = _UNSET,
    flag: str | None = None,
    default_text: str | Callable[[dataclasses.Field], str] | None = None,
    server_only: bool = False,
    **cli: Any,
) -> Any:
    """An `EngineArgs` field that feeds `config` (a CONFIGS name) as its field `key` (default: the option's name).

    The default is that config field's own (`_config_defaults`), unless given. `flag` defaults to
    `--the-name`; `cli` holds argparse extras (type, choices, metavar, action); `default_text` is
    appended to the help as "(default: ...)". `server_only`: what one `generate` run never uses (the queue,
    replicas, warm-up, adapters loaded at run time): a flag of `serve` only, still a YAML key and an `Omni` keyword.
    """
    metadata = {"config": config, "key": key, "help": help, "group": group, "flag": flag, "cli": cli}
    metadata |= {"default_text": default_text, "server_only": server_only}
    return field(default=default, metadata=metadata)


def _limit(text: str) -> Any:
    return option("limits", text, LIMITS, type=positive_int, metavar="N", default_text=_limit_default)


def _limit_default(f: dataclasses.Field) -> str:
    """An EngineLimits default, or for max_tokens_per_step each family's own."""
    if f.default is not None:
        return str(f.default)
    from vllm_omni.diffusion.models.registry import FAMILIES  # the model's own (models/registry.py)

    return "the model's: " + ", ".join(f"{fam.package} {getattr(fam.specs[0], f.name)}" for fam in FAMILIES)


def _config_defaults(cls: type) -> type:
    """An option's default is the one of the config field it feeds, read off that config (one source)."""
    for name, value in list(vars(cls).items()):
        if isinstance(value, dataclasses.Field) and value.default is _UNSET:
            config_class, _ = CONFIGS[value.metadata["config"]]
            key = value.metadata["key"] or name
            value.default = next(f.default for f in dataclasses.fields(config_class) if f.name == key)
    return cls


_CACHE_DEFAULT = StepCacheConfig()
_BATCHING_DEFAULT = BatchingConfig()
_LIMITS_DEFAULT = EngineLimits()


@dataclass(frozen=True)
@_config_defaults
class EngineArgs:
    """Every option of the engine. `EngineArgs("tiny/qwen-image", ulysses_degree=2).engine_config()`."""

    model: str  # the one positional: `serve MODEL`, `Omni(MODEL)`; a deploy YAML is written for a model

    download_dir: str | None = option(
        "engine",
        "where hub models are downloaded and looked up: a Hugging Face cache folder (vLLM's flag) (default: the "
        "Hugging Face cache, HF_HUB_CACHE or HF_HOME/hub)",
        MODEL,
        metavar="DIR",
    )
    revision: str | None = option(
        "engine",
        "the hub model's branch, tag or commit (vLLM's flag) (default: main)",
        MODEL,
        metavar="REVISION",
    )

    ulysses_degree: int = option(
        "parallel",
        "Ulysses sequence-parallel degree: GPUs (or CPU worker processes) that split each request; "
        "must divide the model's attention heads (default: 1)",
        PARALLEL,
        type=positive_int,
        metavar="N",
    )
    ring_degree: int = option(
        "parallel",
        "ring attention degree: the SP ranks are ulysses_degree x ring_degree, the Ulysses all-to-all within each "
        "run of ulysses_degree ranks and key/value blocks passed around a ring across them (USP): SP degrees the "
        "heads do not divide, and across machines (default: 1)",
        PARALLEL,
        type=positive_int,
        metavar="N",
    )
    cfg_parallel_size: int = option(
        "parallel",
        "2 runs the positive and negative CFG branches on separate ranks (default: 1)",
        PARALLEL,
        type=positive_int,
        metavar="N",
    )
    mask_sp_padding: bool = option(
        "parallel",
        "mask the SP padding tokens (exact, masked attention kernel) instead of trimming them "
        "(default: off; --no-mask-sp-padding overrides a deploy YAML that turns it on)",
        PARALLEL,
    )
    trim_sp_padding: bool = option(
        "parallel",
        "with the mask off, slice the SP padding off after the all-to-all (exact, dense kernel); "
        "--no-trim-sp-padding leaves it in unmasked (dense, approximate, warns once) (default: on)",
        PARALLEL,
    )
    data_parallel_size: int = option(
        "parallel",
        "replicas: N groups of cfg_parallel_size x ulysses_degree x ring_degree ranks, each on its own GPUs, "
        "behind one queue; a request runs on an idle replica (default: 1)",
        PARALLEL,
        server_only=True,
        type=positive_int,
        metavar="N",
    )
    vae_parallel: bool | None = option(
        "parallel",
        "tile the VAE decode and split the tiles over every rank (equal to one rank's tiled decode); "
        "--no-vae-parallel decodes whole on every rank (default: on with several ranks at sizes where it pays, "
        "and where the rank cannot allocate the untiled decode)",
        PARALLEL,
    )
    distributed_executor_backend: str = option(
        "parallel",
        "who starts the ranks: mp, one process each on this machine; ray, one Ray actor each, across the "
        "machines of a Ray cluster (pip install -e '.[ray]'; docs/multinode.md) (default: mp)",
        PARALLEL,
        choices=EXECUTOR_BACKENDS,
    )
    ray_address: str | None = option(
        "engine",
        "with --distributed-executor-backend ray: the cluster to join, 'auto' (the one `ray start` runs on "
        "this machine) or HEAD_IP:6379 (default: a private Ray instance on this machine; RAY_ADDRESS is not read)",
        PARALLEL,
        metavar="ADDRESS",
    )

    device: str | None = option(
        "engine",
        "where the workers run (default: cuda when there are world-size GPUs, else cpu)",
        ENGINE,
        choices=("cuda", "cpu"),
    )
    dtype: str | None = option(
        "engine", f"weights and activations: {', '.join(DTYPES)} (default: bfloat16 on cuda, float32 on cpu)", ENGINE
    )
    quantization: str | None = option(
        "engine",
        "fp8: the denoisers' large linear layers run FP8 matmuls (torchao float8 dynamic activation and "
        "weight, row-wise scales; CUDA GPUs of compute capability 8.9+, bfloat16; pip install -e '.[fp8]'); "
        "YAML stages[0].quantization (default: none)",
        ENGINE,
        choices=QUANTIZATION_METHODS,
    )
    cache: str | None = option(
        "cache",
        "step caching in the denoisers: first_block (diffusers' First-Block-Cache: a step whose first block "
        "changed little since the last computed step skips the other blocks; decided for the whole SP group); "
        "YAML stages[0].cache (default: none)",
        ENGINE,
        key="policy",
        default=None,  # no step cache; a YAML `cache` mapping turns it on
        choices=CACHE_POLICIES,
    )
    cache_threshold: float | None = option(
        "cache",
        f"the step cache's threshold: higher skips more steps (default: {_CACHE_DEFAULT.threshold})",
        ENGINE,
        key="threshold",
        default=None,  # StepCacheConfig's
        type=float,  # the cache config's check names the field, for flags and YAML alike
        metavar="X>0",
    )
    cpu_offload: str = option(
        "engine",
        "where weights wait between their phases: auto (the first of none, encoders, model, layerwise in which the "
        "model's default request fits on the GPU: the same weights and arithmetic, agreed by every rank; the start "
        "line says which); none (on the GPU, or refused); encoders (the text encoders and the VAE in pinned CPU "
        "memory until their phase, the denoisers on the GPU); model (each component, each denoiser too, in pinned "
        "CPU memory until its phase); layerwise (the blocks of every component streamed from pinned CPU memory, the "
        "next one prefetched on a side stream: diffusers' group offloading). Model and layerwise turn CUDA graphs "
        "off (the weights move); all compose with --quantization fp8 (each layer converted on the GPU, then "
        "offloaded); YAML stages[0].cpu_offload",
        ENGINE,
        choices=CPU_OFFLOAD_MODES,
        default_text="auto",
    )
    gpu_memory_utilization: float = option(
        "engine",
        "the share of each GPU the engine may use: the memory plan at start must fit in it (or the start is "
        "refused, saying which settings would fit), and allocations beyond it fail (vLLM's flag)",
        ENGINE,
        type=float,
        metavar="FRACTION",
        default_text="0.9",
    )
    lora_modules: tuple[str, ...] | None = option(
        "engine",
        "LoRA adapters to serve, as NAME=PATH (a folder or a .safetensors file, in a format diffusers reads; every "
        "denoiser reads it), or NAME=HIGH,LOW (a file per expert of a two-expert model: high noise, low noise); a "
        'request selects one with `model: NAME` or `lora: {"name": NAME, "scale": 1.0}` (vLLM\'s flag); YAML '
        "stages[0].lora_modules, a mapping (a pair as a list) or a list",
        LORA,
        nargs="+",
        metavar="NAME=PATH",
    )
    max_loras: int = option(
        "engine",
        "adapters whose factors stay on each GPU; more wait on the CPU (vLLM's flag)",
        LORA,
        type=positive_int,
        metavar="N",
        default_text="4",
    )
    max_cpu_loras: int | None = option(
        "engine",
        "adapters whose factors stay in CPU memory, least recently used dropped first (default: --max-loras)",
        LORA,
        type=positive_int,
        metavar="N",
    )
    max_lora_rank: int = option(
        "engine",
        "the largest adapter rank accepted; a higher one is refused when it is loaded (vLLM's flag)",
        LORA,
        type=positive_int,
        metavar="RANK",
        default_text="128",
    )
    allow_runtime_lora: bool = option(
        "engine",
        "allow POST /v1/load_lora_adapter and /v1/unload_lora_adapter while serving",
        LORA,
        server_only=True,
        action="store_true",
    )
    attention_backend: str | None = option(
        "engine",
        "attention kernel: sdpa (dense), sdpa_masked, or a lossy low-precision one on Hopper or newer: cudnn_fp8 "
        "(cuDNN's FP8 attention, FP8 output; needs pip install -e '.[fp8]'), triton_int8 (INT8 Q.K, 16-bit P.V, "
        "bf16 output; Triton), triton_int8_fp8pv (P.V in FP8 too) or triton_int8_int8pv (P.V in INT8); or "
        "flash_attn_4 (exact: FlashAttention 4's kernels for dense calls on Hopper or newer; needs pip install -e "
        "'.[fa4]') (default: sdpa_masked when the padding is masked; else flash_attn_4 on a Hopper GPU where it is "
        "installed and CUDA graphs are on, else sdpa; "
        f"env {envs.ATTENTION_BACKEND})",
        ENGINE,
        choices=ATTENTION_BACKENDS,
    )
    fp8_attention_full_steps: int = option(
        "engine",
        "with a lossy attention backend (cudnn_fp8 or a triton_int8 one), the first and the last N "
        "denoising steps run exact attention",
        ENGINE,
        type=non_negative_int,
        metavar="N",
        default_text="2",
    )
    warmup: bool | None = option(
        "engine",
        "run one short request at the deploy's default size once the workers are up, before /health "
        "answers 200, so the first user request does not pay compilation and graph capture "
        "(default: on for CUDA, off for CPU and with --enforce-eager)",
        ENGINE,
        server_only=True,
    )
    warmup_size: tuple[int, int] | None = option(
        "engine",
        "the warm-up request's width x height (default: the deploy's default size, else the pipeline's)",
        ENGINE,
        server_only=True,
        type=width_x_height,
        metavar="WxH",
    )
    enforce_eager: bool = option(
        "engine",
        "run the transformer eagerly: no CUDA graphs (CUDA only; CPU always runs eagerly)",
        ENGINE,
        action="store_true",
    )
    cfg_one_pass: bool | None = option(
        "engine",
        "run a CFG step's prompt and negative-prompt rows as one forward where both fit the envelope; "
        "--no-cfg-one-pass: two forwards a step (default: only under layerwise offload, where the weights then cross "
        "to the GPU once a step; with them resident one row already fills the GPU at the default sizes)",
        ENGINE,
    )
    load_timeout_s: float | None = option(
        "engine",
        "every worker must have loaded the model within this, or the start fails "
        f"(default: env {envs.LOAD_TIMEOUT_S}, else 600)",
        ENGINE,
        flag="--load-timeout",
        type=positive_seconds,
        metavar="SECONDS",
    )
    stall_timeout_s: float | None = option(
        "engine",
        "a request in which no worker reports progress (a finished step) for this long fails and the "
        f"workers restart (default: env {envs.STALL_TIMEOUT_S}, else 300)",
        ENGINE,
        flag="--stall-timeout",
        type=positive_seconds,
        metavar="SECONDS",
    )

    max_image_size: int = _limit("largest width or height of an output image, in pixels")
    max_steps: int = _limit("largest num_inference_steps a request may ask for")
    max_n: int = _limit("most images (n) one request may ask for")
    max_input_images: int = _limit("most source images one edit request may upload")
    max_upload_bytes: int = _limit("largest uploaded image file, in bytes")
    max_input_pixels: int = _limit(
        "largest decoded source image, width*height (uploads claiming more are refused before decoding)"
    )
    max_prompt_tokens: int = _limit(
        "longest prompt (and negative prompt), in the model's tokens; a pipeline that reads fewer refuses "
        "beyond its own limit"
    )
    max_frames: int = _limit("most video frames one request may ask for")
    max_fps: int = _limit("largest video fps a request may ask for")
    max_tokens_per_step: int | None = _limit(
        "most image (video) tokens one denoising step may process: the output's latent patches x latent frames, "
        "plus reference images' tokens where the model adds them; bounds a step's time against --stall-timeout"
    )

    max_queue: int = option(
        "limits",
        f"requests that may wait behind the running one; more get 429 (default: {_LIMITS_DEFAULT.max_queue})",
        QUEUE,
        server_only=True,
        type=positive_int,
        metavar="N",
    )
    scheduling_policy: str = option(
        "engine",
        "which waiting request runs next: fcfs (arrival order); priority (the lowest `priority` request field "
        "first, ties by arrival; vLLM's); fair (the least work first, steps x tokens per step x images, but a "
        "request that 4 later ones have overtaken goes next). With --max-num-seqs above 1, fair and priority "
        "also run such a request inside the running one, from its next step; YAML stages[0].scheduling_policy",
        QUEUE,
        server_only=True,
        choices=SCHEDULING_POLICIES,
        default_text="fair",
    )
    max_num_seqs: int = option(
        "engine",
        "requests in flight on one worker group at once (vLLM's name): under fair or priority a queued request "
        "that goes before the running one runs inside it, from its next denoising step, and the running one then "
        f"goes on where it was (its image unchanged); 1: a running request is never preempted (at most "
        f"{MAX_NUM_SEQS}; YAML stages[0].max_num_seqs)",
        QUEUE,
        server_only=True,
        type=positive_int,
        metavar="N",
        default_text=lambda f: str(f.default),
    )
    max_batch_size: int = option(
        "batching",
        "request batching: up to N queued requests that can share a forward (same size, frames, steps and "
        "guidance; n=1, no source images) run as one pipeline call, each with its own seed (default: "
        f"{_BATCHING_DEFAULT.max_batch_size}, off; YAML stages[0].batching)",
        QUEUE,
        server_only=True,
        type=positive_int,
        metavar="N",
    )
    batch_wait_ms: float = option(
        "batching",
        "how long a request that could be batched waits for company before it runs alone "
        f"(default: {_BATCHING_DEFAULT.batch_wait_ms:g})",
        QUEUE,
        server_only=True,
        type=non_negative_float,
        metavar="MS",
    )

    def __post_init__(self) -> None:
        if self.dtype is not None:  # 'bf16' and torch.bfloat16 are 'bfloat16' from here on
            object.__setattr__(self, "dtype", normalize_dtype_name(self.dtype))
        if isinstance(self.warmup_size, list):  # YAML's [width, height]
            object.__setattr__(self, "warmup_size", tuple(self.warmup_size))
        if isinstance(self.lora_modules, dict):  # YAML's mapping; hashable like the flag's list
            texts = {k: _lora_module_text(v) for k, v in self.lora_modules.items()}
            if None not in texts.values():  # else left as given: the config refuses it
                object.__setattr__(self, "lora_modules", tuple(f"{k}={v}" for k, v in texts.items()))
        elif isinstance(self.lora_modules, (list, str)):
            items = [self.lora_modules] if isinstance(self.lora_modules, str) else self.lora_modules
            object.__setattr__(self, "lora_modules", tuple(items))

    # ---- the options ---------------------------------------------------------------------------

    @classmethod
    def options(cls) -> tuple[dataclasses.Field, ...]:
        """Every engine option (every field but `model`), in declaration order."""
        return tuple(f for f in dataclasses.fields(cls) if "config" in f.metadata)

    @classmethod
    def option_names(cls) -> tuple[str, ...]:
        return tuple(f.name for f in cls.options())

    @classmethod
    def server_only_names(cls) -> tuple[str, ...]:
        """The options only a server uses: flags of `serve`, not of `generate`."""
        return tuple(f.name for f in cls.options() if f.metadata["server_only"])

    def values(self) -> dict[str, Any]:
        """The options as `Omni` keywords: `Omni(args.model, **args.values())`."""
        return {name: getattr(self, name) for name in self.option_names()}

    # ---- the configs the engine consumes -------------------------------------------------------

    def _config_values(self, config: str) -> dict[str, Any]:
        """The options that feed `config`, by that config's field names; None leaves the config's default."""
        values = {}
        for f in self.options():
            if f.metadata["config"] == config and getattr(self, f.name) is not None:
                values[f.metadata["key"] or f.name] = getattr(self, f.name)
        return values

    @cached_property
    def parallel_config(self) -> DiffusionParallelConfig:
        return DiffusionParallelConfig(**self._config_values("parallel"))

    @cached_property
    def limits(self) -> EngineLimits:
        return EngineLimits(**self._config_values("limits"))

    @cached_property
    def batching(self) -> BatchingConfig:
        return BatchingConfig(**self._config_values("batching"))

    @cached_property
    def step_cache(self) -> StepCacheConfig | None:
        """The step cache; None when `cache` is unset."""
        return None if self.cache is None else StepCacheConfig(**self._config_values("cache"))

    def engine_config(self, replica: int = 0) -> OmniDiffusionConfig:
        """The `OmniDiffusionConfig` for `DiffusionEngine` (of replica `replica` when data_parallel_size > 1)."""
        return OmniDiffusionConfig(
            model=self.model,
            parallel_config=self.parallel_config,
            cache=self.step_cache,
            replica=replica,
            # The rows a forward may hold; the engine adds the tokens (the model's default request, the token limit).
            admission=Admission(0, 0, max(self.limits.max_n, self.batching.max_batch_size)),
            **self._config_values("engine"),
        )

    # ---- checks --------------------------------------------------------------------------------

    def validate(self) -> EngineArgs:
        """Every check: each config's own (it checks itself when built), then the ones across options.

        Every face calls it (the CLI and the deploy YAML through `from_layers`, `Omni` through
        `from_kwargs`), so a combination is refused with the same words wherever it was given.
        """
        _ = (self.parallel_config, self.limits, self.batching, self.step_cache, self.engine_config())
        if self.cache_threshold is not None and self.cache is None:
            raise ValueError(
                "--cache-threshold needs a cache: give --cache first_block (or stages[0].cache, or Omni's "
                'cache="first_block")'
            )
        if self.lora_modules or self.allow_runtime_lora:
            for other, value, off in (
                ("--quantization", self.quantization, None),
                ("--cpu-offload", self.cpu_offload, "none"),
            ):
                # auto and encoders keep the denoisers, which adapters are merged into, on the GPU
                if value not in (off, "auto", "encoders"):
                    raise ValueError(
                        f"LoRA adapters with {other} {value}: adapters are merged into the denoisers' weights, which "
                        + (
                            "FP8 holds in 8 bits (merging would quantize the update away and could not be undone "
                            "exactly)"
                            if other == "--quantization"
                            else "offload moves between devices (the merge and its exact undo are not built for that)"
                        )
                        + "; use one of them"
                    )
        if self.cache is not None and self.batching.max_batch_size > 1:
            raise ValueError(
                f"--cache with --max-batch-size {self.batching.max_batch_size}: a batch's rows would share one step "
                "cache; use one of them"
            )
        return self

    @classmethod
    def check_value(cls, name: str, value: Any) -> None:
        """The check of one option's value alone, by the config it feeds (how the YAML loader names the key)."""
        f = next(f for f in cls.options() if f.name == name)
        config_class, _ = CONFIGS[f.metadata["config"]]
        values = {f.metadata["key"] or name: value}
        if config_class is OmniDiffusionConfig:
            values["model"] = "-"
        config_class(**values)

    # ---- the faces -----------------------------------------------------------------------------

    @classmethod
    def from_layers(cls, model: str, *layers: dict[str, Any]) -> EngineArgs:
        """Options laid over the defaults, a later layer over an earlier (the deploy YAML's, then the flags given);
        checked."""
        merged: dict[str, Any] = {}
        for layer in layers:
            merged.update(layer)
        return cls(model, **merged).validate()

    @classmethod
    def from_kwargs(cls, model: str, **kwargs: Any) -> EngineArgs:
        """`Omni(model, **kwargs)`: the options by name; an unknown name is a TypeError naming it.

        Two shorthands of the earlier keywords stay: `limits=EngineLimits(...)` sets the max_* options,
        and `cache=StepCacheConfig(...)` sets cache and cache_threshold.
        """
        unknown = sorted(set(kwargs) - set(cls.option_names()) - {"limits"})
        if unknown:
            raise TypeError(
                f"unknown engine option(s) {', '.join(unknown)}; EngineArgs takes: {', '.join(cls.option_names())}"
            )
        limits = kwargs.pop("limits", None)
        if limits is not None:
            if not isinstance(limits, EngineLimits):
                raise TypeError(f"limits must be an EngineLimits, got {type(limits).__name__}")
            for name, value in dataclasses.asdict(limits).items():
                if kwargs.setdefault(name, value) != value:
                    raise ValueError(f"{name} is given twice: as a keyword and inside limits")
        cache = kwargs.get("cache")
        if isinstance(cache, StepCacheConfig):
            if kwargs.get("cache_threshold") is not None:
                raise ValueError("cache_threshold goes inside the StepCacheConfig given as cache")
            kwargs.update(cache=cache.policy, cache_threshold=cache.threshold)
        return cls(model, **kwargs).validate()

    @classmethod
    def yaml_keys(cls) -> dict[str | None, dict[str, str]]:
        """A deploy stage's option keys: section (None: the stage itself) -> {key: option name}."""
        keys: dict[str | None, dict[str, str]] = {section: {} for _, section in CONFIGS.values()}
        for f in cls.options():
            _, section = CONFIGS[f.metadata["config"]]
            keys[section][f.metadata["key"] or f.name] = f.name
        return keys

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, server: bool = True) -> None:
        """The model (positional) and a flag per option (`server=False`, for `generate`: but the server-only
        ones); every flag defaults to None, "not given"."""
        from vllm_omni.diffusion.models.registry import TINY_MODELS

        parser.add_argument(
            "model",
            help=f"model to {'serve' if server else 'run'}: a tiny embedded model ({', '.join(TINY_MODELS)}), a local "
            "diffusers folder, or a Hugging Face hub id (downloaded into --download-dir unless it is there)",
        )
        groups: dict[str, Any] = {}
        for f in cls.options():
            meta = f.metadata
            if meta["server_only"] and not server:
                continue
            if meta["group"] not in groups:
                groups[meta["group"]] = parser.add_argument_group(meta["group"])
            cli = dict(meta["cli"])
            if "type" not in cli and "action" not in cli and f.type in ("bool", "bool | None"):
                cli["action"] = argparse.BooleanOptionalAction
            help_text = meta["help"]
            if meta["default_text"] is not None:
                default = meta["default_text"]
                help_text += f" (default: {default(f) if callable(default) else default})"
            flag = meta["flag"] or "--" + f.name.replace("_", "-")
            groups[meta["group"]].add_argument(flag, dest=f.name, default=None, help=help_text, **cli)

    @classmethod
    def cli_values(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The options given on the command line (a flag left out is None and sets nothing)."""
        return {name: getattr(args, name) for name in cls.option_names() if getattr(args, name, None) is not None}
