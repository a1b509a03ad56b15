"""The bottom layer: the engine's configuration dataclasses, checked at construction.

`DiffusionParallelConfig` is the parallel layout and the SP padding policy; the other configs say
how a worker loads a model and what bounds a request. Imports nothing of the package.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass, field
from typing import Any, Literal

from vllm_omni import envs

PaddingMode = Literal["mask", "trim", "none"]
ExecutorBackend = Literal["mp", "ray"]
EXECUTOR_BACKENDS = ("mp", "ray")


def _is_positive_int(value: Any) -> bool:
    return not isinstance(value, bool) and isinstance(value, int) and value >= 1


def _check_positive_int(name: str, value: Any) -> None:
    if not _is_positive_int(value):
        raise ValueError(f"{name} must be a positive integer (1, 2, 3, ...), got {value!r}")


def _check_bool(name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be a boolean (true or false), got {value!r}")


def _seconds_from_env(name: str, default: float) -> float:
    """A deadline's default: env `name` when set (how a test or a deploy shortens it), else `default`."""
    text = os.environ.get(name)
    if text is None:
        return default
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{name} must be a number of seconds, got {text!r}") from None


def _check_seconds(name: str, value: Any) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass
class DiffusionParallelConfig:
    """How one request is split over GPUs, and what SP does with its padding.

    world size = cfg_parallel_size * ulysses_degree * ring_degree. When Ulysses pads a
    sequence the degree does not divide, the padding is masked (`mask_sp_padding=True`,
    exact, masked kernel), trimmed after the all-to-all (default, exact, dense kernel), or
    left in unmasked (`trim_sp_padding=False`, dense kernel, approximate, warns once).
    `distributed_executor_backend` says who starts the ranks: "mp", one process each on this
    machine, or "ray", one Ray actor each, on this machine or across a Ray cluster.
    `vae_parallel`: the VAE decode tiled and split over every rank (vae_parallel.py); None: on
    when there are several ranks and the output is large enough that splitting pays, and where a
    rank cannot allocate the untiled decode.
    `data_parallel_size`: replicas, each a group of `world_size` ranks on its own devices, behind
    one queue (diffusion/engine/scheduler.py); the "mp" backend only, for now.
    """

    ulysses_degree: int = 1
    ring_degree: int = 1
    cfg_parallel_size: int = 1
    sequence_parallel_size: int | None = None
    mask_sp_padding: bool = False
    trim_sp_padding: bool = True
    distributed_executor_backend: ExecutorBackend = "mp"
    vae_parallel: bool | None = None
    data_parallel_size: int = 1

    def __post_init__(self) -> None:
        _check_positive_int("ulysses_degree", self.ulysses_degree)
        _check_positive_int("ring_degree", self.ring_degree)
        if self.cfg_parallel_size not in (1, 2) or isinstance(self.cfg_parallel_size, bool):
            raise ValueError(f"cfg_parallel_size must be 1 or 2, got {self.cfg_parallel_size!r}")
        derived = self.ulysses_degree * self.ring_degree
        if self.sequence_parallel_size is None:
            self.sequence_parallel_size = derived
        else:
            _check_positive_int("sequence_parallel_size", self.sequence_parallel_size)
            if self.sequence_parallel_size != derived:
                raise ValueError(
                    f"sequence_parallel_size must equal ulysses_degree * ring_degree = {derived} "
                    f"(ulysses_degree={self.ulysses_degree}, ring_degree={self.ring_degree}), "
                    f"got {self.sequence_parallel_size}"
                )
        _check_bool("mask_sp_padding", self.mask_sp_padding)
        _check_bool("trim_sp_padding", self.trim_sp_padding)
        if self.vae_parallel is not None:
            _check_bool("vae_parallel", self.vae_parallel)
        _check_positive_int("data_parallel_size", self.data_parallel_size)
        if self.data_parallel_size > 1 and self.distributed_executor_backend != "mp":
            raise ValueError(
                "data_parallel_size > 1 runs replicas with the 'mp' executor backend only (one machine); "
                f"got distributed_executor_backend={self.distributed_executor_backend!r}"
            )
        if self.distributed_executor_backend not in EXECUTOR_BACKENDS:
            raise ValueError(
                f"distributed_executor_backend must be one of {', '.join(EXECUTOR_BACKENDS)}, "
                f"got {self.distributed_executor_backend!r}"
            )

    @property
    def world_size(self) -> int:
        return self.cfg_parallel_size * self.sequence_parallel_size

    @property
    def padding_mode(self) -> PaddingMode:
        if self.mask_sp_padding:
            return "mask"
        return "trim" if self.trim_sp_padding else "none"

    @classmethod
    def field_names(cls) -> list[str]:
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> DiffusionParallelConfig:
        """Build from a deploy YAML `parallel_config` mapping; unknown keys are errors."""
        if values is None:
            return cls()
        if not isinstance(values, dict):
            raise ValueError(f"parallel_config must be a mapping, got {type(values).__name__}")
        unknown = sorted(set(values) - set(cls.field_names()))
        if unknown:
            raise ValueError(
                f"unknown parallel_config key(s): {', '.join(map(repr, unknown))}; "
                f"allowed keys: {', '.join(cls.field_names())}"
            )
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    def replace(self, **changes: Any) -> DiffusionParallelConfig:
        """A copy with some fields changed; `sequence_parallel_size` is re-derived unless given."""
        values = self.to_dict()
        values.update(changes)
        if "sequence_parallel_size" not in changes:
            values["sequence_parallel_size"] = None
        return DiffusionParallelConfig(**values)


DTYPES = ("float32", "bfloat16", "float16")
QUANTIZATION_METHODS = ("fp8",)
CACHE_POLICIES = ("first_block",)
# the kernels of attention/backends.py, by name
ATTENTION_BACKENDS = (
    "sdpa", "sdpa_masked", "cudnn_fp8", "triton_int8", "triton_int8_fp8pv", "triton_int8_int8pv", "flash_attn_4",
)  # fmt: skip
# Where the weights wait between their phases, the cheapest first after auto (worker/offload.py): what
# `cpu_offload="auto"` tries in this order, each the same weights and arithmetic (worker/memory_plan.py).
PLACEMENTS = ("none", "encoders", "model", "layerwise")
CPU_OFFLOAD_MODES = ("auto", *PLACEMENTS)
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")  # the queue's order (diffusion/engine/policy.py)
MAX_NUM_SEQS = 8  # the most requests in flight on a worker group (diffusion/protocol.py CANCEL_SLOTS holds their flags)


@dataclass(frozen=True)
class StepCacheConfig:
    """Step caching in the denoisers (diffusion/worker/step_cache.py): `first_block` is diffusers' First-Block-Cache.

    Every step runs the first transformer block; when its output changed by less than `threshold`
    (relative mean absolute change of its residual since the last computed step, over the whole SP
    group) the remaining blocks are skipped and their last residual reused. Higher skips more.
    """

    policy: Literal["first_block"] = "first_block"
    threshold: float = 0.08  # a starting point: where picture quality holds depends on the checkpoint

    def __post_init__(self) -> None:
        if self.policy not in CACHE_POLICIES:
            raise ValueError(f"cache must be one of {', '.join(CACHE_POLICIES)}, got {self.policy!r}")
        value = self.threshold
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"cache_threshold must be a number > 0, got {value!r}")


LORA_MODULE_FORMS = "NAME=PATH (a folder or .safetensors file), or NAME=HIGH,LOW (a file per expert of two)"


def lora_paths(value: Any) -> tuple[str, ...]:
    """A LoRA adapter's files: 'PATH' (every denoiser reads it), or 'HIGH,LOW' or a list of one or two paths: two are
    one per expert of a two-expert model, in the order of its denoisers (the high-noise `transformer`, then the
    low-noise `transformer_2`). A ValueError saying what is wrong otherwise (its caller names the field)."""
    items = value.split(",") if isinstance(value, str) else list(value) if isinstance(value, (list, tuple)) else None
    if items is None or not all(isinstance(item, str) for item in items):
        raise ValueError(f"expected a path, HIGH,LOW or a list of two paths, got {value!r}")
    paths = tuple(item.strip() for item in items)
    if not all(paths):
        raise ValueError(f"an empty path in {value!r}")
    if len(paths) > 2:
        raise ValueError(
            f"{len(paths)} paths in {value!r}: give one (every denoiser reads it) or two, HIGH,LOW (one per expert of "
            "a two-expert model: high noise, low noise)"
        )
    return paths


def parse_lora_module(item: str) -> tuple[str, str]:
    """'name=path' or 'name=high,low' (vLLM's --lora-modules form, with a file per expert) -> (name, path), the pair
    as 'high,low'."""
    name, sep, path = item.partition("=") if isinstance(item, str) else ("", "", "")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"a LoRA module is {LORA_MODULE_FORMS}, got {item!r}")
    try:
        return name.strip(), ",".join(lora_paths(path))
    except ValueError as exc:
        raise ValueError(f"lora_modules {item}: {exc}") from None


@dataclass(frozen=True)
class Admission:
    """What the engine asks each rank's memory plan to admit (worker/memory_plan.py): one row of `default_tokens`
    image (video) tokens a step, the model's default request, must fit, and of `max_tokens` too where the user set
    that limit (`max_tokens_set`); beyond them a forward holds what fits, up to `max_tokens` a row and `max_rows`
    rows."""

    default_tokens: int
    max_tokens: int
    max_rows: int
    max_tokens_set: bool = False

    @property
    def required_tokens(self) -> int:
        return self.max_tokens if self.max_tokens_set else min(self.default_tokens, self.max_tokens)


@dataclass(frozen=True)
class Envelope:
    """What one denoising forward of a deploy holds, as its ranks' memory plans found it fits: rows of at most
    `max_tokens_per_step` image (video) tokens each, and `forward_tokens` tokens in all (each row's text allowance,
    `text_tokens`, counted), up to `max_rows` rows. A request of more images than fit one forward runs them as
    consecutive forwards (worker/runner.py); a batch holds no more rows than fit (engine/scheduler.py)."""

    max_tokens_per_step: int
    forward_tokens: int
    max_rows: int
    text_tokens: int

    def rows_for(self, tokens: int) -> int:
        """Rows of `tokens` image tokens each that one forward holds (at least one), up to `max_rows` images."""
        return max(1, min(self.max_rows, self.rows_fitting(tokens)))

    def rows_fitting(self, tokens: int) -> int:
        """Rows of `tokens` image tokens each that the memory holds in one forward, whatever `max_rows` (the limit
        on images, --max-n) says: a CFG step's two branches are one image's rows (engine/admission.py `fit`)."""
        return self.forward_tokens // max(1, tokens + self.text_tokens)

    def narrowest(self, other: Envelope | None) -> Envelope:
        """What fits on both (a group's ranks hold different components: the narrowest rank decides)."""
        if other is None:
            return self
        return Envelope(
            min(self.max_tokens_per_step, other.max_tokens_per_step),
            min(self.forward_tokens, other.forward_tokens),
            min(self.max_rows, other.max_rows),
            max(self.text_tokens, other.text_tokens),
        )


@dataclass
class OmniDiffusionConfig:
    """Everything a worker needs to load a model: where from, on what, how split."""

    model: str
    parallel_config: DiffusionParallelConfig = field(default_factory=DiffusionParallelConfig)
    download_dir: str | None = None  # the Hugging Face cache folder hub models go to; None: huggingface_hub's
    revision: str | None = None  # a hub model's branch, tag or commit; None: main
    device: str | None = None  # "cpu" or "cuda"; None picks CUDA when there are enough GPUs
    dtype: str | None = None  # one of DTYPES; None: bfloat16 on CUDA, float32 on CPU
    attention_backend: str | None = None  # None: env VLLM_OMNI_ATTENTION_BACKEND, else by padding mode
    # A lossy attention backend (cudnn_fp8 or a triton_int8 one) runs the first and last this many
    # denoising steps exactly.
    fp8_attention_full_steps: int = 2
    enforce_eager: bool = False  # True: no CUDA graphs for the transformer (CUDA only)
    # A CFG step's two branches as the rows of one forward where both fit (worker/cfg_batch.py); False: two forwards;
    # None: only where the weights stream to the GPU every forward (layerwise offload).
    cfg_one_pass: bool | None = None
    # "fp8": the denoisers' large linear layers run FP8 matmuls (diffusion/worker/quantization.py); None: as loaded.
    quantization: Literal["fp8"] | None = None
    cache: StepCacheConfig | None = None  # step caching in the denoisers; None: every step computes every block
    # Deadlines on the workers (executor.py); None: env VLLM_OMNI_LOAD_TIMEOUT_S / _STALL_TIMEOUT_S,
    # else 600 / 300 s. Loading: every rank must report ready within this.
    load_timeout_s: float | None = None
    # A request in which no rank reports a finished denoising step (or its start, or its end) for
    # this long has hung: it fails and the workers restart. Covers the slowest single phase (first
    # step with graph capture / compilation, a long video's VAE decode), hence generous.
    stall_timeout_s: float | None = None
    # One short request once the workers are up, so compilation and graph capture happen before the
    # first user request (DiffusionEngine.wait_until_ready). None: on CUDA unless enforce_eager.
    warmup: bool | None = None
    warmup_size: tuple[int, int] | None = None  # (width, height); None: the pipeline's default size
    # The Ray cluster the "ray" backend joins ("auto": the one `ray start` runs on this machine, or
    # "HEAD_IP:6379"); None: a private Ray instance on this machine, whatever RAY_ADDRESS says.
    ray_address: str | None = None
    # Which replica this engine is (data_parallel_size): its ranks use the GPUs from replica x world_size.
    replica: int = 0
    # Where the weights wait between their phases (worker/offload.py): "none" (on the GPU), "encoders" (the text
    # encoders and the VAE on the CPU until their phase, the denoisers stay), "model" (each component on the CPU until
    # its phase), "layerwise" (the blocks streamed from pinned CPU memory); "auto": the first of PLACEMENTS in which
    # the model's default request fits on the GPU (worker/memory_plan.py).
    cpu_offload: Literal["auto", "none", "encoders", "model", "layerwise"] = "auto"
    # The share of each GPU the engine plans to use and may allocate (vLLM's --gpu-memory-utilization).
    gpu_memory_utilization: float = 0.9
    # What the memory plan must admit and may widen to (worker/memory_plan.py). Set by the engine from its limits
    # and the model's default request; None: the model's cap, one row.
    admission: Admission | None = None
    # LoRA adapters (engine/adapters.py, worker/lora.py): name -> folder or .safetensors file, or 'HIGH,LOW' (a file
    # per expert of a two-expert model), served from the start;
    # how many keep their factors on each GPU and on the CPU; the largest rank accepted; whether
    # /v1/load_lora_adapter and /v1/unload_lora_adapter may change them while serving.
    lora_modules: dict[str, str] | None = None
    max_loras: int = 4
    max_cpu_loras: int | None = None  # None: max_loras
    max_lora_rank: int = 128
    allow_runtime_lora: bool = False
    # The denoiser weights ('<module>.weight') the served adapters adapt, set by the engine when none can be added
    # at run time: the memory plan counts originals of these only (None: of every 2-D block weight).
    lora_adapted: tuple[str, ...] | None = None
    # Which queued request runs next (diffusion/engine/policy.py): "fcfs" (arrival), "priority" (a request's
    # `priority`, lower first), "fair" (least estimated work first, with an age bound). Read by the scheduler.
    # fair by default: measured on an H200 against fcfs (docs/serving.md, Scheduling policy), short requests
    # waited a fifth as long behind long ones, at the same throughput.
    scheduling_policy: Literal["fcfs", "priority", "fair"] = "fair"
    # Requests in flight on one worker group at once: with fair or priority, a queued request that the policy puts
    # first runs inside the running one from its next step (engine/scheduler.py, worker.RankServer); 1: never.
    max_num_seqs: int = 1

    @property
    def cfg_one_pass_allowed(self) -> bool:
        """Whether a CFG step's two branches may share a forward (worker/cfg_batch.py): not turned off, not split
        over two groups by CFG parallel, not under the step cache (which decides per branch)."""
        return self.cfg_one_pass is not False and self.parallel_config.cfg_parallel_size == 1 and self.cache is None

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ValueError("model must be a non-empty model id or path")
        if self.load_timeout_s is None:
            self.load_timeout_s = _seconds_from_env(envs.LOAD_TIMEOUT_S, 600.0)
        if self.stall_timeout_s is None:
            self.stall_timeout_s = _seconds_from_env(envs.STALL_TIMEOUT_S, 300.0)
        if isinstance(self.replica, bool) or not isinstance(self.replica, int) or self.replica < 0:
            raise ValueError(f"replica must be a non-negative integer, got {self.replica!r}")
        _check_seconds("load_timeout_s", self.load_timeout_s)
        _check_seconds("stall_timeout_s", self.stall_timeout_s)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise ValueError(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)} or unset, got {self.quantization!r}"
            )
        if self.cpu_offload not in CPU_OFFLOAD_MODES:
            raise ValueError(f"cpu_offload must be one of {', '.join(CPU_OFFLOAD_MODES)}, got {self.cpu_offload!r}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(
                f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {self.scheduling_policy!r}"
            )
        if isinstance(self.max_num_seqs, bool) or not isinstance(self.max_num_seqs, int):
            raise ValueError(f"max_num_seqs must be an integer, got {self.max_num_seqs!r}")
        if not 1 <= self.max_num_seqs <= MAX_NUM_SEQS:
            raise ValueError(f"max_num_seqs must be between 1 and {MAX_NUM_SEQS}, got {self.max_num_seqs}")
        value = self.gpu_memory_utilization
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
            raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {value!r}")
        for name in ("max_loras", "max_lora_rank") + (("max_cpu_loras",) if self.max_cpu_loras is not None else ()):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.lora_modules is not None:
            if isinstance(self.lora_modules, str):  # one NAME=PATH
                self.lora_modules = [self.lora_modules]
            if isinstance(self.lora_modules, (list, tuple)):  # the flag's and a YAML list's name=path items
                self.lora_modules = dict(parse_lora_module(item) for item in self.lora_modules)
            if not isinstance(self.lora_modules, dict) or not all(
                isinstance(k, str) and k and isinstance(v, (str, list, tuple)) and v
                for k, v in self.lora_modules.items()
            ):
                raise ValueError(f"lora_modules must map adapter names to paths, got {self.lora_modules!r}")
            modules = {}
            for name, value in self.lora_modules.items():  # a pair, 'high,low' or [high, low]: 'high,low'
                try:
                    modules[name] = ",".join(lora_paths(value))
                except ValueError as exc:
                    raise ValueError(f"lora_modules {name}: {exc}") from None
            self.lora_modules = modules
        if self.device not in (None, "cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")
        if self.dtype is not None:
            self.dtype = normalize_dtype_name(self.dtype)
        _check_bool("enforce_eager", self.enforce_eager)
        if self.cfg_one_pass is not None:
            _check_bool("cfg_one_pass", self.cfg_one_pass)
        if self.warmup is not None:
            _check_bool("warmup", self.warmup)
        if self.warmup_size is not None:
            size = self.warmup_size
            if not isinstance(size, (tuple, list)) or len(size) != 2 or any(not _is_positive_int(v) for v in size):
                raise ValueError(f"warmup_size must be (width, height) in pixels, got {size!r}")
            self.warmup_size = tuple(size)
        if self.attention_backend is not None and not isinstance(self.attention_backend, str):
            raise ValueError(f"attention_backend must be a backend's name, got {self.attention_backend!r}")
        steps = self.fp8_attention_full_steps
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
            raise ValueError(f"fp8_attention_full_steps must be an integer >= 0, got {steps!r}")
        if self.ray_address is not None and (not isinstance(self.ray_address, str) or not self.ray_address.strip()):
            raise ValueError(
                f"ray_address must be a non-empty address such as 'auto' or 'HEAD_IP:6379', got {self.ray_address!r}"
            )


def normalize_dtype_name(dtype: Any) -> str:
    """'bf16', torch.bfloat16 and 'bfloat16' all become 'bfloat16'; anything else is a ValueError."""
    name = str(dtype).removeprefix("torch.")
    name = {"fp32": "float32", "float": "float32", "bf16": "bfloat16", "fp16": "float16", "half": "float16"}.get(
        name, name
    )
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)} (or a torch dtype), got {dtype!r}")
    return name


@dataclass
class EngineLimits:
    """Bounds on one request; bad input beyond them is a ValueError naming the field."""

    max_image_size: int = 4096  # largest width or height, pixels
    max_steps: int = 200
    max_n: int = 4  # images per request
    max_input_images: int = 4  # source images per edit
    max_upload_bytes: int = 20 * 1024 * 1024  # one uploaded image file
    max_input_pixels: int = 40_000_000  # decoded source image, w*h (no decompression bombs)
    max_prompt_tokens: int = 1024  # prompt and negative_prompt, each, in the model's tokenizer
    max_queue: int = 64  # requests waiting in the server's queue
    max_frames: int = 257  # video frames per request
    max_fps: int = 120
    # Image (video) tokens one denoising forward attends over: the output's latent patches x latent
    # frames, plus the source images' where the pipeline joins them to the sequence
    # (PipelineSpec.tokens_per_step). None: the served model's default (PipelineSpec.max_tokens_per_step).
    max_tokens_per_step: int | None = None

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None and f.name == "max_tokens_per_step":
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    def for_model(self, spec: Any) -> EngineLimits:
        """These limits with the model's own defaults where none was set (`spec.max_tokens_per_step`)."""
        if self.max_tokens_per_step is not None:
            return self
        return dataclasses.replace(self, max_tokens_per_step=spec.max_tokens_per_step)


@dataclass
class BatchingConfig:
    """Request batching in the server's scheduler: queued requests that can share a forward run as one
    pipeline call of up to `max_batch_size` rows (1: off), the first waiting up to `batch_wait_ms` for company."""

    max_batch_size: int = 1
    batch_wait_ms: float = 0.0

    def __post_init__(self) -> None:
        _check_positive_int("max_batch_size", self.max_batch_size)
        value = self.batch_wait_ms
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ValueError(f"batch_wait_ms must be a number of milliseconds >= 0, got {value!r}")
