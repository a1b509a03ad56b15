"""Qwen-Image end to end: the whole pipeline, ours against diffusers, on one and two GPUs.

Real dimensions with random bf16 weights, configs written below (no downloads): the transformer
(60 layers, 24 heads x 128; 20.4B), a Qwen2.5-VL-7B text encoder with its vision tower, the
released VAE and scheduler configs, and the tiny models' tokenizer (its ids are all below the
7B's vocabulary, and token counts, not ids, set the cost). Every variant runs 1328x1328 (--size
for another), 50 steps, true CFG (scale 4.0, negative prompt " "): one untimed warm-up run at that size (2 steps,
its own prompt), then --runs timed runs, each with a different prompt (a fixed list) and a fixed
seed, the same for every variant. Reported per variant: end-to-end seconds (median), split into
text encoding, denoising and VAE decode; peak memory per GPU; graph captures and compile time;
and for ours the time from `Omni(folder)` to ready. Variants, by phase:

    build      the random-weight checkpoint folder (safetensors), weights made on the GPU in bf16
    diffusers  diffusers-eager: QwenImagePipeline as is; diffusers-compiled: the same after
               `transformer.compile_repeated_blocks(fullgraph=True)` (one GPU, in this process)
    ours       ours-default: Omni(folder) (compiled blocks, CUDA graphs, warm-up request), started
               with the folder evicted from the page cache (the cold start); ours-eager:
               Omni(folder, enforce_eager=True). Before them, the time to read the folder's bytes
    ours2      ours-u2: Omni(folder, ulysses_degree=2); ours-cfg2: Omni(folder, cfg_parallel_size=2)
    levers     the speed levers (issue 21): ours-fp8 (quantization="fp8"); ours-fp8-cache and ours-cache
               (cache="first_block" at its default threshold), each followed on the same engine by its
               -auto variant (the threshold: the median change the default's run measured). Each row gives
               the forwards skipped and the PSNR of its image against ours-default's (run in the same call);
               ours-sdpa, ours-fa4, ours-fp8-fa4: the attention kernel named (cuDNN's through SDPA, or
               FlashAttention 4's, which ours-default takes itself where flash-attn-4 is on a Hopper GPU)
    offload    a smaller card (issue 31; the cap is the card's size): ours-fp8-model-32g and ours-fp8-layerwise-24g
               (FP8 with offload, against ours-fp8), ours-model-48g, ours-layerwise-24g and -48g (bf16)
    lora       ours-lora-50 and ours-lora-8: a served rank-64 adapter (issue 29)
    pcie       the host-device bandwidth (pinned 1 GiB copies each way; the offload phase measures it too)

Each phase merges its rows into the JSON (keyed by variant) and rewrites the docs section from
every row there, so phases can run in separate calls; `--phase docs` only rewrites the docs from
the JSON (no GPU). The folder takes 57.7 GB of disk (the script checks before writing); it fit
the one-GPU kind's 64 GiB disk, where one call of about 8 minutes ran the one-GPU variants
(build 75 s, each variant 1 to 2 minutes with --runs 1). The two-GPU variants need the
nvidia-h200-x2 kind; for side-by-side ratios run diffusers-eager there too:

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 benchmarks/qwen_image_e2e.py --copy-to $OUT --runs 1 --phase build diffusers ours
    python3 benchmarks/qwen_image_e2e.py --copy-to $OUT --runs 1 --phase build diffusers ours2 --variants diffusers-eager ours-u2 ours-cfg2
    python3 benchmarks/qwen_image_e2e.py --copy-to $OUT --runs 1 --no-cold-start --phase build diffusers ours levers --variants diffusers-eager ours-default ours-fp8 ours-fp8-cache ours-fp8-cache-auto ours-cache ours-cache-auto
    python3 benchmarks/qwen_image_e2e.py --copy-to $OUT --runs 1 --no-cold-start --phase build levers offload --variants ours-fp8 ours-fp8-model-32g ours-fp8-layerwise-24g
    python3 benchmarks/qwen_image_e2e.py --copy-to $OUT --runs 1 --no-cold-start --phase build ours offload --variants ours-default ours-model-48g --out benchmarks/results/qwen_image_e2e_h100.json --docs-key qwen_image_e2e_h100
    python3 benchmarks/qwen_image_e2e.py --copy-to $OUT --runs 1 --no-cold-start --phase build diffusers ours levers --variants diffusers-eager ours-sdpa ours-fa4 ours-fp8-fa4 --size 1024x1024 --out benchmarks/results/qwen_image_e2e_1024_h100.json --docs-key qwen_image_e2e_1024_h100

(the first line starts every call, `.whl` carried). `build` is a no-op when --folder (default
/tmp/qwen-image-e2e) already holds the checkpoint, so every call names it: a machine given back
between calls (30 s after one) comes back bare. --copy-to puts the JSON and the docs page into
$OUT after every variant (a call cut short keeps what it finished); copy the returned JSON to
benchmarks/results/ before the next call so the phases accumulate, and finish with `--phase docs`
here. `--runs 1` saves ~30 s a variant. The smoke mode, on CPU:

    python benchmarks/qwen_image_e2e.py --tiny --phase build diffusers ours ours2 --out /tmp/e2e.json --docs /tmp/e2e.md

runs the same code with the tiny model (208x240, 2 steps, float32, CPU workers over gloo,
diffusers' compiled variant with the eager backend); its numbers mean nothing.

How ours is split: the executor spawns its workers with multiprocessing's spawn method, which
runs this script in each worker as `__mp_main__`; there (and only when the probe directory
variable is set) it wraps the worker's PipelineRunner so rank r appends one JSON line per
request to <probe dir>/rank<r>.jsonl. The same `PhaseProbe` times diffusers in this process.
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
from benchmarks.harness.e2e import (  # noqa: E402
    BUILD_MARKER,
    GPU_GIB,
    QWEN25_VL_7B_TEXT,
    DeviceMemorySampler,
    PhaseProbe,
    add_agreement,
    already_built,
    as_card_of,
    build_record,
    cell,
    checkpoint_files,
    commit_checkpoint,
    copy_outputs,
    default_dtype,
    evict_from_page_cache,
    failed_row,
    inductor_cache_files,
    install_worker_probe,
    load_results,
    measure_pcie,
    measure_reads,
    page_cache_fraction,
    prepare_partial,
    probe_records,
    save_results,
    save_synced,
    write_adapter,
)
from benchmarks.qwen_image_sp import REAL_CONFIG as REAL_TRANSFORMER  # noqa: E402
from vllm_omni.diffusion.models.qwen_image.tiny import SCHEDULER_CONFIG  # noqa: E402

KEY = "qwen_image_e2e"
DEFAULT_OUT = ROOT / f"benchmarks/results/{KEY}.json"
DEFAULT_DOCS = ROOT / "docs/benchmarks.md"
PROBE_ENV = "QWEN_IMAGE_E2E_PROBE_DIR"

REAL_TEXT = QWEN25_VL_7B_TEXT

PROMPTS = [
    "A photograph of a small red fox sitting in fresh snow at sunrise, soft golden light.",
    "A busy city street at night, neon signs reflected in puddles after the rain.",
    "A watercolor painting of a lighthouse on a rocky cliff above stormy waves.",
    'A poster that says "Summer Festival 2025" in bold yellow letters on a purple background.',
    "A bowl of ramen with a soft boiled egg, spring onions and thin slices of pork.",
    "A futuristic train crossing a bridge over a canyon, clouds below, wide angle.",
    "Two cats sleeping on a sunny windowsill next to a pot of green herbs.",
    "Close-up portrait of an elderly man with a grey beard, wearing a knitted wool hat.",
]
WARMUP_PROMPT = "An old wooden boat resting on a quiet lake, mountains and pine trees in the distance."
NEGATIVE_PROMPT = " "  # Qwen-Image's own example
TRUE_CFG_SCALE = 4.0
WARMUP_SEED = 0


def run_seed(index: int) -> int:
    return 1000 + index


REAL_VISION = dict(
    depth=32,
    hidden_size=1280,
    intermediate_size=3420,
    num_heads=16,
    in_channels=3,
    hidden_act="silu",
    patch_size=14,
    spatial_merge_size=2,
    temporal_patch_size=2,
    window_size=112,
    fullatt_block_indexes=[7, 15, 23, 31],
    tokens_per_second=2,
    out_hidden_size=3584,
)
# Qwen-Image's vae/config.json; latents_mean / latents_std are left at diffusers' defaults, the released values.
REAL_VAE = dict(
    base_dim=96,
    z_dim=16,
    dim_mult=[1, 2, 4, 4],
    num_res_blocks=2,
    attn_scales=[],
    temperal_downsample=[False, True, True],
    dropout=0.0,
)
# --tiny: the geometry of the real model (8x VAE, 2x2 patches, 16 latent channels), small widths.
TINY_TRANSFORMER = dict(REAL_TRANSFORMER, num_layers=2, attention_head_dim=16, num_attention_heads=6)
TINY_TRANSFORMER.update(joint_attention_dim=64, axes_dims_rope=(4, 6, 6))
TINY_TEXT = dict(REAL_TEXT, vocab_size=1024, hidden_size=64, intermediate_size=128, num_hidden_layers=2)
TINY_TEXT.update(num_attention_heads=4, num_key_value_heads=2, max_window_layers=2)
TINY_TEXT["rope_parameters"] = {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}
TINY_VISION = dict(REAL_VISION, depth=2, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)
TINY_VISION["fullatt_block_indexes"] = [1]
TINY_VAE = dict(REAL_VAE, base_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1)


@dataclasses.dataclass(frozen=True)
class Scale:
    name: str
    transformer: dict
    text: dict
    vision: dict
    vae: dict
    width: int
    height: int
    steps: int
    device: str
    dtype: str
    compile_backend: str  # diffusers-compiled's torch.compile backend

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)


REAL = Scale("real", REAL_TRANSFORMER, REAL_TEXT, REAL_VISION, REAL_VAE, 1328, 1328, 50, "cuda", "bfloat16", "inductor")
# 208x240 -> 13x15 = 195 image tokens: padded at Ulysses 2, as 1328x1328 (6889 tokens) is.
TINY = Scale("tiny", TINY_TRANSFORMER, TINY_TEXT, TINY_VISION, TINY_VAE, 240, 208, 2, "cpu", "float32", "eager")


@dataclasses.dataclass(frozen=True)
class Variant:
    name: str
    phase: str
    gpus: int
    what: str
    omni: dict[str, Any] | None = None  # Omni keyword arguments (ours)
    # Request fields of its runs (ours); a cache_threshold of AUTO: the median change its engine's previous
    # variant measured (with random weights the first block's changes are not a trained model's).
    fields: dict[str, Any] | None = None


AUTO = "auto"
START_KEYS = ("start_to_ready_s", "engine_warmup_s", "load_s", "page_cache_before_start")
LEVERS = (
    "ours-fp8",
    "ours-fp8-cache",
    "ours-fp8-cache-auto",
    "ours-cache",
    "ours-cache-auto",
    "ours-sdpa",
    "ours-fa4",
    "ours-fp8-fa4",
)
FP8 = {"quantization": "fp8"}
CACHE = {"cache": "first_block"}
VARIANTS = [
    Variant("diffusers-eager", "diffusers", 1, "diffusers QwenImagePipeline, eager"),
    Variant("diffusers-compiled", "diffusers", 1, "diffusers, transformer.compile_repeated_blocks(fullgraph=True)"),
    # ours-default first: its start is the cold start (folder evicted from the page cache).
    Variant("ours-default", "ours", 1, "Omni(folder): compiled blocks, CUDA graphs, warm-up request", {}),
    Variant(
        "ours-eager", "ours", 1, "Omni(folder, enforce_eager=True): no compile, no graphs", {"enforce_eager": True}
    ),
    Variant("ours-u2", "ours2", 2, "Omni(folder, ulysses_degree=2), defaults", {"ulysses_degree": 2}),
    Variant("ours-cfg2", "ours2", 2, "Omni(folder, cfg_parallel_size=2), defaults", {"cfg_parallel_size": 2}),
    # Speed levers (issue 21). Consecutive variants with the same Omni arguments share one engine.
    Variant("ours-fp8", "levers", 1, "Omni(folder, quantization='fp8')", FP8),
    Variant("ours-fp8-cache", "levers", 1, "and cache='first_block', the default threshold", {**FP8, **CACHE}),
    Variant(
        "ours-fp8-cache-auto",
        "levers",
        1,
        "the same engine, cache_threshold = the median change the default measured",
        {**FP8, **CACHE},
        {"cache_threshold": AUTO},
    ),
    Variant("ours-cache", "levers", 1, "Omni(folder, cache='first_block'), the default threshold", CACHE),
    Variant(
        "ours-cache-auto", "levers", 1, "the same, threshold = the median change", CACHE, {"cache_threshold": AUTO}
    ),
]
# Offload (issue 31) on a smaller card: the cap is the card's size (GPU_GIB -> gpu_memory_utilization, which the
# engine also applies with torch.cuda.set_per_process_memory_fraction), and the limits admit one 1328x1328 image
# (6889 tokens) a step, the largest request such a deploy is planned for. Compare with ours-fp8 / ours-default.
ONE_1328 = {"max_tokens_per_step": 6889, "max_n": 1}
VARIANTS += [
    # FP8 leaves the transformer at 25.4 GiB (the FP8 rule keeps its AdaLN modulation, 12.7 GiB, in bf16), so with
    # model offload it needs a 32 GiB card (the plan refuses 24 GiB); within 24 GiB FP8 takes layerwise offload.
    # ours-fp8 is their reference: run it in the same call.
    Variant(
        "ours-fp8-model-32g",
        "offload",
        1,
        "Omni(folder, quantization='fp8', cpu_offload='model'), within 32 GiB",
        {**FP8, "cpu_offload": "model", GPU_GIB: 32, **ONE_1328},
    ),
    Variant(
        "ours-fp8-layerwise-24g",
        "offload",
        1,
        "Omni(folder, quantization='fp8', cpu_offload='layerwise'), within 24 GiB",
        {**FP8, "cpu_offload": "layerwise", GPU_GIB: 24, **ONE_1328},
    ),
    Variant(
        "ours-model-48g",
        "offload",
        1,
        "Omni(folder, cpu_offload='model'), bf16, within 48 GiB",
        {"cpu_offload": "model", GPU_GIB: 48, **ONE_1328},
    ),
    Variant(
        "ours-layerwise-24g",
        "offload",
        1,
        "Omni(folder, cpu_offload='layerwise'), bf16, within 24 GiB",
        {"cpu_offload": "layerwise", GPU_GIB: 24, **ONE_1328},
    ),
    Variant(
        "ours-layerwise-48g",
        "offload",
        1,
        "Omni(folder, cpu_offload='layerwise'), bf16, within 48 GiB",
        {"cpu_offload": "layerwise", GPU_GIB: 48, **ONE_1328},
    ),
]
OFFLOAD_TARGETS = (
    ("ours-fp8-model-32g", "ours-fp8", "<= 1.4"),  # issue 44's target for FP8 + model within 32 GiB
    ("ours-fp8-layerwise-24g", "ours-fp8", "<= 1.3"),
    ("ours-model-48g", "ours-default", ""),
    ("ours-layerwise-24g", "ours-default", "<= 1.6"),  # issue 44's (bf16 layerwise within 24 GiB)
    ("ours-layerwise-48g", "ours-default", "<= 1.3"),
)
# LoRA (issue 29): a random rank-64 adapter on every attention and MLP linear of the blocks (benchmarks/lora.py's),
# served with --lora-modules; the same engine runs a 50-step request with the adapter (true CFG, as the others) and
# an 8-step one with true CFG off, as a few-step (Lightning-style) adapter is run. Random weights: the images mean
# nothing, the times are the point.
LORA_NAME = "rank64"
# run_ours puts the adapter's folder (LORA_FOLDER in the checkpoint folder) in lora_modules. The limits admit one
# 1328x1328 image a step: with the originals of every block weight an adapter may touch planned on the GPU, the
# engine's default limits do not fit one H200 (the memory plan refuses them, saying what would).
LORA = {"lora_modules": LORA_NAME, **ONE_1328}
LORA_FOLDER = "lora-rank64"
VARIANTS += [
    Variant("ours-lora-50", "lora", 1, "Omni(folder, lora_modules=...), request lora, 50 steps", LORA,
            {"lora": LORA_NAME}),
    Variant("ours-lora-8", "lora", 1, "the same engine, request lora, 8 steps, true CFG off", LORA,
            {"lora": LORA_NAME, "num_inference_steps": 8, "true_cfg_scale": 1.0, "negative_prompt": None}),
]  # fmt: skip
LORA_TARGETS = (("ours-lora-50", "ours-default", "<= 1.10"), ("ours-lora-8", "ours-lora-50", ""))
# CFG in one pass (issue 46): a step's two branches as one forward. The default runs it only under layerwise offload
# (with the weights resident a forward of one row already fills the GPU at these sizes); these force it on.
ONE_PASS = {"cfg_one_pass": True}
VARIANTS += [
    Variant("ours-one-pass", "cfg", 1, "Omni(folder, cfg_one_pass=True): one forward a CFG step", ONE_PASS),
    Variant("ours-fp8-one-pass", "cfg", 1, "Omni(folder, quantization='fp8', cfg_one_pass=True)", {**FP8, **ONE_PASS}),
]
# FlashAttention 4's kernels instead of cuDNN's through SDPA (issue 46: the attention kernel per shape); exact.
# With flash-attn-4 importable on a Hopper GPU ours-default takes them itself: ours-sdpa is then cuDNN's row.
FA4 = {"attention_backend": "flash_attn_4"}
VARIANTS += [
    Variant("ours-sdpa", "levers", 1, "Omni(folder, attention_backend='sdpa'): cuDNN's kernel named",
            {"attention_backend": "sdpa"}),
    Variant("ours-fa4", "levers", 1, "Omni(folder, attention_backend='flash_attn_4')", FA4),
    Variant("ours-fp8-fa4", "levers", 1, "Omni(folder, quantization='fp8', attention_backend='flash_attn_4')",
            {**FP8, **FA4}),
]  # fmt: skip
CFG_TARGETS = (
    ("ours-fp8-fa4", "ours-fp8", ""),
    ("ours-one-pass", "ours-default", ""),
    ("ours-fp8-one-pass", "ours-fp8", ""),
)
# Issue 46's targets by size: (bf16, FP8) against diffusers eager; the FA4 rows are the same engine with another
# attention kernel (the automatic one where flash-attn-4 is installed on a Hopper GPU).
ISSUE_46 = {"1024x1024": ("<= 0.63", "<= 0.50"), "1328x1328": ("<= 0.70", "<= 0.55")}
BY_NAME = {variant.name: variant for variant in VARIANTS}
PHASES = ["build", "diffusers", "ours", "ours2", "levers", "offload", "lora", "cfg", "pcie", "docs"]
# The first timed run's image of each variant run in this process: agreement with ours-default's.
IMAGES: dict[str, np.ndarray] = {}  # docs: rewrite the docs section from the JSON


# ---- timing a pipeline call's phases ---------------------------------------------------------------


# ---- the checkpoint folder and the page cache ------------------------------------------------------


def build_checkpoint(scale: Scale, folder: Path, rebuild: bool) -> dict[str, Any] | None:
    """Write the random-weight QwenImagePipeline folder (safetensors); None when it is already there.

    The weights are made on the target device in the target dtype (seconds on a GPU), then saved
    into `<folder>.partial`, synced to disk and renamed: a folder with the marker is complete.
    """
    if already_built(folder, scale.name, rebuild):
        return None

    import diffusers
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2Tokenizer

    from vllm_omni.diffusion.models.qwen_image.tiny import tiny_model_path
    from vllm_omni.diffusion.models.tiny_qwen_tokenizer import special_token_ids

    tokenizer = Qwen2Tokenizer.from_pretrained(tiny_model_path("tiny/qwen-image") / "tokenizer")
    ids = special_token_ids(tokenizer)
    if len(tokenizer) > scale.text["vocab_size"]:
        raise SystemExit(f"the tokenizer's {len(tokenizer)} tokens do not fit the vocabulary")
    text_config = Qwen2_5_VLConfig(
        text_config=dict(scale.text, bos_token_id=ids["<|endoftext|>"], eos_token_id=ids["<|im_end|>"]),
        vision_config=scale.vision,
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        bos_token_id=ids["<|endoftext|>"],
        eos_token_id=ids["<|im_end|>"],
        tie_word_embeddings=False,
    )
    device, dtype = torch.device(scale.device), scale.torch_dtype
    start = time.perf_counter()
    torch.manual_seed(0)
    with default_dtype(dtype), device:
        components = {
            "transformer": diffusers.QwenImageTransformer2DModel(**scale.transformer),
            "text_encoder": Qwen2_5_VLForConditionalGeneration(text_config),
            "vae": diffusers.AutoencoderKLQwenImage(**scale.vae),
        }
    init_s, params, partial = prepare_partial(components, device, dtype, start, folder)

    pipe = diffusers.QwenImagePipeline(
        scheduler=diffusers.FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), tokenizer=tokenizer, **components
    )
    files, write_s, written = save_synced(pipe, partial)
    del pipe, components
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    record = build_record(scale.name, params, files, written, init_s, write_s, partial)
    commit_checkpoint(partial, folder, record, written, write_s)
    return record


# ---- memory seen by nvidia-smi ---------------------------------------------------------------------


# ---- variants --------------------------------------------------------------------------------------


@dataclasses.dataclass
class Settings:
    scale: Scale
    folder: Path
    runs: int
    warmup_steps: int

    def call_kwargs(self, steps: int) -> dict[str, Any]:
        return dict(
            negative_prompt=NEGATIVE_PROMPT,
            true_cfg_scale=TRUE_CFG_SCALE,
            height=self.scale.height,
            width=self.scale.width,
            num_inference_steps=steps,
        )

    def requests(self) -> list[tuple[str, str, int, int]]:
        """(label, prompt, seed, steps): the untimed warm-up run, then the timed runs."""
        timed = [(f"run {i}", PROMPTS[i % len(PROMPTS)], run_seed(i), self.scale.steps) for i in range(self.runs)]
        return [("warm-up", WARMUP_PROMPT, WARMUP_SEED, self.warmup_steps), *timed]


def _split(record: dict[str, Any], e2e_s: float) -> dict[str, Any]:
    """One run: end to end and its phases (None where not measured); other = the rest of end to end."""
    phases = [record.get(k) for k in ("text_s", "denoise_s", "decode_s")]
    other = e2e_s - sum(phases) if None not in phases else None
    row = {"e2e_s": e2e_s, "text_s": phases[0], "denoise_s": phases[1], "decode_s": phases[2], "other_s": other}
    row.update({k: record.get(k) for k in ("call_s", "compile_s", "captures", "capture_s")})
    return {k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}


def summarize(variant: Variant, settings: Settings, runs: list[dict], peaks: list[list], extra: dict) -> dict:
    timed, warm = runs[1:], runs[0]

    def median(key: str) -> float | None:
        values = [run[key] for run in timed if run.get(key) is not None]
        return round(statistics.median(values), 3) if len(values) == len(timed) and values else None

    def total(key: str) -> float | None:
        values = [run.get(key) for run in timed]
        return None if None in values else round(sum(values), 3)

    per_gpu = [max(p[g] for p in peaks) for g in range(len(peaks[0]))] if peaks and None not in peaks[0] else None
    row = {
        "variant": variant.name,
        "phase": variant.phase,
        "gpus": variant.gpus,
        "what": variant.what,
        "scale": settings.scale.name,
        "size": f"{settings.scale.width}x{settings.scale.height}",
        "steps": (variant.fields or {}).get("num_inference_steps", settings.scale.steps),
        "warmup_steps": settings.warmup_steps,
        "host": socket.gethostname(),
        "torch": torch.__version__,
        "diffusers": __import__("diffusers").__version__,
        **{key: median(key) for key in ("e2e_s", "text_s", "denoise_s", "decode_s", "other_s")},
        "peak_alloc_gib": None if per_gpu is None else [round(x, 2) for x in per_gpu],
        "captures": total("captures"),
        "compile_s": total("compile_s"),
        "warmup_run_s": warm["e2e_s"],
        "warmup_captures": warm.get("captures"),
        "warmup_compile_s": warm.get("compile_s"),
        "runs": runs,
        "error": None,
    }
    row.update(extra)
    return row


def run_diffusers(settings: Settings, names: list[str], keep: Callable[[dict[str, Any]], None]) -> None:
    """diffusers-eager, then diffusers-compiled, on one pipeline in this process (GPU 0 on CUDA);
    `keep(row)` is called as each variant ends."""
    import diffusers

    scale = settings.scale
    device = torch.device(scale.device, 0) if scale.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    start = time.perf_counter()
    try:
        # Loaded as the engine's runner loads it: the transformer straight onto the device, the rest moved.
        transformer = diffusers.QwenImageTransformer2DModel.from_pretrained(
            settings.folder, subfolder="transformer", dtype=scale.torch_dtype, device_map=str(device)
        )
        pipe = diffusers.QwenImagePipeline.from_pretrained(
            settings.folder, transformer=transformer, dtype=scale.torch_dtype
        ).to(device)
    except Exception as exc:  # noqa: BLE001 - recorded in the results
        for name in names:
            keep(failed_row(BY_NAME[name], settings, exc))
        return
    load_s = time.perf_counter() - start
    probe = PhaseProbe(pipe, device)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    for name in names:
        variant = BY_NAME[name]
        try:
            cache_files = inductor_cache_files(ours=False)
            if name == "diffusers-compiled":
                pipe.transformer.compile_repeated_blocks(fullgraph=True, backend=scale.compile_backend)
            runs, peaks = [], []
            with DeviceMemorySampler(device.type == "cuda") as sampler:
                for label, prompt, seed, steps in settings.requests():
                    probe.begin()
                    generator = torch.Generator("cpu").manual_seed(seed)
                    out = pipe(prompt=prompt, generator=generator, output_type="pil", **settings.call_kwargs(steps))
                    record = probe.end()
                    if label != "warm-up":
                        IMAGES.setdefault(name, np.asarray(out.images[0]))
                    runs.append(dict(_split(record, record["call_s"]), label=label, seed=seed))
                    if label != "warm-up":
                        peaks.append([record["peak_alloc_gib"]])
                    print(f"{name} {label}: {runs[-1]}", flush=True)
            extra = {"device": device_name, "load_s": round(load_s, 2), "nvsmi_peak_gib": sampler.peaks_gib(1)}
            extra["inductor_cache_files_before"] = cache_files
            keep(summarize(variant, settings, runs, peaks, extra))
        except Exception as exc:  # noqa: BLE001 - recorded in the results; the next variant still runs
            keep(failed_row(variant, settings, exc))
    del pipe, transformer, probe
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_ours(settings: Settings, variants: list[Variant], probe_root: Path, cold: bool) -> list[dict[str, Any]]:
    """Start Omni(folder) (after evicting the folder from the page cache when `cold`), then run each variant's
    requests on it (variants that share an engine have the same `omni` arguments); one row per variant."""
    from vllm_omni import Omni

    scale = settings.scale
    files = checkpoint_files(settings.folder)
    if cold:
        evict_from_page_cache(files)
    cached = page_cache_fraction(files)
    probe_dir = probe_root / variants[0].name
    shutil.rmtree(probe_dir, ignore_errors=True)
    probe_dir.mkdir(parents=True)
    os.environ[PROBE_ENV] = str(probe_dir)  # the workers inherit it and install the probe
    rows, median_change = [], None
    cache_files = inductor_cache_files(ours=True)
    try:
        with DeviceMemorySampler(scale.device == "cuda") as sampler:
            start = time.perf_counter()
            options = dict(variants[0].omni)
            if options.get("lora_modules") == LORA_NAME:
                options["lora_modules"] = {LORA_NAME: str(write_lora(settings.folder))}
            options = as_card_of(options, scale.device)
            omni = Omni(str(settings.folder), device=scale.device, dtype=scale.dtype, **options)
            ready_s = time.perf_counter() - start
            try:
                engine_warmup_s = omni.engine.warmup_s or 0.0
                # The engine's own warm-up requests (engine.warmup_requests: one, or two with compiled blocks).
                warmup_records = [probe_records(probe_dir, id_).get(0, {}) for id_ in ("warm-up", "warm-up-2")]
                for variant in variants:
                    fields = dict(variant.fields or {})
                    if fields.get("cache_threshold") == AUTO:
                        if median_change is None:
                            raise RuntimeError(f"{variant.name}: no change measured by the engine's previous variant")
                        fields["cache_threshold"] = median_change
                    runs, peaks, worker, ranks_reporting, cache = [], [], {}, 0, None
                    for label, prompt, seed, steps in settings.requests():
                        start = time.perf_counter()
                        # The variant's fields over the common ones (an 8-step row replaces the steps and CFG).
                        images = omni.generate(prompt, seed=seed, **{**settings.call_kwargs(steps), **fields})
                        e2e_s = time.perf_counter() - start
                        records = probe_records(probe_dir, omni.last_output.request_id)
                        if 0 not in records:
                            raise RuntimeError(
                                f"no probe record from rank 0 in {probe_dir}: the worker probe is not loaded"
                            )
                        worker = records[0]
                        run = dict(_split(worker, e2e_s), label=label, seed=seed)
                        # The steps whose CFG branches shared one forward (the layerwise placement's one pass).
                        run["cfg_one_pass_steps"] = omni.last_output.cfg_one_pass_steps
                        if omni.last_output.step_cache is not None:
                            report = omni.last_output.step_cache
                            run.update({k: report[k] for k in ("forwards_skipped", "median_change")})
                        runs.append(run)
                        if label != "warm-up":
                            peaks.append([records[r]["peak_alloc_gib"] for r in sorted(records)])
                            ranks_reporting = len(records)
                            cache = omni.last_output.step_cache
                            IMAGES.setdefault(variant.name, np.asarray(images[0]))
                        print(f"{variant.name} {label}: {runs[-1]}", flush=True)
                    if cache is not None:
                        median_change = cache["median_change"]
                    extra = {
                        "device": worker.get("device_name"),
                        "attention": worker.get("attention"),
                        "ranks_reporting": ranks_reporting,
                        "step_cache": cache,
                        "request_fields": fields or None,
                    }
                    rows.append((variant, runs, peaks, extra))
            finally:
                omni.close()
    finally:
        del os.environ[PROBE_ENV]

    def warmup_total(key: str) -> float | int | None:
        values = [record[key] for record in warmup_records if key in record]
        return sum(values) if values else None

    engine = {
        "start_to_ready_s": round(ready_s, 2),
        "engine_warmup_s": round(engine_warmup_s, 2),
        "load_s": round(ready_s - engine_warmup_s, 2),
        "engine_warmup_requests": sum(1 for record in warmup_records if record),
        "engine_warmup_compile_s": warmup_total("compile_s"),
        "engine_warmup_captures": warmup_total("captures"),
        "page_cache_before_start": None if cached is None else round(cached, 3),
        "inductor_cache_files_before": cache_files,
        "nvsmi_peak_gib": sampler.peaks_gib(variants[0].gpus),
    }
    return [summarize(variant, settings, runs, peaks, {**engine, **extra}) for variant, runs, peaks, extra in rows]


def write_lora(folder: Path) -> Path:
    """The LoRA variants' adapter, written once into the checkpoint folder (harness/e2e.py's random rank-64
    adapter, from the transformer's config on the meta device)."""
    import diffusers

    adapter = folder / LORA_FOLDER
    if not (adapter / "pytorch_lora_weights.safetensors").is_file():
        config = diffusers.QwenImageTransformer2DModel.load_config(folder / "transformer")
        with torch.device("meta"):
            model = diffusers.QwenImageTransformer2DModel.from_config(config)
        print(f"LoRA adapter: {write_adapter(model, adapter, seed=29)} linears adapted", flush=True)
    return adapter


def engine_groups(variants: list[Variant]) -> list[list[Variant]]:
    """Consecutive variants with the same Omni arguments, which share one engine."""
    groups: list[list[Variant]] = []
    for variant in variants:
        if groups and groups[-1][0].omni == variant.omni:
            groups[-1].append(variant)
        else:
            groups.append([variant])
    return groups


# ---- results and docs ------------------------------------------------------------------------------


def ratios(results: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    """(what, value, target) for the issue's targets and the comparisons around them."""
    rows = results["variants"]

    def e2e(name: str) -> float | None:
        row = rows.get(name)
        return row.get("e2e_s") if row and not row.get("error") else None

    def ratio(a: float | None, b: float | None) -> float | None:
        return round(a / b, 3) if a is not None and b else None

    two_gpu = {name: e2e(name) for name in ("ours-u2", "ours-cfg2") if e2e(name) is not None}
    best = min(two_gpu, key=two_gpu.get) if two_gpu else None
    out = [
        ("ours-default / diffusers-eager (one GPU)", ratio(e2e("ours-default"), e2e("diffusers-eager")), "<= 0.85"),
        (
            f"best of ours on two GPUs ({best or 'n/a'}) / diffusers-eager on one",
            ratio(two_gpu.get(best), e2e("diffusers-eager")),
            "<= 0.5",
        ),
        ("ours-default / diffusers-compiled", ratio(e2e("ours-default"), e2e("diffusers-compiled")), ""),
        ("ours-eager / diffusers-eager", ratio(e2e("ours-eager"), e2e("diffusers-eager")), ""),
        ("diffusers-compiled / diffusers-eager", ratio(e2e("diffusers-compiled"), e2e("diffusers-eager")), ""),
        ("ours-u2 / ours-default", ratio(e2e("ours-u2"), e2e("ours-default")), ""),
        ("ours-cfg2 / ours-default", ratio(e2e("ours-cfg2"), e2e("ours-default")), ""),
        # Issue 21's targets, then what each lever buys on its own.
        ("ours-fp8 / diffusers-eager", ratio(e2e("ours-fp8"), e2e("diffusers-eager")), "<= 0.7"),
        (
            "ours-fp8-cache (the default threshold) / diffusers-eager",
            ratio(e2e("ours-fp8-cache"), e2e("diffusers-eager")),
            "<= 0.4",
        ),
        ("ours-fp8-cache-auto / diffusers-eager", ratio(e2e("ours-fp8-cache-auto"), e2e("diffusers-eager")), ""),
        *((f"{name} / ours-default", ratio(e2e(name), e2e("ours-default")), "") for name in LEVERS),
        *(
            (f"{name} / {reference}", ratio(e2e(name), e2e(reference)), target)
            for name, reference, target in (*OFFLOAD_TARGETS, *LORA_TARGETS, *CFG_TARGETS)
        ),
    ]
    sizes = {row.get("size") for row in rows.values() if not row.get("error")}
    bf16, fp8 = ISSUE_46.get(sizes.pop() if len(sizes) == 1 else "", ("", ""))
    out += [  # issue 46's
        (f"{name} / diffusers-eager", ratio(e2e(name), e2e("diffusers-eager")), target)
        for name, target in (("ours-default", bf16), ("ours-fa4", bf16), ("ours-fp8", fp8), ("ours-fp8-fa4", fp8))
    ]
    cold = results.get("cold_start")
    start = (cold or {}).get("engines", {}).get("ours-default")  # started in the call that timed the reads
    if cold and start:
        # Compare with the read made in the same page-cache state as the engine's start.
        state = "evicted" if (start.get("page_cache_before_start") or 0) < 0.5 else "cached"
        read = next(r for r in cold["reads"] if r["label"] == state)
        out.append(
            (
                f"ours-default start to ready, less the warm-up ({start['engine_warmup_s']} s) / read time ({state})",
                ratio(start["load_s"], read["s"]),
                "<= 1.5",
            )
        )
    return out


def docs_section(results: dict[str, Any]) -> str:
    rows = [results["variants"][v.name] for v in VARIANTS if v.name in results["variants"]]
    rows_by = {row["variant"]: row for row in rows}
    done = [row for row in rows if not row.get("error")]
    first = done[0] if done else {}
    tiny = any(row.get("scale") == "tiny" for row in rows)
    lines = [
        "## Qwen-Image end to end (ours vs diffusers)",
        "",
        *(["**Tiny smoke run on CPU: these numbers mean nothing.**", ""] if tiny else []),
        (
            "The tiny model (float32, CPU workers over gloo), loaded from a safetensors folder; "
            if tiny
            else "The whole pipeline at real dimensions with random bf16 weights (transformer 20.4B, Qwen2.5-VL-7B "
            "text encoder, the released VAE), loaded from a safetensors folder; "
        )
        + f"{first.get('size', 'n/a')}, {first.get('steps', 'n/a')} steps, true CFG (scale {TRUE_CFG_SCALE}, "
        f"negative prompt {NEGATIVE_PROMPT!r}); {first.get('device', 'n/a')}, torch {first.get('torch', 'n/a')}, "
        f"diffusers {first.get('diffusers', 'n/a')}. Each variant: one untimed warm-up run at the same size "
        f"({first.get('warmup_steps', 'n/a')} steps, its own prompt), then timed runs, each with another prompt and "
        "seed (the same for every variant); medians in seconds. End to end is one call: diffusers' `pipe(...)` to a "
        "PIL image, ours `Omni.generate(...)` to a PIL image.",
        "",
        "| variant | GPUs | end to end | text encoding | denoising | VAE decode | other | timed runs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row.get("error"):
            lines.append(f"| {row['variant']} | {row['gpus']} | error: {row['error']} | | | | | |")
            continue
        cells = [cell(row.get(k)) for k in ("e2e_s", "text_s", "denoise_s", "decode_s", "other_s")]
        lines.append(f"| {row['variant']} | {row['gpus']} | " + " | ".join(cells) + f" | {len(row['runs']) - 1} |")
    lines += [
        "",
        "| variant | peak allocated GiB per GPU (timed runs) | nvidia-smi peak GiB per GPU (whole variant) | "
        "graph captures (timed runs) | compile s (timed runs) | warm-up run s (captures, compile s) | "
        "start to ready s (load + engine warm-up) |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in done:
        warm = f"{cell(row['warmup_run_s'], 1)} ({cell(row['warmup_captures'])}, {cell(row['warmup_compile_s'], 1)})"
        start = f"load {cell(row.get('load_s'), 1)} (in this process)"
        if "start_to_ready_s" in row:
            start = f"{row['start_to_ready_s']:.1f} = {row['load_s']:.1f} + {row['engine_warmup_s']:.1f}"
            if row.get("engine_warmup_captures"):
                start += (
                    f" ({row['engine_warmup_captures']} captures, {cell(row['engine_warmup_compile_s'], 1)} s compile)"
                )
        lines.append(
            f"| {row['variant']} | {cell(row['peak_alloc_gib'], 1)} | {cell(row.get('nvsmi_peak_gib'), 1)} | "
            f"{cell(row['captures'])} | {cell(row['compile_s'], 1)} | {warm} | {start} |"
        )
    lines += ["", "| ratio | value | target |", "|---|---|---|"]
    for what, value, target in ratios(results):
        verdict = ""
        if value is not None and target:
            verdict = " (met)" if value <= float(target.split()[-1]) else " (not met)"
        lines.append(f"| {what} | {cell(value, 3)} | {target}{verdict} |")
    pcie = results.get("pcie")
    if pcie:
        lines += [
            "",
            f"Host-device bandwidth on {pcie['device']} ({pcie['host']}), what offload streams at: pinned copies of "
            f"{pcie['bytes'] / 2**30:.0f} GiB, the median of {pcie['repeats']}: host to GPU {pcie['h2d_gb_per_s']} "
            f"GB/s, GPU to host {pcie['d2h_gb_per_s']} GB/s (`--phase pcie`, or measured before the offload rows).",
        ]
    levers = [rows_by[name] for name in ("ours-default", *LEVERS) if name in rows_by]
    if len(levers) > 1:
        lines += [
            "",
            "Speed levers (FP8 matmuls, the step cache), against ours-default: the forwards the cache skipped in the "
            "timed runs (of 100 a run: 50 steps x cond and uncond), the threshold and the median of the first "
            "block's relative changes the run measured, and the agreement of the first timed image with "
            "ours-default's (PSNR of the uint8 images; diffusers' rows too). With random weights this measures "
            "numerics, not picture quality, and the first block's changes between steps are not a trained "
            "model's, so the default threshold may skip nothing here: the `-auto` rows take the median change "
            "the default's run measured as their threshold, to show what skipping buys. With real weights, "
            "compare images of the same prompts and seeds with and without the lever before serving with it.",
            "",
            "| variant | end to end s | vs ours-default | forwards skipped | threshold | median change "
            "| PSNR vs ours-default dB |",
            "|---|---|---|---|---|---|---|",
        ]
        base = rows_by.get("ours-default", {}).get("e2e_s")
        for row in [*levers, *(rows_by[n] for n in ("diffusers-eager", "diffusers-compiled") if n in rows_by)]:
            if row.get("error"):
                lines.append(f"| {row['variant']} | error: {row['error']} | | | | | |")
                continue
            cache = row.get("step_cache") or {}
            skipped = [run.get("forwards_skipped") for run in row["runs"][1:]]
            lines.append(
                f"| {row['variant']} | {cell(row['e2e_s'])} | "
                f"{cell(row['e2e_s'] / base if base else None, 3)} | "
                f"{', '.join(map(str, skipped)) if cache else 'n/a'} | {cell(cache.get('threshold'), 4)} | "
                f"{cell(cache.get('median_change'), 4)} | {cell(row.get('psnr_vs_ours_default_db'))} |"
            )
    cold = results.get("cold_start")
    if cold:
        lines += [
            "",
            f"Cold start: the folder holds {cold['bytes'] / 1e9:.1f} GB in {cold['files']} files on "
            f"{cold['filesystem']}. Reads and the engine's start were timed after evicting the folder from the page "
            f"cache ({cold['eviction']}), in one call (which may be older than the rows above: a run with "
            "--no-cold-start keeps them); what was cached before each is in the last column.",
            "",
            "| what | s | GB/s | in page cache before |",
            "|---|---|---|---|",
        ]
        for read in cold["reads"]:
            lines.append(
                f"| read every byte ({read['label']}) | {read['s']:.1f} | {read['gb_per_s']:.2f} | "
                f"{cell(read['page_cache_before'], 3)} |"
            )
        for name, row in cold.get("engines", {}).items():
            if row:
                lines.append(
                    f"| {name}: `Omni(folder)` to ready, load + warm-up = {row['load_s']:.1f} + "
                    f"{row['engine_warmup_s']:.1f} | {row['start_to_ready_s']:.1f} | "
                    f"{cold['bytes'] / row['load_s'] / 1e9:.2f} (load) | {cell(row['page_cache_before_start'], 3)} |"
                )
    caches = ", ".join(f"{row['variant']} {cell(row.get('inductor_cache_files_before'))}" for row in done)
    hosts = sorted(({row.get("host") for row in rows} | {(cold or {}).get("host")}) - {None})
    lines += [
        "",
        "Phases: text encoding is the pipeline's `encode_prompt` calls (prompt and negative prompt); VAE decode is "
        "`vae.decode`; denoising runs from the end of text encoding to the start of the decode (latents, timesteps, "
        "the loop); other is the rest of end to end (image post-processing; for ours also the engine: validation, "
        "the trip to the workers, PIL conversion). Ours is split on rank 0's worker. Each boundary synchronises the "
        "GPU. Peak allocated is torch's allocator peak during a timed run (ours: read in each worker); nvidia-smi "
        "reports the whole device every 200 ms from the variant's start (ours: the engine's start included; "
        "diffusers: after loading). Graph captures and compile seconds are counted in the process that runs the "
        "transformer (ours: rank 0's worker); compile includes every torch.compile frame, and a capture's seconds "
        "include the first forward of a new shape. Files in the inductor cache before each variant (a warm cache "
        f"compiles faster): {caches}. Rows from: {', '.join(hosts)}.",
    ]
    return "\n".join(lines)


# ---- main ------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", nargs="+", choices=PHASES, required=True, help="phases to run, in this order")
    parser.add_argument("--variants", nargs="+", choices=list(BY_NAME), help="only these variants of the phases")
    parser.add_argument("--tiny", action="store_true", help="smoke mode: tiny model on CPU, 208x240, 2 steps")
    parser.add_argument("--folder", type=Path, help="checkpoint folder (default /tmp/qwen-image-e2e[-tiny])")
    parser.add_argument("--rebuild", action="store_true", help="rebuild the checkpoint folder even if present")
    parser.add_argument("--runs", type=int, default=2, help="timed runs per variant (%(default)s)")
    parser.add_argument("--steps", type=int, help="denoising steps of a timed run (default 50; --tiny 2)")
    parser.add_argument("--size", help="WxH of every run (default 1328x1328, or the --tiny model's)")
    parser.add_argument("--warmup-steps", type=int, default=2, help="steps of the untimed warm-up run (%(default)s)")
    parser.add_argument("--no-cold-start", action="store_true", help="ours: skip the reads and the eviction")
    parser.add_argument(
        "--max-cold-read-s",
        type=float,
        default=150.0,
        help="ours-default starts from the page cache when reading the evicted folder took longer (%(default)s)",
    )
    parser.add_argument("--out", type=Path, help=f"results JSON (default {DEFAULT_OUT.relative_to(ROOT)})")
    parser.add_argument("--docs", type=Path, help=f"docs page (default {DEFAULT_DOCS.relative_to(ROOT)})")
    parser.add_argument("--copy-to", type=Path, help="also copy the JSON and the docs page here after each save")
    parser.add_argument(
        "--docs-key",
        default=KEY,
        help="the docs section to write (another card's rows go to a section of their own: their ratios are "
        "taken within one call, on one card)",
    )
    args = parser.parse_args(argv)

    scale = TINY if args.tiny else REAL
    if args.steps is not None:
        scale = dataclasses.replace(scale, steps=args.steps)
    if args.size is not None:
        width, height = (int(side) for side in args.size.lower().split("x"))
        scale = dataclasses.replace(scale, width=width, height=height)
    scratch = Path(tempfile.gettempdir())
    folder = (args.folder or scratch / f"qwen-image-e2e{'-tiny' if args.tiny else ''}").resolve()
    out = args.out or (scratch / "qwen_image_e2e_tiny.json" if args.tiny else DEFAULT_OUT)
    docs = args.docs or (scratch / "qwen_image_e2e_tiny.md" if args.tiny else DEFAULT_DOCS)
    if args.tiny and {out.resolve(), docs.resolve()} & {DEFAULT_OUT.resolve(), DEFAULT_DOCS.resolve()}:
        raise SystemExit("--tiny must not write the committed results or docs: give --out and --docs elsewhere")
    selected = [v for v in VARIANTS if v.phase in args.phase and (not args.variants or v.name in args.variants)]
    if not args.tiny:
        gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
        needed = max([v.gpus for v in selected] + [1 if "build" in args.phase else 0])
        if gpus < needed:
            raise SystemExit(f"these variants need {needed} CUDA GPU(s), found {gpus}; --tiny runs on CPU")

    settings = Settings(scale, folder, args.runs, args.warmup_steps)
    results = load_results(out)

    def save() -> None:
        add_agreement(results["variants"], IMAGES)
        card = next((row.get("device") for row in results["variants"].values() if row.get("device")), "one GPU")

        def section(results: dict[str, Any]) -> str:  # another card's rows: a heading of their own
            text = docs_section(results)
            return text if args.docs_key == KEY else text.replace("(ours vs diffusers)", f"on an {card}", 1)

        save_results(results, out, docs, args.docs_key, section, KEY)
        copy_outputs(args.copy_to, out, docs)

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
        if phase in ("offload", "pcie") and not args.tiny:  # the bandwidth the offload rows stream at
            pcie = measure_pcie()
            if pcie is not None:
                results["pcie"] = pcie
                save()
            if phase == "pcie":
                continue
        if not (folder / BUILD_MARKER).is_file():
            raise SystemExit(f"{folder} holds no checkpoint: run --phase build first (same --folder)")
        if phase == "diffusers" and names:

            def keep(row: dict[str, Any]) -> None:
                results["variants"][row["variant"]] = row
                save()  # after each variant: a call cut short keeps what it measured

            run_diffusers(settings, names, keep)
        elif phase in ("ours", "ours2", "levers", "offload", "lora", "cfg"):
            cold_read_s = 0.0
            if phase == "ours" and not args.no_cold_start:
                results["cold_start"] = measure_reads(folder)
                cold_read_s = results["cold_start"]["reads"][0]["s"]
                save()
            probe_root = Path(tempfile.mkdtemp(prefix="qwen_image_e2e_probe_"))
            for group in engine_groups([BY_NAME[name] for name in names]):
                # A slow disk would spend the call's time twice: then the engine starts from the page cache.
                slow = phase == "ours" and not args.no_cold_start and cold_read_s > args.max_cold_read_s
                cold = group[0].name == "ours-default" and not args.no_cold_start and not slow
                try:
                    rows = run_ours(settings, group, probe_root, cold)
                except Exception as exc:  # noqa: BLE001 - recorded in the results; the next variant still runs
                    rows = [failed_row(variant, settings, exc) for variant in group]
                for row in rows:
                    results["variants"][row["variant"]] = row
                    if phase == "ours" and not args.no_cold_start and not row.get("error"):
                        # The start next to the reads it is compared with (a later warm run keeps these).
                        results["cold_start"].setdefault("engines", {})[row["variant"]] = {
                            k: row[k] for k in START_KEYS
                        }
                save()
            shutil.rmtree(probe_root, ignore_errors=True)
    for what, value, target in ratios(results):
        print(f"{what}: {cell(value, 3)} {target}", flush=True)
    print(f"results: {out}\ndocs: {docs}", flush=True)


if __name__ == "__mp_main__" and os.environ.get(PROBE_ENV):
    # This script, re-run as the main module of an engine worker that multiprocessing spawned.
    install_worker_probe(Path(os.environ[PROBE_ENV]))

if __name__ == "__main__":
    main()
