"""Text-to-video end to end on one GPU, ours against diffusers: what benchmarks/hunyuan_video_e2e.py and
benchmarks/wan22_e2e.py share. Each script describes its model as a `VideoFamily` and calls `main`.

The phases (build, diffusers, ours, docs), the variants, the extrapolation of a few measured steps to the
request's full count, the rows in the JSON, the docs section and the probe in ours' workers live here; a
family gives its pipeline, its random-weight checkpoint, its request and the words of its docs section.
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.e2e import (  # noqa: E402
    BUILD_MARKER,
    GPU_GIB,
    DeviceMemorySampler,
    PhaseProbe,
    add_agreement,
    already_built,
    as_card_of,
    build_record,
    cell,
    commit_checkpoint,
    copy_outputs,
    default_dtype,
    failed_row,
    inductor_cache_files,
    install_worker_probe,
    load_results,
    prepare_partial,
    probe_records,
    save_results,
    save_synced,
)

DEFAULT_DOCS = ROOT / "docs/benchmarks.md"
PROBE_ENV = "VIDEO_E2E_PROBE_DIR"  # set for ours' workers: where each rank writes its phases
SEED = 1000
WARMUP_SEED = 0
PHASES = ["build", "diffusers", "ours", "docs"]  # docs: rewrite the docs section from the JSON
# The ratios of extrapolated end-to-end totals every family reports (a / b); its targets are against diffusers.
COMPARISONS = (
    ("ours-default", "diffusers-eager"),
    ("ours-eager", "diffusers-eager"),
    ("ours-default", "ours-eager"),
    ("ours-fp8-attention", "diffusers-eager"),
    ("ours-fp8-attention", "ours-default"),
    ("ours-triton-int8-attention", "ours-default"),
    ("ours-triton-int8-attention-rule", "ours-default"),
    ("ours-fp8-levers", "diffusers-eager"),
    ("ours-fp8-levers", "ours-default"),
    ("ours-fp8-levers-cache", "diffusers-eager"),
    ("ours-fp8-levers-cache", "ours-default"),
    ("ours-cache", "ours-default"),
    ("ours-layerwise-48g", "ours-default"),
    ("ours-expert-swap", "ours-eager"),
    ("ours-fa4", "ours-default"),
    ("ours-fp8-matmuls-fa4", "ours-default"),
    ("ours-sdpa", "diffusers-eager"),
    ("ours-default", "ours-sdpa"),
)
# Issue 46's ratios: each of these against diffusers-eager in denoising seconds a step (its targets: a family's
# `step_targets`).
STEP_VARIANTS = ("ours-default", "ours-sdpa", "ours-fa4", "ours-fp8-levers", "ours-fp8-matmuls-fa4")
STEP_CACHE = {"cache": "first_block"}
# A reference saved by one call for the agreement of another (--save-reference, --reference): ours-default's
# frames 0, 16, 32, ... (a Wan clip's 6 of 81 frames, a HunyuanVideo clip's 8 of 121: under 10 MB, which a
# device call returns and carries).
REFERENCE_STRIDE = 16
# How each side decodes, for the docs (a family may add where ours tiles).
DECODE_TEXT = (
    "diffusers: untiled; ours: tiled where the rank cannot allocate the untiled decode within its cap, 0.9 of the "
    "card by default"
)
# The first timed run's frames of each variant run in this process: agreement with ours-default's (PSNR).
FRAMES: dict[str, np.ndarray] = {}


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    width: int
    height: int
    frames: int
    steps: int
    device: str
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def size(self) -> str:
        return f"{self.width}x{self.height}"


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    phase: str
    gpus: int
    what: str
    omni: dict[str, Any] | None = None  # Omni keyword arguments (ours)
    # The step cache at its median-change threshold: what a cache skips depends on the whole schedule, so both
    # requests run the full steps (nothing extrapolated); the warm-up, at the cache's default threshold, measures
    # the first block's median change, and the timed request takes it as its `cache_threshold`.
    cache_at_median: bool = False


def make_variants(pipeline: str) -> list[Variant]:
    """The variants every family runs; diffusers-eager names its pipeline class."""
    return [
        Variant("diffusers-eager", "diffusers", 1, f"diffusers {pipeline}, eager"),
        Variant("ours-default", "ours", 1, "Omni(folder): compiled blocks, CUDA graphs, warm-up requests", {}),
        Variant(
            "ours-eager", "ours", 1, "Omni(folder, enforce_eager=True): no compile, no graphs", {"enforce_eager": True}
        ),
        # Every timed step in FP8 (a --steps 3 run would otherwise have none): the full-step figure is all FP8
        # steps; with the default --fp8-attention-full-steps 2, 4 of them would run exact attention.
        Variant(
            "ours-fp8-attention",
            "ours",
            1,
            "Omni(folder, attention_backend='cudnn_fp8', fp8_attention_full_steps=0): FP8 attention in every step",
            {"attention_backend": "cudnn_fp8", "fp8_attention_full_steps": 0},
        ),
        # The Triton kernel (INT8 Q.K, bf16 output; issue 46), every timed step in low precision as above; and
        # under the engine's per-step rule as shipped (the first and last 2 steps exact): a full-length request's
        # agreement with ours-default (--reference) is what decides whether it may be the default.
        Variant(
            "ours-triton-int8-attention",
            "ours",
            1,
            "Omni(folder, attention_backend='triton_int8', fp8_attention_full_steps=0): the Triton kernel in every "
            "step",
            {"attention_backend": "triton_int8", "fp8_attention_full_steps": 0},
        ),
        Variant(
            "ours-triton-int8-attention-rule",
            "ours",
            1,
            "Omni(folder, attention_backend='triton_int8'): the Triton kernel, the first and last 2 steps exact",
            {"attention_backend": "triton_int8"},
        ),
        # The levers together (issue 33), every timed step in FP8 as above. Not the step cache: with 3 measured
        # steps it skips at most a forward or two, which says nothing of a full request's skips (a full run would).
        Variant(
            "ours-fp8-levers",
            "ours",
            1,
            "Omni(folder, attention_backend='cudnn_fp8', fp8_attention_full_steps=0, quantization='fp8')",
            {"attention_backend": "cudnn_fp8", "fp8_attention_full_steps": 0, "quantization": "fp8"},
        ),
        # The levers together with the step cache (issue 33): FP8 attention in every step, FP8 matmuls, and
        # First-Block-Cache at the median change its full-length warm-up measured.
        Variant(
            "ours-fp8-levers-cache",
            "ours",
            1,
            "Omni(folder, attention_backend='cudnn_fp8', fp8_attention_full_steps=0, quantization='fp8', "
            "cache='first_block'), cache_threshold the median change (full-length requests)",
            {"attention_backend": "cudnn_fp8", "fp8_attention_full_steps": 0, "quantization": "fp8", **STEP_CACHE},
            cache_at_median=True,
        ),
        # FlashAttention 4's exact kernels (issue 46; what ours-default runs where flash-attn-4 is installed on a
        # Hopper GPU), alone and with FP8 matmuls: exact attention, the FP8 lever that stays within the matmuls.
        Variant(
            "ours-fa4",
            "ours",
            1,
            "Omni(folder, attention_backend='flash_attn_4')",
            {"attention_backend": "flash_attn_4"},
        ),
        # cuDNN's kernel named: where flash-attn-4 is installed on a Hopper GPU, ours-default runs FA4's on its own
        # (attention/backends.automatic_dense_backend), so this is the row of the kernel it replaced.
        Variant(
            "ours-sdpa",
            "ours",
            1,
            "Omni(folder, attention_backend='sdpa'): cuDNN's kernel through SDPA",
            {"attention_backend": "sdpa"},
        ),
        Variant(
            "ours-fp8-matmuls-fa4",
            "ours",
            1,
            "Omni(folder, attention_backend='flash_attn_4', quantization='fp8')",
            {"attention_backend": "flash_attn_4", "quantization": "fp8"},
        ),
        # The step cache alone, as above (what it buys without FP8; the one cache row a CPU smoke run can make).
        Variant(
            "ours-cache",
            "ours",
            1,
            "Omni(folder, cache='first_block'), cache_threshold the median change (full-length requests)",
            STEP_CACHE,
            cache_at_median=True,
        ),
        # Both experts do not fit beside the text encoder (issue 44): the idle expert waits in pinned CPU memory and
        # moves in at its boundary step (model offload), against ours-eager (neither has CUDA graphs).
        Variant(
            "ours-expert-swap",
            "ours",
            1,
            "Omni(folder, cpu_offload='model', enforce_eager=True): each component, each expert, moved in for its "
            "phase",
            {"cpu_offload": "model", "enforce_eager": True},
        ),
        # A 48 GiB card (issue 31): the denoisers' blocks streamed from pinned memory (those the memory plan keeps
        # resident aside), the cap the card's size; the decode tiles where the untiled one would not fit.
        Variant(
            "ours-layerwise-48g",
            "ours",
            1,
            "Omni(folder, cpu_offload='layerwise', gpu_memory_utilization=48 GiB of this card)",
            {"cpu_offload": "layerwise", GPU_GIB: 48},
        ),
    ]


@dataclasses.dataclass(frozen=True)
class VideoFamily:
    """One text-to-video model as the shared benchmark runs it."""

    key: str  # the script (benchmarks/<key>.py), its JSON (benchmarks/results/<key>.json) and docs section
    title: str  # the docs section's heading
    pipeline: str  # the diffusers pipeline class
    denoisers: dict[str, str]  # subfolder -> diffusers class: loaded straight onto the device, as the engine does
    loop_start: str  # the pipeline method called once right before the denoising loop (PhaseProbe)
    prompt: str
    fps: int  # the engine's default frame rate (registry: default_fps)
    full_steps: int  # the request's steps; fewer measured are extrapolated to these
    sizes: tuple[Scale, ...]  # the real request(s), the default first; several: --size picks one a call
    tiny: Scale
    folder_name: str  # the checkpoint folder's default name, under the temp dir
    # Building the checkpoint: the pipeline's unweighted arguments (tokenizers, scheduler, its config), then
    # (scale, those) -> the weighted modules, made under the build's device and dtype; the facts kept in the
    # build record, and a last touch of the written folder.
    pipeline_parts: Callable[[], dict[str, Any]]
    make_components: Callable[[Scale, dict[str, Any]], dict[str, torch.nn.Module]]
    checkpoint_facts: Callable[[Any], dict[str, Any]]
    finish_folder: Callable[[Path], None] = lambda folder: None
    request_fields: dict[str, Any] = dataclasses.field(default_factory=dict)  # for pipe(...) and generate(...)
    omni_options: Callable[[Scale], dict[str, Any]] = lambda scale: {}  # every ours variant's, beside its own
    diffusers_facts: Callable[[Any], dict[str, Any]] = lambda pipe: {}  # the diffusers row's, from the pipeline
    # The docs: the checkpoint's components, the request's CFG (first row, build record), the text encoders of
    # the text phase, how each side decodes, the targets' sentence, the runs to make when there are no rows.
    components_text: str = ""
    cfg_text: Callable[[dict[str, Any], dict[str, Any]], str] = lambda row, build: "CFG as the pipeline runs it"
    text_encoders_text: str = ""
    decode_text: str = DECODE_TEXT
    targets_text: str = ""
    not_run_text: str = "Not run yet."
    # variant -> its target against diffusers-eager ("<= X ..."), at `target_size` (None: every size).
    targets: dict[str, str] = dataclasses.field(default_factory=dict)
    target_size: str | None = None
    step_targets: dict[str, str] = dataclasses.field(default_factory=dict)  # STEP_VARIANTS' per step, target_size
    published: dict[str, float] | None = None  # {"diffusers_s", "upstream_vllm_omni_s"} for this request

    @property
    def several_sizes(self) -> bool:
        return len(self.sizes) > 1

    @property
    def variants(self) -> list[Variant]:
        return make_variants(self.pipeline)

    @property
    def by_name(self) -> dict[str, Variant]:
        return {variant.name: variant for variant in self.variants}

    @property
    def default_out(self) -> Path:
        return ROOT / f"benchmarks/results/{self.key}.json"


@dataclasses.dataclass
class Settings:
    family: VideoFamily
    scale: Scale
    folder: Path
    runs: int
    warmup_steps: int

    def call_kwargs(self, steps: int) -> dict[str, Any]:
        """The request's fields, for diffusers' `pipe(...)` and `Omni.generate(...)` alike."""
        s = self.scale
        size = dict(height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=steps)
        return {**size, **self.family.request_fields}

    def requests(self, variant: Variant | None = None) -> list[tuple[str, int, int]]:
        """(label, seed, steps): the untimed warm-up request (unless --warmup-steps 0), then the timed ones; for a
        variant with the cache at its median change, both at the full steps, the warm-up always."""
        if variant is not None and variant.cache_at_median:
            full = self.family.full_steps
            return [("warm-up", WARMUP_SEED, full)] + [(f"run {i}", SEED, full) for i in range(self.runs)]
        warmup = [("warm-up", WARMUP_SEED, self.warmup_steps)] if self.warmup_steps > 0 else []
        return warmup + [(f"run {i}", SEED, self.scale.steps) for i in range(self.runs)]


# ---- the checkpoint folder -------------------------------------------------------------------------


def build_checkpoint(family: VideoFamily, scale: Scale, folder: Path, rebuild: bool) -> dict[str, Any] | None:
    """Write the family's random-weight pipeline folder (safetensors); None when it is already there.

    The weights are made on the target device in the target dtype (seconds on a GPU), then saved
    into `<folder>.partial`, synced to disk and renamed: a folder with the marker is complete.
    """
    if already_built(folder, scale.name, rebuild):
        return None

    import diffusers

    parts = family.pipeline_parts()
    device, dtype = torch.device(scale.device), scale.torch_dtype
    start = time.perf_counter()
    torch.manual_seed(0)
    with default_dtype(dtype), device:
        components = family.make_components(scale, parts)
    init_s, params, partial = prepare_partial(components, device, dtype, start, folder)

    pipe = getattr(diffusers, family.pipeline)(**parts, **components)
    files, write_s, written = save_synced(pipe, partial)
    family.finish_folder(partial)
    record = build_record(scale.name, params, files, written, init_s, write_s, partial, **family.checkpoint_facts(pipe))
    del pipe, components
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    commit_checkpoint(partial, folder, record, written, write_s)
    return record


# ---- one run's numbers -----------------------------------------------------------------------------


def to_uint8(frames: np.ndarray) -> np.ndarray:
    """float frames in [0, 1] -> uint8, as the engine's runner returns them."""
    return (np.asarray(frames, dtype=np.float32).clip(0, 1) * 255).round().astype(np.uint8)


def time_mp4(frames: np.ndarray, fps: int) -> dict[str, Any]:
    """Seconds to encode one video's uint8 frames [F, H, W, 3] with the project's MP4 encoder."""
    from vllm_omni.entrypoints.openai.media import encode_mp4

    start = time.perf_counter()
    try:
        data = encode_mp4(frames, fps)
    except ImportError as exc:  # PyAV missing (the GPU machine's image has none)
        return {"mp4_s": None, "mp4_note": f"not measured: {type(exc).__name__}: {exc}"[:200]}
    return {"mp4_s": round(time.perf_counter() - start, 4), "mp4_bytes": len(data), "mp4_note": None}


def split_run(record: dict[str, Any], e2e_s: float, steps: int, full_steps: int) -> dict[str, Any]:
    """One run: end to end, its phases (None where not measured), other = the rest of end to end,
    the loop's seconds per step and the end to end extrapolated to `full_steps` (MP4 excluded)."""
    keys = ("text_s", "prep_s", "loop_s", "decode_s")
    phases = {key: record.get(key) for key in keys}
    measured = None not in phases.values()
    row: dict[str, Any] = {"e2e_s": e2e_s, **phases, "other_s": e2e_s - sum(phases.values()) if measured else None}
    # Offloaded denoisers moving in (Wan2.2's expert swap) happen once a request, inside the loop: not per step.
    moved = record.get("onload_loop_s") or 0.0
    per_step = (phases["loop_s"] - moved) / steps if phases["loop_s"] is not None else None
    row["per_step_s"] = per_step
    row["steps"] = steps
    row["extrapolated_s"] = e2e_s - phases["loop_s"] + per_step * full_steps + moved if per_step is not None else None
    keys = ("call_s", "compile_s", "captures", "capture_s", "onload_s", "onload_loop_s", "onload_gib")
    row.update({key: record.get(key) for key in keys})
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()}


def summarize(variant: Variant, settings: Settings, runs: list[dict], peaks: list[list], extra: dict) -> dict:
    timed = [run for run in runs if run["label"] != "warm-up"]
    warm = next((run for run in runs if run["label"] == "warm-up"), {})

    def median(key: str) -> float | None:
        values = [run[key] for run in timed if run.get(key) is not None]
        return round(statistics.median(values), 4) if len(values) == len(timed) and values else None

    def total(key: str) -> float | None:
        values = [run.get(key) for run in timed]
        return None if None in values else round(sum(values), 3)

    per_gpu = [max(p[g] for p in peaks) for g in range(len(peaks[0]))] if peaks and None not in peaks[0] else None
    keys = ("e2e_s", "text_s", "prep_s", "loop_s", "per_step_s", "decode_s", "other_s", "extrapolated_s", "mp4_s")
    keys += ("onload_s", "onload_loop_s", "onload_gib")  # offload: the weights moved in a request
    row = {
        "variant": variant.name,
        "phase": variant.phase,
        "gpus": variant.gpus,
        "what": variant.what,
        "scale": settings.scale.name,
        "size": settings.scale.size,
        "frames": settings.scale.frames,
        "steps": timed[0]["steps"] if timed else settings.scale.steps,
        "extrapolated_steps": settings.family.full_steps,
        "warmup_steps": warm.get("steps", 0),
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
        **{key: median(key) for key in keys},
        "mp4_note": next((run.get("mp4_note") for run in timed if run.get("mp4_note")), None),
        "peak_alloc_gib": None if per_gpu is None else [round(x, 2) for x in per_gpu],
        "captures": total("captures"),
        "compile_s": total("compile_s"),
        "warmup_run_s": warm.get("e2e_s"),
        "warmup_captures": warm.get("captures"),
        "warmup_compile_s": warm.get("compile_s"),
        "runs": runs,
        "error": None,
    }
    mp4 = row["mp4_s"]
    row["extrapolated_with_mp4_s"] = (
        round(row["extrapolated_s"] + mp4, 3) if None not in (row["extrapolated_s"], mp4) else None
    )
    row.update(extra)
    return row


# ---- variants --------------------------------------------------------------------------------------


def run_diffusers(settings: Settings, names: list[str], keep: Callable[[dict[str, Any]], None]) -> None:
    """diffusers-eager on one pipeline in this process (GPU 0 on CUDA); `keep(row)` as it ends."""
    import diffusers

    family, scale = settings.family, settings.scale
    device = torch.device(scale.device, 0) if scale.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    try:
        # Loaded as the engine's runner loads it: the transformer(s) straight onto the device, the rest moved.
        denoisers = {
            name: getattr(diffusers, cls).from_pretrained(
                settings.folder, subfolder=name, dtype=scale.torch_dtype, device_map=str(device)
            )
            for name, cls in family.denoisers.items()
        }
        pipeline_class = getattr(diffusers, family.pipeline)
        pipe = pipeline_class.from_pretrained(settings.folder, **denoisers, dtype=scale.torch_dtype).to(device)
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        for name in names:
            keep(failed_row(family.by_name[name], settings, exc))
        return
    load_s = time.perf_counter() - start
    pipe.set_progress_bar_config(disable=True)
    probe = PhaseProbe(pipe, device, loop_start=family.loop_start)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for name in names:
        variant = family.by_name[name]
        try:
            runs, peaks = [], []
            with DeviceMemorySampler(device.type == "cuda") as sampler:
                for label, seed, steps in settings.requests():
                    probe.begin()
                    generator = torch.Generator("cpu").manual_seed(seed)
                    kwargs = settings.call_kwargs(steps)
                    result = pipe(prompt=family.prompt, generator=generator, output_type="np", **kwargs)
                    record = probe.end()
                    frames = to_uint8(result.frames[0])  # what ours returns: uint8 [F, H, W, 3]
                    e2e_s = time.perf_counter() - probe.start
                    run = dict(split_run(record, e2e_s, steps, family.full_steps), label=label, seed=seed)
                    del result
                    if label != "warm-up":
                        peaks.append([record["peak_alloc_gib"]])
                        run.update(time_mp4(frames, family.fps))
                        FRAMES.setdefault(name, frames)
                    runs.append(run)
                    del frames
                    print(f"{name} {label}: {run}", flush=True)
            extra = {"device": device_name, "load_s": round(load_s, 2), "nvsmi_peak_gib": sampler.peaks_gib(1)}
            extra.update(family.diffusers_facts(pipe))
            keep(summarize(variant, settings, runs, peaks, extra))
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            keep(failed_row(variant, settings, exc))
    del pipe, denoisers, probe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine's worker needs the GPU next


def run_ours(settings: Settings, variant: Variant, probe_root: Path) -> dict[str, Any]:
    """Start Omni(folder), then run the requests; the phases come from rank 0's worker."""
    from vllm_omni import Omni

    family, scale = settings.family, settings.scale
    probe_dir = probe_root / variant.name
    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    os.environ[PROBE_ENV] = str(probe_dir)  # the workers inherit it and install the probe
    runs, peaks, worker, warmup_records = [], [], {}, []
    cache_files = inductor_cache_files(ours=True)
    options = as_card_of({**family.omni_options(scale), **variant.omni}, scale.device)
    try:
        with DeviceMemorySampler(scale.device == "cuda") as sampler:
            start = time.perf_counter()
            omni = Omni(str(settings.folder), device=scale.device, dtype=scale.dtype, **options)
            ready_s = time.perf_counter() - start
            try:
                engine_warmup_s = omni.engine.warmup_s or 0.0
                # The engine's own warm-up requests (engine.warmup_requests: two with compiled blocks).
                warmup_records = [probe_records(probe_dir, id_).get(0, {}) for id_ in ("warm-up", "warm-up-2")]
                median_change = None
                for label, seed, steps in settings.requests(variant):
                    start = time.perf_counter()
                    kwargs = settings.call_kwargs(steps)
                    if variant.cache_at_median and label != "warm-up":
                        if median_change is None:
                            raise RuntimeError(f"{variant.name}: its warm-up request measured no change")
                        kwargs["cache_threshold"] = median_change
                    videos = omni.generate(family.prompt, seed=seed, output_type="uint8", **kwargs)
                    e2e_s = time.perf_counter() - start
                    records = probe_records(probe_dir, omni.last_output.request_id)
                    if 0 not in records:
                        raise RuntimeError(
                            f"no probe record from rank 0 in {probe_dir}: the worker probe is not loaded"
                        )
                    worker = records[0]
                    run = dict(split_run(worker, e2e_s, steps, family.full_steps), label=label, seed=seed)
                    cache = omni.last_output.step_cache
                    if cache is not None:
                        run["step_cache"] = {k: cache[k] for k in ("threshold", "forwards_skipped", "median_change")}
                        run["step_cache"]["forwards"] = cache["forwards_computed"] + cache["forwards_skipped"]
                        if label == "warm-up":
                            median_change = cache["median_change"]
                    if label != "warm-up":
                        peaks.append([records[r]["peak_alloc_gib"] for r in sorted(records)])
                        run.update(time_mp4(videos[0], omni.last_output.fps or family.fps))
                        FRAMES.setdefault(variant.name, np.asarray(videos[0]))
                    runs.append(run)
                    del videos
                    print(f"{variant.name} {label}: {run}", flush=True)
            finally:
                omni.close()
    finally:
        del os.environ[PROBE_ENV]

    def warmup_total(key: str) -> float | int | None:
        values = [record[key] for record in warmup_records if key in record]
        return round(sum(values), 3) if values else None

    extra = {
        "device": worker.get("device_name"),
        "attention": worker.get("attention"),
        "start_to_ready_s": round(ready_s, 2),
        "engine_warmup_s": round(engine_warmup_s, 2),
        "load_s": round(ready_s - engine_warmup_s, 2),
        "engine_warmup_requests": sum(1 for record in warmup_records if record),
        "engine_warmup_compile_s": warmup_total("compile_s"),
        "engine_warmup_captures": warmup_total("captures"),
        "inductor_cache_files_before": cache_files,
        "nvsmi_peak_gib": sampler.peaks_gib(variant.gpus),
        "step_cache": next(
            (run["step_cache"] for run in runs if run["label"] != "warm-up" and "step_cache" in run), None
        ),
    }
    return summarize(variant, settings, runs, peaks, extra)


def save_reference(path: Path, frames: np.ndarray, row: dict[str, Any], call: str) -> None:
    """ours-default's frames 0, REFERENCE_STRIDE, ... and what they were made of, for another call's agreement."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:  # an open file: np.savez would append .npz to a name without it
        np.savez_compressed(
            f, frames=frames[::REFERENCE_STRIDE], size=row["size"], steps=row["steps"], seed=SEED, call=call
        )


def load_reference(path: Path) -> dict[str, Any]:
    with np.load(path) as data:
        reference = {key: data[key] if key == "frames" else data[key].item() for key in data.files}
    if reference["seed"] != SEED:
        raise SystemExit(f"{path}: its frames are of seed {reference['seed']}, the timed requests' is {SEED}")
    return reference


def agree_with_reference(rows: dict[str, dict[str, Any]], frames: dict[str, np.ndarray], reference: dict) -> None:
    """PSNR of this call's variants against a reference from another call (`load_reference`), over the frames it
    holds, for rows of its size and steps."""
    for name, video in frames.items():
        row = rows.get(name)
        if (
            row is None
            or row.get("error")
            or (row.get("size"), row.get("steps")) != (reference["size"], reference["steps"])
        ):
            continue
        add_agreement({name: row}, {"ours-default": reference["frames"], name: video[::REFERENCE_STRIDE]})
        row["psnr_reference"] = f"ours-default of the call at {reference['call']}, frames 0, {REFERENCE_STRIDE}, ..."


def install_probe_in_worker(family: VideoFamily, module_name: str) -> None:
    """Called at the bottom of a family's script: where it runs as the main module of an engine worker
    that multiprocessing spawned (`__mp_main__`) for ours, time the worker's requests."""
    if module_name == "__mp_main__" and os.environ.get(PROBE_ENV):
        install_worker_probe(Path(os.environ[PROBE_ENV]), loop_start=family.loop_start)


# ---- results and docs ------------------------------------------------------------------------------


def row_key(family: VideoFamily, row: dict[str, Any]) -> str:
    """A row's key in the JSON's "variants": the variant, and its size where the family measures several."""
    return f"{row['variant']} {row['size']}" if family.several_sizes else row["variant"]


def rows_by_size(family: VideoFamily, results: dict[str, Any]) -> dict[str, dict[str, dict[str, Any]]]:
    """size -> variant -> row ("" -> every row for a family of one size), sizes in the family's order."""
    rows = results["variants"]
    if not family.several_sizes:
        return {"": rows}
    order = [scale.size for scale in (*family.sizes, family.tiny)]
    sizes = sorted({row.get("size") for row in rows.values()}, key=lambda s: order.index(s) if s in order else 99)
    return {size: {row["variant"]: row for row in rows.values() if row.get("size") == size} for size in sizes}


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _ok(row: dict[str, Any] | None) -> bool:
    return bool(row) and not row.get("error")


def _not_compared(ra: dict[str, Any], rb: dict[str, Any]) -> str:
    """Rows of two cards: no ratio between them, and why."""
    return f"measured on {ra.get('device')} and {rb.get('device')}: not compared"


def totals(rows: dict[str, dict[str, Any]], a: str, b: str) -> tuple[float | None, float | None, str]:
    """Both variants' extrapolated totals: with MP4 encoding where both measured it, else without."""
    ra, rb = rows.get(a), rows.get(b)
    if not (_ok(ra) and _ok(rb)):
        return None, None, ""
    if ra.get("device") != rb.get("device"):
        return None, None, _not_compared(ra, rb)
    if ra.get("extrapolated_with_mp4_s") is not None and rb.get("extrapolated_with_mp4_s") is not None:
        return ra["extrapolated_with_mp4_s"], rb["extrapolated_with_mp4_s"], "with MP4"
    return ra.get("extrapolated_s"), rb.get("extrapolated_s"), "without MP4"


def ratios(family: VideoFamily, rows: dict[str, dict[str, Any]], size: str = "") -> list[tuple[str, float | None, str]]:
    """(what, value, target) for the targets and the comparisons around them, over one size's rows."""

    def per_step(name: str) -> float | None:
        return rows[name].get("per_step_s") if _ok(rows.get(name)) else None

    out = []
    for a, b in COMPARISONS:
        x, y, mp4 = totals(rows, a, b)
        # A target keyed by the variant alone is against diffusers; "a / b" against another variant.
        target = family.targets.get(f"{a} / {b}") or (family.targets.get(a, "") if b == "diffusers-eager" else "")
        target = target if family.target_size in (None, size) else ""
        what = f"{a} / {b}, {family.full_steps}-step end to end extrapolated ({mp4 or 'n/a'})"
        out.append((what, _ratio(x, y), target))
    for name in STEP_VARIANTS:
        target = family.step_targets.get(name, "") if family.target_size in (None, size) else ""
        what, step_ratio = f"{name} / diffusers-eager, denoising s/step", None
        ra, rb = rows.get(name), rows.get("diffusers-eager")
        if _ok(ra) and _ok(rb) and ra.get("device") != rb.get("device"):
            what += f" ({_not_compared(ra, rb)})"
        else:
            step_ratio = _ratio(per_step(name), per_step("diffusers-eager"))
        out.append((what, step_ratio, target))
    published = family.published
    if published is None:
        return out
    out.append(
        (
            f"upstream vLLM-Omni / diffusers, published ({published['upstream_vllm_omni_s']} s / "
            f"{published['diffusers_s']} s)",
            _ratio(published["upstream_vllm_omni_s"], published["diffusers_s"]),
            "reference",
        )
    )
    diffusers_row = rows.get("diffusers-eager")
    if _ok(diffusers_row):
        with_mp4 = diffusers_row.get("extrapolated_with_mp4_s") is not None
        out.append(
            (
                f"diffusers-eager extrapolated ({'with' if with_mp4 else 'without'} MP4) / published diffusers "
                f"{published['diffusers_s']} s",
                _ratio(
                    diffusers_row.get("extrapolated_with_mp4_s") or diffusers_row.get("extrapolated_s"),
                    published["diffusers_s"],
                ),
                "reported",
            )
        )
    return out


def published_ratio(published: dict[str, float]) -> str:
    value = _ratio(published["upstream_vllm_omni_s"], published["diffusers_s"])
    return f"{published['upstream_vllm_omni_s']} s / {published['diffusers_s']} s = {value}"


def _verdict(value: float | None, target: str) -> str:
    """The verdict appended to a target "<= X ...": met or not met (the bound is its second word)."""
    if value is None or not target.startswith("<="):
        return ""
    return " (met)" if value <= float(target.split()[1]) else " (not met)"


def _psnr_cell(row: dict[str, Any]) -> str:
    """The agreement of a row's first timed frames with ours-default's, run in the same call."""
    if row["variant"] == "ours-default":
        return "reference"
    value = row.get("psnr_vs_ours_default_db")
    cell = f"{value} dB" if isinstance(value, float) else value or "not run with it"
    return f"{cell} (against {row['psnr_reference']})" if value and row.get("psnr_reference") else cell


def size_tables(family: VideoFamily, size: str, by_name: dict[str, dict[str, Any]]) -> list[str]:
    """One size's tables: the phases, the start and agreement, the ratios."""
    full = family.full_steps
    rows = [by_name[v.name] for v in family.variants if v.name in by_name]
    lines = [
        "| variant | card (attention kernel) | measured steps | measured denoising s/step | text s | latent prep s | "
        f"VAE decode s | other s | MP4 encode s | measured end to end s | extrapolated {full}-step total s | "
        "peak GPU memory GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['variant']} | error: {row['error']} |" + " |" * 10)
            continue
        mp4 = cell(row.get("mp4_s")) if row.get("mp4_s") is not None else "not measured"
        total = row.get("extrapolated_with_mp4_s")
        total_cell = cell(total, 1) if total is not None else f"{cell(row.get('extrapolated_s'), 1)} (without MP4)"
        card = str(row.get("device", "n/a"))
        if row.get("attention"):  # ours' dense attention kernel: ours-default's is FA4's where it is installed
            card += f" ({row['attention']})"
        cells = [
            card,
            cell(row.get("steps")),
            cell(row.get("per_step_s"), 3),
            *(cell(row.get(k)) for k in ("text_s", "prep_s", "decode_s", "other_s")),
            mp4,
            cell(row.get("e2e_s")),
            total_cell,
            cell(row.get("peak_alloc_gib"), 1),
        ]
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| variant | nvidia-smi peak GiB (whole variant) | graph captures (timed) | compile s (timed) | "
        "warm-up request s (captures, compile s) | start to ready s (load + engine warm-up) | PSNR vs ours-default |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("error"):
            continue
        warm = f"{cell(row.get('warmup_run_s'), 1)} ({cell(row.get('warmup_captures'))}, {cell(row.get('warmup_compile_s'), 1)})"  # noqa: E501
        start = f"load {cell(row.get('load_s'), 1)} (in this process)"
        if "start_to_ready_s" in row:
            start = f"{row['start_to_ready_s']:.1f} = {row['load_s']:.1f} + {row['engine_warmup_s']:.1f}"
            if row.get("engine_warmup_requests"):
                start += (
                    f" ({row['engine_warmup_requests']} requests, {cell(row.get('engine_warmup_captures'))} captures, "
                    f"{cell(row.get('engine_warmup_compile_s'), 1)} s compile)"
                )
        lines.append(
            f"| {row['variant']} | {cell(row.get('nvsmi_peak_gib'), 1)} | {cell(row.get('captures'))} | "
            f"{cell(row.get('compile_s'), 1)} | {warm} | {start} | {_psnr_cell(row)} |"
        )
    for row in rows:
        cache = row.get("step_cache")
        if cache and not row.get("error"):
            lines += [
                "",
                f"{row['variant']}: requests of the full {row['steps']} steps (nothing extrapolated); the step cache's "
                f"threshold {cell(cache['threshold'], 4)} is the median change of the first block that its warm-up "
                f"request (the same size and steps, the default threshold) measured; the timed request skipped "
                f"{cache['forwards_skipped']} of {cache['forwards']} forwards.",
            ]
    for row in rows:
        if row.get("onload_s") and not row.get("error"):
            total = row.get("extrapolated_s")
            share = f", {row['onload_s'] / total:.1%} of the {full}-step total" if total else ""
            lines += [
                "",
                f"{row['variant']}: each request moved {cell(row.get('onload_gib'), 1)} GiB of offloaded weights onto "
                f"the GPU in {cell(row['onload_s'], 2)} s (the copies' own time, CUDA events on the stream the work "
                f"waits on{share}); {cell(row.get('onload_loop_s'), 2)} s of it the denoisers' (the experts: once a "
                "request each, inside the loop, so counted once in the extrapolated total, not per step).",
            ]
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    for what, value, target in ratios(family, by_name, size):
        lines.append(f"| {what} | {cell(value, 3)} | {target}{_verdict(value, target)} |")
    return lines


def docs_section(family: VideoFamily, results: dict[str, Any]) -> str:
    full = family.full_steps
    lines = [f"## {family.title} end to end (ours vs diffusers)", ""]
    tables = {size: by_name for size, by_name in rows_by_size(family, results).items() if by_name}
    rows = [row for by_name in tables.values() for v in family.variants for row in [by_name.get(v.name)] if row]
    if not rows:
        return "\n".join([*lines, family.not_run_text])
    done = [row for row in rows if not row.get("error")]
    first = done[0] if done else {}
    tiny = any(row.get("scale") == "tiny" for row in rows)
    build = results.get("build") or {}
    if tiny:
        lines += ["**Tiny smoke run on CPU: these numbers mean nothing.**", ""]
    what = (
        "The tiny model's configs (float32, CPU workers), random weights in a safetensors folder; "
        if tiny
        else f"The whole text-to-video pipeline at real dimensions with random bf16 weights ({family.components_text}; "
        f"{cell((build.get('bytes') or 0) / 1e9, 1) if build else 'n/a'} GB), loaded from a safetensors folder; "
    )
    sizes = " and ".join(dict.fromkeys(row.get("size", "n/a") for row in done)) or "n/a"
    lines += [
        what + f"{sizes}, {first.get('frames', 'n/a')} frames, {family.cfg_text(first, build)}, "
        f"one fixed prompt and seed; {first.get('device', 'n/a')}, torch {first.get('torch', 'n/a')}, diffusers "
        f"{first.get('diffusers', 'n/a')}. Each variant: one untimed warm-up request at the same size "
        f"({first.get('warmup_steps', 'n/a')} step(s)), then the timed request(s) of the measured steps (medians). "
        f"**The {full}-step total is extrapolated**: the measured end to end less its loop, plus the loop's "
        f"seconds per step x {full}, that is the fixed phases (text encoding, latent preparation, VAE decode, "
        f"other) as measured plus denoising per step x {full}; plus MP4 encoding where it was measured. End to end "
        "is one call to uint8 frames [F, H, W, 3]: diffusers' `pipe(...)` (float frames, then converted as the engine "
        'does), ours `Omni.generate(..., output_type="uint8")`.',
        "",
    ]
    for size, by_name in tables.items():
        if family.several_sizes:
            frames = next((row.get("frames") for row in by_name.values() if row.get("frames")), "n/a")
            lines += [f"### {size}, {frames} frames", ""]
        lines += [*size_tables(family, size, by_name), ""]
    measured = {row_key(family, row) for row in done}
    missing = [
        f"{v.name}{' ' + scale.size if family.several_sizes else ''}"
        for scale in family.sizes
        for v in family.variants
        if row_key(family, {"variant": v.name, "size": scale.size}) not in measured
    ]
    if missing:
        lines += [f"Not measured yet (no row in {family.default_out.name}): {', '.join(missing)}.", ""]
    notes = {row["mp4_note"] for row in done if row.get("mp4_note")}
    calls: dict[str, list[str]] = {}
    for row in done:
        calls.setdefault(row.get("call", "not recorded"), []).append(
            f"{row['variant']}{' ' + row['size'] if family.several_sizes else ''}"
        )
    hosts = sorted({row.get("host") for row in rows} - {None})
    caches = ", ".join(
        f"{row['variant']}{' ' + row['size'] if family.several_sizes else ''} "
        f"{cell(row['inductor_cache_files_before'])}"
        for row in done
        if "inductor_cache_files_before" in row
    )
    lines += [
        "Phases (benchmarks/qwen_image_e2e.py's PhaseProbe; ours read in rank 0's worker): text encoding is the "
        f"pipeline's `encode_prompt` calls (prompt and negative prompt: {family.text_encoders_text}); latent "
        f"preparation runs from their end to the end of `{family.loop_start}` (timesteps, latents); the loop from "
        f"there to `vae.decode`, divided by the measured steps for s/step; VAE decode is `vae.decode` "
        f"({family.decode_text}); other is the rest of end "
        "to end (diffusers: video "
        "post-processing and the uint8 conversion; ours also the engine: validation, the trip to the worker and "
        "back). MP4 encoding is `media.encode_mp4` (PyAV, libx264) on the returned frames, outside end to end"
        + (f"; {'; '.join(sorted(notes))}" if notes else "")
        + ". PSNR vs ours-default: over all frames (uint8) of the first timed request, same prompt and seed, "
        "against ours-default run in the same call (random weights: a measure of the levers' numerical drift, "
        "not of quality). Each boundary synchronises the GPU. Peak GPU memory is torch's allocator peak during the "
        "timed request "
        "(ours: in the worker); nvidia-smi reports the whole device every 200 ms from the variant's start. Graph "
        f"captures and compile seconds are counted in the process that runs the transformer. {family.targets_text} "
        "The VAE decode split and its targets (the 8-way share at most 0.2x the untiled decode's time and 0.25x its "
        'peak memory) are measured by benchmarks/vae_decode.py: section "VAE decode" of this page. '
        + (
            f"Files in ours' inductor cache before each variant (a warm cache compiles faster): {caches}. "
            if caches
            else ""
        )
        + f"Rows from: {', '.join(hosts) or 'n/a'}; the calls that measured them (when each started; a ratio "
        "between rows of different calls compares separate starts of the machine): "
        + "; ".join(f"{when}: {', '.join(names)}" for when, names in sorted(calls.items()))
        + ".",
    ]
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------------


def main(family: VideoFamily, description: str, argv: list[str] | None = None) -> None:
    tiny = family.tiny
    by_name = family.by_name
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", nargs="+", choices=PHASES, required=True, help="phases to run, in this order")
    parser.add_argument("--variants", nargs="+", choices=list(by_name), help="only these variants of the phases")
    if family.several_sizes:
        sizes = [scale.size for scale in family.sizes]
        parser.add_argument("--size", choices=sizes, help=f"the request's size, one a call (default {sizes[0]})")
    parser.add_argument(
        "--tiny",
        action="store_true",
        help=f"smoke mode: tiny model on CPU, {tiny.size}, {tiny.frames} frames, {tiny.steps} steps",
    )
    default_folder = f"/tmp/{family.folder_name}[-tiny]"
    parser.add_argument("--folder", type=Path, help=f"checkpoint folder (default {default_folder})")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the checkpoint folder even if present")
    parser.add_argument(
        "--steps", type=int, help=f"denoising steps measured (default {family.full_steps}; --tiny {tiny.steps})"
    )
    parser.add_argument("--runs", type=int, default=1, help="timed requests per variant (%(default)s)")
    parser.add_argument(
        "--warmup-steps", type=int, default=1, help="steps of the untimed warm-up request; 0: none (%(default)s)"
    )
    default_out = family.default_out
    parser.add_argument("--out", type=Path, help=f"results JSON (default {default_out.relative_to(ROOT)})")
    parser.add_argument("--docs", type=Path, help=f"docs page (default {DEFAULT_DOCS.relative_to(ROOT)})")
    parser.add_argument("--copy-to", type=Path, help="also copy the JSON and the docs page here after each save")
    parser.add_argument(
        "--save-reference",
        type=Path,
        help=f"write ours-default's frames 0, {REFERENCE_STRIDE}, ... (its size, steps, call) to this .npz when it "
        "runs, for --reference in another call",
    )
    parser.add_argument(
        "--reference",
        type=Path,
        help="an .npz from --save-reference: the agreement of this call's variants where ours-default does not run "
        "in it (at the reference's size and steps)",
    )
    args = parser.parse_args(argv)

    size = getattr(args, "size", None)
    if args.tiny and size:
        raise SystemExit("--size is for the real model; --tiny runs its own small size")
    scale = tiny if args.tiny else next((s for s in family.sizes if s.size == size), family.sizes[0])
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit("--steps must be at least 1")
        scale = dataclasses.replace(scale, steps=args.steps)
    scratch = Path(tempfile.gettempdir())
    folder = (args.folder or scratch / f"{family.folder_name}{'-tiny' if args.tiny else ''}").resolve()
    out = args.out or (scratch / f"{family.key}_tiny.json" if args.tiny else default_out)
    docs = args.docs or (scratch / f"{family.key}_tiny.md" if args.tiny else DEFAULT_DOCS)
    if args.tiny and {out.resolve(), docs.resolve()} & {default_out.resolve(), DEFAULT_DOCS.resolve()}:
        raise SystemExit("--tiny must not write the committed results or docs: give --out and --docs elsewhere")
    selected = [v for v in family.variants if v.phase in args.phase and (not args.variants or v.name in args.variants)]
    if not args.tiny and set(args.phase) - {"docs"}:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < 1:
            raise SystemExit("these phases need a CUDA GPU; --tiny runs on CPU")

    settings = Settings(family, scale, folder, args.runs, args.warmup_steps)
    results = load_results(out)
    call = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())  # rows of one call compare side by side
    reference = load_reference(args.reference) if args.reference else None

    def save() -> None:
        save_results(results, out, docs, key=family.key, section=lambda results: docs_section(family, results))
        copy_outputs(args.copy_to, out, docs)

    def keep(row: dict[str, Any]) -> None:
        row.setdefault("size", scale.size)  # a failed row's too: it is kept under its size
        row["call"] = call
        results["variants"][row_key(family, row)] = row
        this_size = {r["variant"]: r for r in results["variants"].values() if r.get("size") == scale.size}
        # FRAMES holds this call's variants, all at this size; only those of ours-default's steps compare with it.
        steps = this_size.get("ours-default", {}).get("steps")
        add_agreement({name: r for name, r in this_size.items() if r.get("steps") == steps}, FRAMES)
        if reference is not None and "ours-default" not in FRAMES:
            agree_with_reference(this_size, FRAMES, reference)
        if args.save_reference and row["variant"] == "ours-default" and "ours-default" in FRAMES:
            save_reference(args.save_reference, FRAMES["ours-default"], row, call)
        save()  # after each variant: a call cut short keeps what it measured

    for phase in args.phase:
        names = [v.name for v in selected if v.phase == phase]
        if phase == "build":
            record = build_checkpoint(family, scale, folder, args.rebuild)
            if record is not None:
                results["build"] = record
                save()
            continue
        if phase == "docs":
            save()
            continue
        if not (folder / BUILD_MARKER).is_file():
            raise SystemExit(f"{folder} holds no checkpoint: run --phase build first (same --folder)")
        if phase == "diffusers" and names:
            run_diffusers(settings, names, keep)
        elif phase == "ours" and names:
            probe_root = Path(tempfile.mkdtemp(prefix=f"{family.key}_probe_"))
            for name in names:
                try:
                    row = run_ours(settings, by_name[name], probe_root)
                except Exception as exc:  # noqa: BLE001 - recorded in the results; the next variant still runs
                    row = failed_row(by_name[name], settings, exc)
                keep(row)
            shutil.rmtree(probe_root, ignore_errors=True)
    for size, rows in rows_by_size(family, results).items():
        for what, value, target in ratios(family, rows, size):
            print(f"{(size + ': ') if size else ''}{what}: {cell(value, 3)} {target}", flush=True)
    print(f"results: {out}\ndocs: {docs}", flush=True)
