"""HunyuanVideo 1.5 end to end: the whole text-to-video pipeline, ours against diffusers, on one GPU.

Real dimensions with random bf16 weights, configs written below (no downloads): the 480p
transformer (benchmarks/hunyuan_video_sp.py's REAL_CONFIG: 54 layers, 16 heads x 128; 8.33B), a
Qwen2.5-VL-7B text model as the text encoder (`Qwen2_5_VLTextModel`, what HunyuanVideo15Pipeline
loads; 7.07B), a ByT5-small-sized glyph encoder (`T5EncoderModel`, d_model 1472; 0.22B), the VAE
(`AutoencoderKLHunyuanVideo15`, whose class defaults are the released config; 1.26B), and the tiny
model's tokenizers, scheduler (flow shift 5) and guider (CFG scale 6): the classes
vllm_omni/diffusion/models/hunyuan_video_15/tiny.py builds, at real size. Token counts, not ids,
set the cost; the tiny tokenizers' ids are below the real vocabularies. The request: 848x480, 121
frames, CFG as the pipeline runs it (the guider's scale 6, negative prompt ""), one fixed prompt
(no quoted text: the pipeline gives ByT5 nothing to encode) and seed. Variants, by phase:

    build      the random-weight checkpoint folder (safetensors, 33.8 GB), weights made on the GPU in bf16
    diffusers  diffusers-eager: HunyuanVideo15Pipeline as is (one GPU, in this process)
    ours       ours-default: Omni(folder) (compiled blocks, CUDA graphs, its warm-up requests);
               ours-eager: Omni(folder, enforce_eager=True);
               ours-fp8-attention: FP8 attention (cudnn_fp8) in every step (issue 33);
               ours-fp8-levers: the same and FP8 matmuls (quantization="fp8").
               Each variant run after ours-default in one call gets the PSNR of its frames against ours-default's.

A full 50-step request takes about 19 minutes in diffusers on one H200, longer than one device
call, so `--steps N` (default 50) measures N steps and the 50-step total is extrapolated: the
fixed phases (text encoding, latent preparation, VAE decode, the rest of the call, MP4 encoding)
as measured, plus the measured denoising seconds per step times 50. Each variant runs one untimed
warm-up request at the full size (--warmup-steps, default 1; its own seed), then --runs timed ones
(default 1). Phases are timed with benchmarks/qwen_image_e2e.py's PhaseProbe (text: the
`encode_prompt` calls; latent preparation: to the end of `prepare_cond_latents_and_mask`; the loop:
from there to `vae.decode`; decode: `vae.decode`), in this process for diffusers and inside the
engine's worker for ours (this script, re-run as the spawned worker's `__mp_main__`, installs the
probe there when the probe directory variable is set). MP4 encoding times the project's encoder
(vllm_omni/entrypoints/openai/media.py, PyAV) on the returned uint8 frames; where PyAV is missing
(the GPU machine has none) the column says "not measured". The VAE decode split (whole untiled,
tiled, one rank's share of an 8-way split) is not measured here: benchmarks/vae_decode.py does it
(section "VAE decode" of docs/benchmarks.md), with its targets (the 8-way share at most 0.2x the
untiled decode's time and 0.25x its peak memory).

Each phase merges its rows into the JSON and rewrites the docs section from every row there, so
phases can run in separate calls; `--phase docs` only rewrites the docs from the JSON (no GPU).
Two calls on the one-GPU kind (64 GiB disk: the folder takes 33.8 GB; the script checks), each well
inside 10 minutes. The estimates below come from earlier measurements in docs/benchmarks.md (one
forward at 848x480x121: ours 2.92 s eager, 2.43 s compiled, diffusers 8.70 s, two forwards a step
for CFG; the VAE decode 4.8 s untiled, benchmarks/vae_decode.py) and from Qwen-Image's end-to-end
calls (build, load and engine start):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 python3 benchmarks/hunyuan_video_e2e.py --copy-to $OUT --steps 3 --phase build diffusers ours --variants diffusers-eager ours-eager
    PYTHONUNBUFFERED=1 python3 benchmarks/hunyuan_video_e2e.py --copy-to $OUT --steps 3 --phase build ours --variants ours-default
    PYTHONUNBUFFERED=1 python3 benchmarks/hunyuan_video_e2e.py --copy-to $OUT --steps 3 --phase build ours --variants ours-default ours-fp8-attention
    PYTHONUNBUFFERED=1 python3 benchmarks/hunyuan_video_e2e.py --copy-to $OUT --steps 3 --phase build ours --variants ours-default ours-fp8-levers

(the first line starts every call, `.whl` carried). The first call: build 1 to 2 min; diffusers
about 1.5 min (load, a 1-step warm-up of 2 x 8.7 + 4.8 s, 3 timed steps: 52 s + 4.8 s decode);
ours-eager about 1.5 min (start ~35 s, warm-up ~11 s, 3 steps: 18 s + decode). About 4.5 minutes.
The second: build again (a machine given back between calls, 30 s after one, comes back bare;
`build` is a no-op when --folder, default /tmp/hunyuan-video-e2e, already holds the checkpoint), then
ours-default: start ~35 s plus the engine's two warm-up requests (compiling the blocks, 2 steps at
the full size, then 2 at 768x768x5 with the sequence lengths dynamic: 2 to 3 min, an estimate
with an empty inductor cache), its warm-up and 3 steps (~35 s). About 5 minutes. The third and fourth run ours-default again
beside each lever variant, for the agreement (frames stay in the process), about 9 minutes each.
--copy-to puts
the JSON and the docs page into $OUT after every variant (a call cut short keeps what it
finished); copy the returned JSON to benchmarks/results/ before the next call so the phases
accumulate, and finish with `--phase docs` here. The smoke mode, on CPU:

    python benchmarks/hunyuan_video_e2e.py --tiny --phase build diffusers ours --out /tmp/hv.json --docs /tmp/hv.md

runs the same code with the tiny model's configs (tiny/hunyuan-video-1.5: 208x144, 9 frames,
2 steps, float32, CPU workers); its numbers mean nothing.
"""  # noqa: E501

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

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.hunyuan_video_sp import REAL_CONFIG as REAL_TRANSFORMER  # noqa: E402
from benchmarks.qwen_image_e2e import (  # noqa: E402
    REAL_TEXT,
    DeviceMemorySampler,
    PhaseProbe,
    _cell,
    add_agreement,
    already_built,
    commit_checkpoint,
    copy_outputs,
    default_dtype,
    failed_row,
    filesystem_of,
    inductor_cache_files,
    install_worker_probe,
    load_results,
    prepare_partial,
    probe_records,
    save_results,
    save_synced,
)

KEY = "hunyuan_video_e2e"
DEFAULT_OUT = ROOT / f"benchmarks/results/{KEY}.json"
DEFAULT_DOCS = ROOT / "docs/benchmarks.md"
PROBE_ENV = "HUNYUAN_VIDEO_E2E_PROBE_DIR"
BUILD_MARKER = "e2e_build.json"
TINY_MODEL = "tiny/hunyuan-video-1.5"
# The pipeline method called once right before the denoising loop (after timesteps and latents).
LOOP_START = "prepare_cond_latents_and_mask"

# Words the tiny tokenizer keeps whole (its corpus), so it counts about as many tokens as Qwen's.
PROMPT = "A futuristic train crossing a bridge over a canyon, clouds below, wide angle."
SEED = 1000
WARMUP_SEED = 0
FULL_STEPS = 50  # the request's steps; fewer measured are extrapolated to these
FPS = 24  # the engine's default frame rate for HunyuanVideo 1.5 (registry: default_fps)
# Published for this request (848x480, 121 frames, 50 steps, one H200): what the target compares with.
PUBLISHED = {"diffusers_s": 1135.7, "upstream_vllm_omni_s": 259.4}

# ByT5-small's encoder (the glyph encoder HunyuanVideo 1.5 uses has its dimensions); the vocabulary
# is the tiny ByT5 tokenizer's (bytes, specials, extra ids), set at build time.
REAL_GLYPH = dict(
    d_model=1472,
    d_kv=64,
    d_ff=3584,
    num_layers=12,
    num_heads=6,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    layer_norm_epsilon=1e-6,
    dropout_rate=0.1,
    is_encoder_decoder=False,
    use_cache=False,
    tie_word_embeddings=False,
)
# AutoencoderKLHunyuanVideo15's defaults, which are the released VAE's config, written out.
REAL_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=32,
    block_out_channels=(128, 256, 512, 1024, 1024),
    layers_per_block=2,
    spatial_compression_ratio=16,
    temporal_compression_ratio=4,
    downsample_match_channel=True,
    upsample_match_channel=True,
    scaling_factor=1.03682,
)


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


REAL = Scale("real", 848, 480, 121, FULL_STEPS, "cuda", "bfloat16")
TINY = Scale("tiny", 208, 144, 9, 2, "cpu", "float32")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    phase: str
    gpus: int
    what: str
    omni: dict[str, Any] | None = None  # Omni keyword arguments (ours)


VARIANTS = [
    Variant("diffusers-eager", "diffusers", 1, "diffusers HunyuanVideo15Pipeline, eager"),
    Variant("ours-default", "ours", 1, "Omni(folder): compiled blocks, CUDA graphs, warm-up requests", {}),
    Variant(
        "ours-eager", "ours", 1, "Omni(folder, enforce_eager=True): no compile, no graphs", {"enforce_eager": True}
    ),
    # Every timed step in FP8 (a --steps 3 run would otherwise have none): the 50-step figure is 50 FP8 steps; with
    # the default --fp8-attention-full-steps 2, 4 of them would run exact attention.
    Variant(
        "ours-fp8-attention",
        "ours",
        1,
        "Omni(folder, attention_backend='cudnn_fp8', fp8_attention_full_steps=0): FP8 attention in every step",
        {"attention_backend": "cudnn_fp8", "fp8_attention_full_steps": 0},
    ),
    # The levers together (issue 33), every timed step in FP8 as above. Not the step cache: with 3 measured steps
    # it skips at most a forward or two, which says nothing of a 50-step request's skips (a full run would).
    Variant(
        "ours-fp8-levers",
        "ours",
        1,
        "Omni(folder, attention_backend='cudnn_fp8', fp8_attention_full_steps=0, quantization='fp8')",
        {"attention_backend": "cudnn_fp8", "fp8_attention_full_steps": 0, "quantization": "fp8"},
    ),
]
# The first timed run's frames of each variant run in this process: agreement with ours-default's (PSNR).
FRAMES: dict[str, np.ndarray] = {}
BY_NAME = {variant.name: variant for variant in VARIANTS}
PHASES = ["build", "diffusers", "ours", "docs"]  # docs: rewrite the docs section from the JSON


@dataclasses.dataclass
class Settings:
    scale: Scale
    folder: Path
    runs: int
    warmup_steps: int

    def call_kwargs(self, steps: int) -> dict[str, Any]:
        """The request's fields, for diffusers' `pipe(...)` and `Omni.generate(...)` alike."""
        s = self.scale
        return dict(height=s.height, width=s.width, num_frames=s.frames, num_inference_steps=steps)

    def requests(self) -> list[tuple[str, int, int]]:
        """(label, seed, steps): the untimed warm-up request (unless --warmup-steps 0), then the timed ones."""
        warmup = [("warm-up", WARMUP_SEED, self.warmup_steps)] if self.warmup_steps > 0 else []
        return warmup + [(f"run {i}", SEED, self.scale.steps) for i in range(self.runs)]


# ---- the checkpoint folder -------------------------------------------------------------------------


def tiny_folder() -> Path:
    from vllm_omni.diffusion.models.hunyuan_video_15.tiny import tiny_model_path

    return tiny_model_path(TINY_MODEL)


def component_configs(scale: Scale, tokenizer: Any, tokenizer_2: Any) -> dict[str, Any]:
    """Each weighted component's config: the dicts above (real), or the tiny model's own (tiny)."""
    import diffusers
    from transformers import Qwen2_5_VLTextConfig, T5Config

    from vllm_omni.diffusion.models.tiny_qwen_tokenizer import special_token_ids

    if scale.name == "tiny":
        tiny = tiny_folder()
        return {
            "transformer": diffusers.HunyuanVideo15Transformer3DModel.load_config(tiny / "transformer"),
            "text_encoder": Qwen2_5_VLTextConfig.from_pretrained(tiny / "text_encoder"),
            "text_encoder_2": T5Config.from_pretrained(tiny / "text_encoder_2"),
            "vae": diffusers.AutoencoderKLHunyuanVideo15.load_config(tiny / "vae"),
        }
    ids = special_token_ids(tokenizer)
    text = Qwen2_5_VLTextConfig(**REAL_TEXT, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"])
    return {
        "transformer": dict(REAL_TRANSFORMER),
        "text_encoder": text,
        "text_encoder_2": T5Config(vocab_size=len(tokenizer_2), **REAL_GLYPH),
        "vae": dict(REAL_VAE),
    }


def build_checkpoint(scale: Scale, folder: Path, rebuild: bool) -> dict[str, Any] | None:
    """Write the random-weight HunyuanVideo15Pipeline folder (safetensors); None when it is already there.

    The weights are made on the target device in the target dtype (seconds on a GPU), then saved
    into `<folder>.partial`, synced to disk and renamed: a folder with the marker is complete.
    """
    if already_built(folder, scale.name, rebuild):
        return None

    import diffusers
    from transformers import ByT5Tokenizer, Qwen2_5_VLTextModel, Qwen2Tokenizer, T5EncoderModel

    tiny = tiny_folder()
    tokenizer = Qwen2Tokenizer.from_pretrained(tiny / "tokenizer")
    tokenizer_2 = ByT5Tokenizer.from_pretrained(tiny / "tokenizer_2")
    configs = component_configs(scale, tokenizer, tokenizer_2)
    if len(tokenizer) > configs["text_encoder"].vocab_size or len(tokenizer_2) > configs["text_encoder_2"].vocab_size:
        raise SystemExit("the tiny tokenizers' ids do not fit the vocabularies")
    device, dtype = torch.device(scale.device), scale.torch_dtype
    start = time.perf_counter()
    torch.manual_seed(0)
    with default_dtype(dtype), device:
        components = {
            "transformer": diffusers.HunyuanVideo15Transformer3DModel.from_config(configs["transformer"]),
            "text_encoder": Qwen2_5_VLTextModel(configs["text_encoder"]),
            "text_encoder_2": T5EncoderModel(configs["text_encoder_2"]),
            "vae": diffusers.AutoencoderKLHunyuanVideo15.from_config(configs["vae"]),
        }
    init_s, params, partial = prepare_partial(components, device, dtype, start, folder)

    pipe = diffusers.HunyuanVideo15Pipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(tiny / "scheduler"),
        guider=diffusers.ClassifierFreeGuidance.from_config(
            diffusers.ClassifierFreeGuidance.load_config(tiny / "guider")
        ),
        tokenizer=tokenizer,
        tokenizer_2=tokenizer_2,
        **components,
    )
    files, write_s, written = save_synced(pipe, partial)
    record = {
        "scale": scale.name,
        "parameters": params,
        "bytes": written,
        "safetensors_files": sum(path.suffix == ".safetensors" for path in files),
        "flow_shift": pipe.scheduler.config.shift,
        "guidance_scale": pipe.guider.guidance_scale,
        "init_s": round(init_s, 2),
        "write_s": round(write_s, 2),
        "write_gb_per_s": round(written / write_s / 1e9, 3),
        "filesystem": filesystem_of(partial),
        "host": socket.gethostname(),
    }
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


def split_run(record: dict[str, Any], e2e_s: float, steps: int) -> dict[str, Any]:
    """One run: end to end, its phases (None where not measured), other = the rest of end to end,
    the loop's seconds per step and the end to end extrapolated to FULL_STEPS (MP4 excluded)."""
    keys = ("text_s", "prep_s", "loop_s", "decode_s")
    phases = {key: record.get(key) for key in keys}
    measured = None not in phases.values()
    row: dict[str, Any] = {"e2e_s": e2e_s, **phases, "other_s": e2e_s - sum(phases.values()) if measured else None}
    per_step = phases["loop_s"] / steps if phases["loop_s"] is not None else None
    row["per_step_s"] = per_step
    row["steps"] = steps
    row["extrapolated_s"] = e2e_s - phases["loop_s"] + per_step * FULL_STEPS if per_step is not None else None
    row.update({key: record.get(key) for key in ("call_s", "compile_s", "captures", "capture_s")})
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
    row = {
        "variant": variant.name,
        "phase": variant.phase,
        "gpus": variant.gpus,
        "what": variant.what,
        "scale": settings.scale.name,
        "size": settings.scale.size,
        "frames": settings.scale.frames,
        "steps": settings.scale.steps,
        "extrapolated_steps": FULL_STEPS,
        "warmup_steps": settings.warmup_steps,
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

    scale = settings.scale
    device = torch.device(scale.device, 0) if scale.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    try:
        # Loaded as the engine's runner loads it: the transformer straight onto the device, the rest moved.
        transformer = diffusers.HunyuanVideo15Transformer3DModel.from_pretrained(
            settings.folder, subfolder="transformer", dtype=scale.torch_dtype, device_map=str(device)
        )
        pipe = diffusers.HunyuanVideo15Pipeline.from_pretrained(
            settings.folder, transformer=transformer, dtype=scale.torch_dtype
        ).to(device)
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        for name in names:
            keep(failed_row(BY_NAME[name], settings, exc))
        return
    load_s = time.perf_counter() - start
    pipe.set_progress_bar_config(disable=True)
    probe = PhaseProbe(pipe, device, loop_start=LOOP_START)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for name in names:
        variant = BY_NAME[name]
        try:
            runs, peaks = [], []
            with DeviceMemorySampler(device.type == "cuda") as sampler:
                for label, seed, steps in settings.requests():
                    probe.begin()
                    generator = torch.Generator("cpu").manual_seed(seed)
                    result = pipe(prompt=PROMPT, generator=generator, output_type="np", **settings.call_kwargs(steps))
                    record = probe.end()
                    frames = to_uint8(result.frames[0])  # what ours returns: uint8 [F, H, W, 3]
                    e2e_s = time.perf_counter() - probe.start
                    run = dict(split_run(record, e2e_s, steps), label=label, seed=seed)
                    del result
                    if label != "warm-up":
                        peaks.append([record["peak_alloc_gib"]])
                        run.update(time_mp4(frames, FPS))
                    runs.append(run)
                    del frames
                    print(f"{name} {label}: {run}", flush=True)
            extra = {"device": device_name, "load_s": round(load_s, 2), "nvsmi_peak_gib": sampler.peaks_gib(1)}
            extra["guidance_scale"] = pipe.guider.guidance_scale
            keep(summarize(variant, settings, runs, peaks, extra))
        except Exception as exc:  # noqa: BLE001 - recorded in the results
            keep(failed_row(variant, settings, exc))
    del pipe, transformer, probe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()  # the engine's worker needs the GPU next


def run_ours(settings: Settings, variant: Variant, probe_root: Path) -> dict[str, Any]:
    """Start Omni(folder), then run the requests; the phases come from rank 0's worker."""
    from vllm_omni import Omni

    scale = settings.scale
    probe_dir = probe_root / variant.name
    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    os.environ[PROBE_ENV] = str(probe_dir)  # the workers inherit it and install the probe
    runs, peaks, worker, warmup_records = [], [], {}, []
    cache_files = inductor_cache_files(ours=True)
    try:
        with DeviceMemorySampler(scale.device == "cuda") as sampler:
            start = time.perf_counter()
            omni = Omni(str(settings.folder), device=scale.device, dtype=scale.dtype, **variant.omni)
            ready_s = time.perf_counter() - start
            try:
                engine_warmup_s = omni.engine.warmup_s or 0.0
                # The engine's own warm-up requests (engine.warmup_requests: two with compiled blocks).
                warmup_records = [probe_records(probe_dir, id_).get(0, {}) for id_ in ("warm-up", "warm-up-2")]
                for label, seed, steps in settings.requests():
                    start = time.perf_counter()
                    videos = omni.generate(PROMPT, seed=seed, output_type="uint8", **settings.call_kwargs(steps))
                    e2e_s = time.perf_counter() - start
                    records = probe_records(probe_dir, omni.last_output.request_id)
                    if 0 not in records:
                        raise RuntimeError(
                            f"no probe record from rank 0 in {probe_dir}: the worker probe is not loaded"
                        )
                    worker = records[0]
                    run = dict(split_run(worker, e2e_s, steps), label=label, seed=seed)
                    if label != "warm-up":
                        peaks.append([records[r]["peak_alloc_gib"] for r in sorted(records)])
                        run.update(time_mp4(videos[0], omni.last_output.fps or FPS))
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
        "start_to_ready_s": round(ready_s, 2),
        "engine_warmup_s": round(engine_warmup_s, 2),
        "load_s": round(ready_s - engine_warmup_s, 2),
        "engine_warmup_requests": sum(1 for record in warmup_records if record),
        "engine_warmup_compile_s": warmup_total("compile_s"),
        "engine_warmup_captures": warmup_total("captures"),
        "inductor_cache_files_before": cache_files,
        "nvsmi_peak_gib": sampler.peaks_gib(variant.gpus),
    }
    return summarize(variant, settings, runs, peaks, extra)


# ---- results and docs ------------------------------------------------------------------------------


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _ok(row: dict[str, Any] | None) -> bool:
    return bool(row) and not row.get("error")


def totals(results: dict[str, Any], a: str, b: str) -> tuple[float | None, float | None, str]:
    """Both variants' extrapolated totals: with MP4 encoding where both measured it, else without."""
    rows = results["variants"]
    ra, rb = rows.get(a), rows.get(b)
    if not (_ok(ra) and _ok(rb)):
        return None, None, ""
    if ra.get("extrapolated_with_mp4_s") is not None and rb.get("extrapolated_with_mp4_s") is not None:
        return ra["extrapolated_with_mp4_s"], rb["extrapolated_with_mp4_s"], "with MP4"
    return ra.get("extrapolated_s"), rb.get("extrapolated_s"), "without MP4"


def ratios(results: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    """(what, value, target) for the targets and the comparisons around them."""
    rows = results["variants"]

    def per_step(name: str) -> float | None:
        return rows[name].get("per_step_s") if _ok(rows.get(name)) else None

    out = []
    for a, b, target in (
        ("ours-default", "diffusers-eager", "<= 0.2"),
        ("ours-eager", "diffusers-eager", ""),
        ("ours-default", "ours-eager", ""),
        ("ours-fp8-attention", "diffusers-eager", "<= 0.2 (issue 33)"),
        ("ours-fp8-attention", "ours-default", ""),
        ("ours-fp8-levers", "diffusers-eager", "<= 0.2 (issue 33)"),
        ("ours-fp8-levers", "ours-default", ""),
    ):
        x, y, mp4 = totals(results, a, b)
        out.append((f"{a} / {b}, {FULL_STEPS}-step end to end extrapolated ({mp4 or 'n/a'})", _ratio(x, y), target))
    step_ratio = _ratio(per_step("ours-default"), per_step("diffusers-eager"))
    out.append(("ours-default / diffusers-eager, denoising s/step", step_ratio, ""))
    published = _ratio(PUBLISHED["upstream_vllm_omni_s"], PUBLISHED["diffusers_s"])
    out.append(
        (
            f"upstream vLLM-Omni / diffusers, published ({PUBLISHED['upstream_vllm_omni_s']} s / "
            f"{PUBLISHED['diffusers_s']} s)",
            published,
            "reference",
        )
    )
    diffusers_row = rows.get("diffusers-eager")
    if _ok(diffusers_row):
        with_mp4 = diffusers_row.get("extrapolated_with_mp4_s") is not None
        out.append(
            (
                f"diffusers-eager extrapolated ({'with' if with_mp4 else 'without'} MP4) / published diffusers "
                f"{PUBLISHED['diffusers_s']} s",
                _ratio(
                    diffusers_row.get("extrapolated_with_mp4_s") or diffusers_row.get("extrapolated_s"),
                    PUBLISHED["diffusers_s"],
                ),
                "reported",
            )
        )
    return out


def not_run_yet() -> str:
    return (
        "Not run yet. On one H200, two calls (the docstring of benchmarks/hunyuan_video_e2e.py gives the whole "
        "command lines): `--steps 3 --phase build diffusers ours --variants diffusers-eager ours-eager`, then "
        "`--steps 3 --phase build ours --variants ours-default`."
    )


def docs_section(results: dict[str, Any]) -> str:
    rows = [results["variants"][v.name] for v in VARIANTS if v.name in results["variants"]]
    lines = ["## HunyuanVideo 1.5 end to end (ours vs diffusers)", ""]
    if not rows:
        return "\n".join([*lines, not_run_yet()])
    done = [row for row in rows if not row.get("error")]
    first = done[0] if done else {}
    tiny = any(row.get("scale") == "tiny" for row in rows)
    build = results.get("build") or {}
    if tiny:
        lines += ["**Tiny smoke run on CPU: these numbers mean nothing.**", ""]
    what = (
        "The tiny model's configs (float32, CPU workers), random weights in a safetensors folder; "
        if tiny
        else "The whole text-to-video pipeline at real dimensions with random bf16 weights (transformer 8.33B, "
        "Qwen2.5-VL-7B text model, ByT5-small-sized glyph encoder, the released VAE config; "
        f"{_cell((build.get('bytes') or 0) / 1e9, 1) if build else 'n/a'} GB), loaded from a safetensors folder; "
    )
    lines += [
        what + f"{first.get('size', 'n/a')}, {first.get('frames', 'n/a')} frames, CFG as the pipeline runs it (the "
        f'guider\'s scale {first.get("guidance_scale", build.get("guidance_scale", "n/a"))}, negative prompt ""), '
        f"one fixed prompt and seed; {first.get('device', 'n/a')}, torch {first.get('torch', 'n/a')}, diffusers "
        f"{first.get('diffusers', 'n/a')}. Each variant: one untimed warm-up request at the same size "
        f"({first.get('warmup_steps', 'n/a')} step(s)), then the timed request(s) of the measured steps (medians). "
        f"**The {FULL_STEPS}-step total is extrapolated**: the measured end to end less its loop, plus the loop's "
        f"seconds per step x {FULL_STEPS}, that is the fixed phases (text encoding, latent preparation, VAE decode, "
        "other) as measured plus denoising per step x 50; plus MP4 encoding where it was measured. End to end is "
        "one call to uint8 frames [F, H, W, 3]: diffusers' `pipe(...)` (float frames, then converted as the engine "
        'does), ours `Omni.generate(..., output_type="uint8")`.',
        "",
        "| variant | measured steps | measured denoising s/step | text s | latent prep s | VAE decode s | other s | "
        "MP4 encode s | measured end to end s | extrapolated 50-step total s | peak GPU memory GiB |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['variant']} | error: {row['error']} |" + " |" * 9)
            continue
        mp4 = _cell(row.get("mp4_s")) if row.get("mp4_s") is not None else "not measured"
        total = row.get("extrapolated_with_mp4_s")
        total_cell = _cell(total, 1) if total is not None else f"{_cell(row.get('extrapolated_s'), 1)} (without MP4)"
        cells = [
            _cell(row.get("steps")),
            _cell(row.get("per_step_s"), 3),
            *(_cell(row.get(k)) for k in ("text_s", "prep_s", "decode_s", "other_s")),
            mp4,
            _cell(row.get("e2e_s")),
            total_cell,
            _cell(row.get("peak_alloc_gib"), 1),
        ]
        lines.append(f"| {row['variant']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "| variant | nvidia-smi peak GiB (whole variant) | graph captures (timed) | compile s (timed) | "
        "warm-up request s (captures, compile s) | start to ready s (load + engine warm-up) | PSNR vs ours-default |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in done:
        warm = f"{_cell(row.get('warmup_run_s'), 1)} ({_cell(row.get('warmup_captures'))}, {_cell(row.get('warmup_compile_s'), 1)})"  # noqa: E501
        start = f"load {_cell(row.get('load_s'), 1)} (in this process)"
        if "start_to_ready_s" in row:
            start = f"{row['start_to_ready_s']:.1f} = {row['load_s']:.1f} + {row['engine_warmup_s']:.1f}"
            if row.get("engine_warmup_requests"):
                start += (
                    f" ({row['engine_warmup_requests']} requests, {_cell(row.get('engine_warmup_captures'))} captures, "
                    f"{_cell(row.get('engine_warmup_compile_s'), 1)} s compile)"
                )
        lines.append(
            f"| {row['variant']} | {_cell(row.get('nvsmi_peak_gib'), 1)} | {_cell(row.get('captures'))} | "
            f"{_cell(row.get('compile_s'), 1)} | {warm} | {start} | {_psnr_cell(row)} |"
        )
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    for what, value, target in ratios(results):
        verdict = ""
        if value is not None and target.startswith("<="):
            verdict = " (met)" if value <= float(target.split()[-1]) else " (not met)"
        lines.append(f"| {what} | {_cell(value, 3)} | {target}{verdict} |")
    notes = {row["mp4_note"] for row in done if row.get("mp4_note")}
    hosts = sorted({row.get("host") for row in rows} - {None})
    caches = ", ".join(
        f"{row['variant']} {_cell(row['inductor_cache_files_before'])}"
        for row in done
        if "inductor_cache_files_before" in row
    )
    lines += [
        "",
        "Phases (benchmarks/qwen_image_e2e.py's PhaseProbe; ours read in rank 0's worker): text encoding is the "
        "pipeline's `encode_prompt` calls (prompt and negative prompt: Qwen2.5-VL; ByT5 runs only on quoted text, "
        "none here); latent preparation runs from their end to the end of `prepare_cond_latents_and_mask` "
        "(timesteps, latents); the loop from there to `vae.decode`, divided by the measured steps for s/step; VAE "
        "decode is `vae.decode` (diffusers: untiled; ours: tiled where the rank cannot allocate the untiled decode "
        "within its cap, 0.9 of the card by default, as at 848x480x121 beside the weights); other is the rest of end "
        "to end (diffusers: video "
        "post-processing and the uint8 conversion; ours also the engine: validation, the trip to the worker and "
        "back). MP4 encoding is `media.encode_mp4` (PyAV, libx264) on the returned frames, outside end to end"
        + (f"; {'; '.join(sorted(notes))}" if notes else "")
        + ". PSNR vs ours-default: over all frames (uint8) of the first timed request, same prompt and seed, "
        "against ours-default run in the same call (random weights: a measure of the levers' numerical drift, "
        "not of quality). Each boundary synchronises the GPU. Peak GPU memory is torch's allocator peak during the "
        "timed request "
        "(ours: in the worker); nvidia-smi reports the whole device every 200 ms from the variant's start. Graph "
        "captures and compile seconds are counted in the process that runs the transformer. The targets: ours at "
        f"most 0.2x diffusers end to end (upstream's published ratio for this request: {published_ratio()}). The VAE "
        "decode split and its targets (the 8-way share at most 0.2x the untiled decode's time and 0.25x its peak "
        'memory) are measured by benchmarks/vae_decode.py: section "VAE decode" of this page. '
        + (
            f"Files in ours' inductor cache before each variant (a warm cache compiles faster): {caches}. "
            if caches
            else ""
        )
        + f"Rows from: {', '.join(hosts) or 'n/a'}.",
    ]
    return "\n".join(lines)


def _psnr_cell(row: dict[str, Any]) -> str:
    """The agreement of a row's first timed frames with ours-default's, run in the same call."""
    if row["variant"] == "ours-default":
        return "reference"
    value = row.get("psnr_vs_ours_default_db")
    return f"{value} dB" if isinstance(value, float) else value or "not run with it"


def published_ratio() -> str:
    value = _ratio(PUBLISHED["upstream_vllm_omni_s"], PUBLISHED["diffusers_s"])
    return f"{PUBLISHED['upstream_vllm_omni_s']} s / {PUBLISHED['diffusers_s']} s = {value}"


# ---- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", nargs="+", choices=PHASES, required=True, help="phases to run, in this order")
    parser.add_argument("--variants", nargs="+", choices=list(BY_NAME), help="only these variants of the phases")
    parser.add_argument("--tiny", action="store_true", help="smoke mode: tiny model on CPU, 208x144, 9 frames, 2 steps")
    parser.add_argument("--folder", type=Path, help="checkpoint folder (default /tmp/hunyuan-video-e2e[-tiny])")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the checkpoint folder even if present")
    parser.add_argument("--steps", type=int, help=f"denoising steps measured (default {FULL_STEPS}; --tiny 2)")
    parser.add_argument("--runs", type=int, default=1, help="timed requests per variant (%(default)s)")
    parser.add_argument(
        "--warmup-steps", type=int, default=1, help="steps of the untimed warm-up request; 0: none (%(default)s)"
    )
    parser.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--docs", type=Path, help=f"docs page (default {DEFAULT_DOCS.relative_to(ROOT)})")
    parser.add_argument("--copy-to", type=Path, help="also copy the JSON and the docs page here after each save")
    args = parser.parse_args(argv)

    scale = TINY if args.tiny else REAL
    if args.steps is not None:
        if args.steps < 1:
            raise SystemExit("--steps must be at least 1")
        scale = dataclasses.replace(scale, steps=args.steps)
    scratch = Path(tempfile.gettempdir())
    folder = (args.folder or scratch / f"hunyuan-video-e2e{'-tiny' if args.tiny else ''}").resolve()
    out = args.out or (scratch / f"{KEY}_tiny.json" if args.tiny else DEFAULT_OUT)
    docs = args.docs or (scratch / f"{KEY}_tiny.md" if args.tiny else DEFAULT_DOCS)
    if args.tiny and {out.resolve(), docs.resolve()} & {DEFAULT_OUT.resolve(), DEFAULT_DOCS.resolve()}:
        raise SystemExit("--tiny must not write the committed results or docs: give --out and --docs elsewhere")
    selected = [v for v in VARIANTS if v.phase in args.phase and (not args.variants or v.name in args.variants)]
    if not args.tiny and set(args.phase) - {"docs"}:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if gpus < 1:
            raise SystemExit("these phases need a CUDA GPU; --tiny runs on CPU")

    settings = Settings(scale, folder, args.runs, args.warmup_steps)
    results = load_results(out)

    def save() -> None:
        save_results(results, out, docs, key=KEY, section=docs_section)
        copy_outputs(args.copy_to, out, docs)

    def keep(row: dict[str, Any]) -> None:
        results["variants"][row["variant"]] = row
        add_agreement(results["variants"], FRAMES)
        save()  # after each variant: a call cut short keeps what it measured

    for phase in args.phase:
        names = [v.name for v in selected if v.phase == phase]
        if phase == "build":
            record = build_checkpoint(scale, folder, args.rebuild)
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
            probe_root = Path(tempfile.mkdtemp(prefix=f"{KEY}_probe_"))
            for name in names:
                try:
                    row = run_ours(settings, BY_NAME[name], probe_root)
                except Exception as exc:  # noqa: BLE001 - recorded in the results; the next variant still runs
                    row = failed_row(BY_NAME[name], settings, exc)
                keep(row)
            shutil.rmtree(probe_root, ignore_errors=True)
    for what, value, target in ratios(results):
        print(f"{what}: {_cell(value, 3)} {target}", flush=True)
    print(f"results: {out}\ndocs: {docs}", flush=True)


if __name__ == "__mp_main__" and os.environ.get(PROBE_ENV):
    # This script, re-run as the main module of an engine worker that multiprocessing spawned.
    install_worker_probe(Path(os.environ[PROBE_ENV]), loop_start=LOOP_START)

if __name__ == "__main__":
    main()
