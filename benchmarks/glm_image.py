"""GLM-Image on one GPU: one DiT forward (ours U1 / a simulated U8 rank vs diffusers) and the AR stage.

DiT: the real dimensions of zai-org/GLM-Image's transformer/config.json (`REAL_DIT`: 30 layers, 32 heads
x 128 = width 4096, ByT5 glyph text 1472, time embedding 512, size conditions 256, prior codebook 16384,
16 latent channels, 2x2 patches; read from a public mirror of the checkpoint, and FastVideo's config
agrees; the class defaults, 64 heads x 40, are not the checkpoint's), random bf16 weights shared by every
variant. Inputs as GlmImagePipeline's cond pass gives them: the glyph embeddings of a prompt quoting
'Hello World' (11 bytes and </s>: 12 tokens, 4 pad at U8), one prior token id per image token, a fp32
timestep, target size and crop in bf16, an empty K/V cache. Sizes (`--sizes`):

- 1024x1024: 64 x 64 = 4096 image tokens, divisible by 8.
- 1056x1056: 66 x 66 = 4356 image tokens, 4 pad at U8 (33 x 33 on the AR's grid: odd).

Variants, as benchmarks/wan22_sp.py's (whose variant table, compiled forwards and ratios this reuses):
ours U1, ours U8 trim / none / mask on a simulated rank (one GPU: the all-to-alls are local copies),
diffusers U1; with --compile, ours U1 default (compiled blocks and CUDA graphs: what the engine runs) and
diffusers U1 compiled (`compile_repeated_blocks(fullgraph=True)`).

AR: the real text dimensions of vision_language_encoder/config.json (`REAL_AR_TEXT`: 4096 hidden, 40
layers, 32 heads and 2 KV heads, MLP 13696, vocabulary 168064, lm_head over 16512 vision ids, M-RoPE),
random bf16 weights (the vision tower, used by image-to-image only, at depth 1), the checkpoint's
sampling (temperature 0.9, top-p 0.75), and models/glm_image/tiny.py's byte-level tokenizer built with
the real 16384 vision ids (so the image start and end tokens are 16384 and 16385). Random weights could
sample the end token early, so the end token is moved out of the sampled range: every run generates
the 1024x1024 count, 16 x 16 preview + 32 x 32 + 1 = 1281 tokens. Variants: ours (the family's
`encode_text`, what an SP group's rank 0 runs, with a progress callback as the runner passes one), ours
with transformers' static cache (`cache_implementation="static"`; on a GPU transformers then compiles
the decode step), and
`GlmImagePipeline.generate_prior_tokens`. Reported: ms per generated token (the prefill included) next
to the memory-bandwidth floor, the bytes one decode step must read (every decoder weight but the
embedding table, plus the lm_head) over the HBM bandwidth (`--hbm-tbps`, H200: 4.8 TB/s).

Targets: DiT ours U1 default / diffusers U1 compiled at most 0.95, trim / none at the simulated U8 rank
at most 1.01 (mask / none reported); AR ours at most 2x the floor per token.

    python benchmarks/glm_image.py --compile --parts dit   # one H200: the DiT (a few minutes, compiles)
    python benchmarks/glm_image.py --parts ar              # one H200: the AR stage (3 x 1281 tokens x 3)
    python benchmarks/glm_image.py --tiny --compile        # CPU or GPU smoke run: tiny/glm-image's dimensions,
                                                           # results in /tmp unless --out / --docs are given

Rows of earlier runs are kept in the results file unless this run repeats their part, setup, layer
count and size, so the parts can run one call each; the docs section shows them all.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section  # noqa: E402
from benchmarks.harness.sp_forward import (  # noqa: E402
    ParallelSetup,
    build_shared_models,
    check_heads,
    compiled_forwards,
    compiled_ratios,
    compiled_variants,
    device_name,
    forward_tables,
    host_timing,
    image_size_label,
    merge_rows,
    own_block_code,
    parallel_setup,
    time_sizes,
    time_variants,
)
from vllm_omni.diffusion.models.glm_image.pipeline import FAMILY, generate_prior_tokens  # noqa: E402
from vllm_omni.diffusion.models.glm_image.transformer import GlmImageTransformer2DModel  # noqa: E402

# zai-org/GLM-Image transformer/config.json.
REAL_DIT = dict(
    patch_size=2,
    in_channels=16,
    out_channels=16,
    num_layers=30,
    attention_head_dim=128,
    num_attention_heads=32,
    text_embed_dim=1472,
    time_embed_dim=512,
    condition_dim=256,
    prior_vq_quantizer_codebook_size=16384,
)
# zai-org/GLM-Image vision_language_encoder/config.json, text_config.
REAL_AR_TEXT = dict(
    hidden_size=4096,
    intermediate_size=13696,
    num_hidden_layers=40,
    num_attention_heads=32,
    num_key_value_heads=2,
    vocab_size=168064,
    vision_vocab_size=16512,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 10000,
        "mrope_section": [8, 12, 12],
        "partial_rotary_factor": 0.5,
    },
)
REAL_VISION_IDS = 16384  # the codebook: <|dit_token_0..16383|>, then image start 16384 and image end 16385
SAMPLING = dict(temperature=0.9, top_p=0.75)  # the checkpoint's generation_config (its model card)
TEXT_LEN = 12  # the glyph text of a prompt quoting 'Hello World': 11 bytes and </s>
TIMESTEP = 500.0
SIZES = ["1024x1024", "1056x1056"]
AR_SIZE = "1024x1024"
# The tiny DiT has 6 heads: its simulated rank is U3's; 64x64 is 16 image tokens (2 pad), 96x96 36.
TINY_SIZES, TINY_AR_SIZE, TINY_DEGREE = ["64x64", "96x96"], "64x64", 3
PROMPT = (
    "A neon sign that says 'Hello World' above the door of a small ramen shop at night, rain on the street, "
    "reflections of red and blue light in the puddles, a cat sleeping on a wooden bench, cinematic, detailed"
)
TINY = "tiny/glm-image"


def sides(size: str) -> tuple[int, int]:
    width, height = (int(part) for part in size.split("x"))
    return width, height


def image_tokens(size: str) -> int:
    width, height = sides(size)
    return (width // 16) * (height // 16)  # 8x VAE, 2x2 patches


# ---- the DiT --------------------------------------------------------------------------------------


def dit_config(tiny: bool, layers: int | None) -> dict[str, Any]:
    if tiny:
        from vllm_omni.diffusion.models.glm_image.tiny import tiny_model_path

        stored = GlmImageTransformer2DModel.load_config(tiny_model_path(TINY), subfolder="transformer")
        config = {key: value for key, value in stored.items() if not key.startswith("_")}
    else:
        config = dict(REAL_DIT)
    return config if layers is None else dict(config, num_layers=layers)


def build_dit(config: dict[str, Any], device: torch.device) -> dict:
    from diffusers import GlmImageTransformer2DModel as Reference

    models = build_shared_models(Reference, GlmImageTransformer2DModel, config, device, simulate=True)
    own_block_code(models["diffusers"].transformer_blocks)  # see harness/sp_forward.py
    return models


def dit_inputs(size: str, config: dict[str, Any], device: torch.device) -> dict:
    from diffusers.models.transformers.transformer_glm_image import GlmImageKVCache

    width, height = sides(size)
    gen = torch.Generator(device).manual_seed(1)
    tokens, bf16 = image_tokens(size), torch.bfloat16
    return dict(
        hidden_states=torch.randn(
            1, config["in_channels"], height // 8, width // 8, generator=gen, device=device, dtype=bf16
        ),
        encoder_hidden_states=torch.randn(
            1, TEXT_LEN, config["text_embed_dim"], generator=gen, device=device, dtype=bf16
        ),
        prior_token_id=torch.randint(
            0, config["prior_vq_quantizer_codebook_size"], (1, tokens), generator=gen, device=device
        ),
        prior_token_drop=torch.zeros(1, tokens, dtype=torch.bool, device=device),
        timestep=torch.full((1,), TIMESTEP, device=device),
        target_size=torch.tensor([[height, width]], dtype=bf16, device=device),
        crop_coords=torch.zeros(1, 2, dtype=bf16, device=device),
        kv_caches=GlmImageKVCache(num_layers=config["num_layers"]),
        return_dict=False,
    )


def run_dit(args, parallel: ParallelSetup) -> list[dict]:
    device, degree = parallel.device, parallel.state.config.ulysses_degree
    config = dit_config(args.tiny, args.layers)
    check_heads(config["num_attention_heads"], degree)
    models = build_dit(config, device)
    compiled = compiled_forwards(models) if args.compile else None
    return time_sizes(
        parallel,
        args.sizes,
        lambda size: compiled_variants(
            models, compiled, parallel.state, degree, parallel.simulated, image_tokens(size)
        ),
        lambda size: dit_inputs(size, config, device),
        lambda size: dict(
            part="dit",
            size=size,
            image_tokens=image_tokens(size),
            text_tokens=TEXT_LEN,
            pad=-image_tokens(size) % degree,
            text_pad=-TEXT_LEN % degree,
        ),
        config["num_layers"],
        args.iters,
        args.warmup,
        compiled,
        label="DiT ",
    )


# ---- the AR stage ---------------------------------------------------------------------------------


def build_ar_pipeline(tiny: bool, layers: int | None, device: torch.device):
    """A GlmImagePipeline holding only what the AR stage uses: `processor` and `vision_language_encoder`."""
    from diffusers import GlmImagePipeline
    from transformers import GenerationConfig, GlmImageConfig, GlmImageForConditionalGeneration

    without_dit = dict.fromkeys(("tokenizer", "text_encoder", "vae", "transformer", "scheduler"))
    if tiny:
        from vllm_omni.diffusion.models.glm_image.tiny import tiny_model_path

        # Its end token is already past the sampled vision ids.
        pipe = GlmImagePipeline.from_pretrained(tiny_model_path(TINY), **without_dit, dtype=torch.bfloat16)
        return pipe.to(device)

    from vllm_omni.diffusion.models.glm_image.tiny import build_ar_processor, build_ar_tokenizer

    tokenizer = build_ar_tokenizer(REAL_VISION_IDS)
    ids = tokenizer.convert_tokens_to_ids
    pad, unsampled = ids("<|endoftext|>"), REAL_AR_TEXT["vocab_size"] - 1  # an end token no sample reaches
    text = dict(REAL_AR_TEXT, pad_token_id=pad, eos_token_id=unsampled)
    if layers is not None:
        text["num_hidden_layers"] = layers
    config = GlmImageConfig(
        text_config=text,
        vision_config=dict(depth=1),  # image-to-image only
        image_token_id=ids("<|image|>"),
        image_start_token_id=REAL_VISION_IDS,
        image_end_token_id=REAL_VISION_IDS + 1,
    )
    torch.manual_seed(0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with device:
            model = GlmImageForConditionalGeneration(config).eval()
    finally:
        torch.set_default_dtype(previous)
    model.generation_config = GenerationConfig(do_sample=True, pad_token_id=pad, eos_token_id=unsampled, **SAMPLING)
    return GlmImagePipeline(processor=build_ar_processor(tokenizer), vision_language_encoder=model, **without_dit)


def decode_weight_bytes(model: torch.nn.Module) -> int:
    """Bytes one decode step reads: every text-decoder weight but the embedding table (one row), and the lm_head."""
    text = model.model.language_model
    params = [p for name, p in text.named_parameters() if not name.startswith("embed_tokens.")]
    params.append(model.lm_head.weight)
    return sum(p.numel() * p.element_size() for p in params)


def ar_variants(pipe, size: str, counts: dict[str, int]) -> dict:
    """name -> (callable returning (prior token ids,), None): ours and the pipeline's own AR call."""
    width, height = sides(size)
    device = pipe.device  # the whole pipeline is on one GPU here

    def counted(name: str):
        def progress(done: int, total: int) -> None:
            counts[name] = done

        return progress

    def ours() -> tuple[torch.Tensor]:
        kwargs = dict(prompt=PROMPT, height=height, width=width, generator=torch.Generator().manual_seed(0))
        return (FAMILY.encode_text(pipe, kwargs, device, progress=counted("ours"))["prior_token_ids"],)

    def ours_static() -> tuple[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        static = {"cache_implementation": "static"}
        progress = counted("ours static cache")
        ids = generate_prior_tokens(pipe, device, PROMPT, height, width, generator, progress, generate_kwargs=static)
        return (ids["prior_token_ids"],)

    def diffusers() -> tuple[torch.Tensor]:
        generator = torch.Generator().manual_seed(0)
        return (pipe.generate_prior_tokens(PROMPT, height, width, device=device, generator=generator)[0],)

    return {"ours": (ours, None), "ours static cache": (ours_static, None), "diffusers": (diffusers, None)}


def run_ar(args, device: torch.device) -> list[dict]:
    size = TINY_AR_SIZE if args.tiny else AR_SIZE
    pipe = build_ar_pipeline(args.tiny, args.ar_layers, device)
    model = pipe.vision_language_encoder
    weight_bytes = decode_weight_bytes(model)
    floor_ms = weight_bytes / (args.hbm_tbps * 1e12) * 1e3
    counts: dict[str, int] = {}
    with host_timing(device):
        chosen = {
            k: v for k, v in ar_variants(pipe, size, counts).items() if not args.ar_variants or k in args.ar_variants
        }
        result, outputs = time_variants(chosen, {}, args.ar_iters, args.ar_warmup, 0, keep_outputs=True)
    width, height = sides(size)
    ratio = height / width
    # The processor's preview grid, the AR's 32-pixel grid, the end token.
    tokens = int(16 * ratio**0.5) * int(16 / ratio**0.5) + (width // 32) * (height // 32) + 1
    rows = []
    for variant, value in result.items():
        ms = value if isinstance(value, float) else None
        row = {
            "part": "ar",
            "size": size,
            "variant": variant,
            "ms": None if ms is None else round(ms, 1),
            "error": None if ms is not None else value,
            "tokens": tokens,
            "ms_per_token": None if ms is None else round(ms / tokens, 3),
            "floor_ms_per_token": round(floor_ms, 3),
            "x_floor": None if ms is None else round(ms / tokens / floor_ms, 2),
            "decode_weight_gb": round(weight_bytes / 1e9, 2),
            "hbm_tbps": args.hbm_tbps,
            "same_tokens_as_diffusers": (
                bool(torch.equal(outputs[variant], outputs["diffusers"]))
                if variant in outputs and "diffusers" in outputs
                else None
            ),
            "setup": "one GPU" if device.type == "cuda" else "CPU smoke run",
            "device": device_name(device),
            "layers": model.config.text_config.num_hidden_layers,
        }
        if variant in counts and counts[variant] != tokens:
            row["note"] = f"progress reported {counts[variant]} of {tokens} tokens"
        rows.append(row)
        per_token = "" if ms is None else f" ({row['ms_per_token']:.2f} ms/token, {row['x_floor']:.2f}x the floor)"
        print(f"AR {size} {variant:18s} {value if ms is None else f'{ms:.0f} ms'}{per_token}", flush=True)
    print(f"AR floor: {weight_bytes / 1e9:.2f} GB a decode step / {args.hbm_tbps} TB/s = {floor_ms:.3f} ms/token")
    return rows


# ---- results --------------------------------------------------------------------------------------


def dit_section(rows: list[dict]) -> list[str]:
    degree, first = rows[0]["degree"], rows[0]
    sizes = sorted({row["size"] for row in rows}, key=image_tokens)
    header = [f"{size} ({image_tokens(size)} tokens, pad {-image_tokens(size) % degree})" for size in sizes]
    return [
        f"DiT, one forward: {first['layers']} layers (real: 30), random bf16 weights shared by every variant, the "
        f"cond pass's inputs ({first['text_tokens']} glyph text tokens, {first['text_pad']} pad at U{degree}), "
        f"batch 1, {first['device']}; {first['setup']}. `default`: compiled blocks and CUDA graphs, as the engine "
        "runs it; `compiled`: diffusers' `compile_repeated_blocks(fullgraph=True)`. Median ms, variants "
        "interleaved; in brackets, bf16 agreement of the U1 variants with ours U1.",
        "",
        *forward_tables(rows, sizes, header, compiled_ratios(degree)),
    ]


def ar_section(rows: list[dict]) -> list[str]:
    first = rows[0]
    lines = [
        f"AR stage at {first['size']} ({first['tokens']} tokens generated after the prompt): {first['layers']} "
        f"layers (real: 40), random bf16 weights, {first['device']}; {first['setup']}. ms per token includes the "
        f"prefill. The floor: {first['decode_weight_gb']} GB read per decode step / {first['hbm_tbps']} TB/s. "
        "Target: ours at most 2x the floor per token.",
        "",
        "| variant | ms | ms / token | floor ms / token | x floor | same tokens as diffusers |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        if row["ms"] is None:
            lines.append(f"| {row['variant']} | error: {row['error']} | | | | |")
            continue
        note = f" [{row['note']}]" if row.get("note") else ""
        lines.append(
            f"| {row['variant']}{note} | {row['ms']:.0f} | {row['ms_per_token']:.2f} | "
            f"{row['floor_ms_per_token']:.2f} | {row['x_floor']:.2f} | {row['same_tokens_as_diffusers']} |"
        )
    return lines


def write_docs(rows: list[dict], path: Path) -> None:
    """The docs section: per part, the rows of its latest run's setup and layer count."""
    latest = {row["part"]: (row["setup"], row["layers"]) for row in rows}
    parts = {
        part: [r for r in rows if r["part"] == part and (r["setup"], r["layers"]) == run]
        for part, run in latest.items()
    }
    lines = ["## GLM-Image: DiT forward and AR stage (ours vs diffusers)"]
    if parts.get("dit"):
        lines += ["", *dit_section(parts["dit"])]
    if parts.get("ar"):
        lines += ["", *ar_section(parts["ar"])]
    replace_section(path, "glm_image", "\n".join(lines), script="glm_image")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="tiny/glm-image's dimensions (a smoke run; CPU or GPU)")
    parser.add_argument("--parts", nargs="+", choices=["dit", "ar"], default=["dit", "ar"])
    parser.add_argument("--degree", type=int, default=None, help="the simulated rank's Ulysses degree (8; --tiny: 3)")
    parser.add_argument("--compile", action="store_true", help="add ours default and diffusers compiled")
    parser.add_argument("--sizes", nargs="+", type=image_size_label, default=None, help=f"DiT sizes (default {SIZES})")
    parser.add_argument("--iters", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--ar-iters", type=int, default=2)
    parser.add_argument("--ar-warmup", type=int, default=1)
    parser.add_argument("--ar-variants", nargs="+", default=None, help="only these AR variants (default: all)")
    parser.add_argument("--layers", type=int, default=None, help="fewer DiT layers (default: the model's)")
    parser.add_argument("--ar-layers", type=int, default=None, help="fewer AR decoder layers (default: the model's)")
    parser.add_argument("--hbm-tbps", type=float, default=4.8, help="HBM bandwidth for the floor (H200: 4.8)")
    parser.add_argument("--out", type=Path, default=None)
    add_docs_phase(parser, docs=None)
    args = parser.parse_args()
    out = args.out or (Path("/tmp/glm_image_tiny.json") if args.tiny else ROOT / "benchmarks/results/glm_image.json")
    docs = args.docs or (Path("/tmp/glm_image_tiny.md") if args.tiny else ROOT / "docs/benchmarks.md")
    if args.phase == "docs":
        write_docs(load_json(out), docs)
        return
    if not args.tiny and not torch.cuda.is_available():
        sys.exit("glm_image.py needs a CUDA GPU at real dimensions (--tiny runs anywhere)")
    args.sizes = args.sizes or (TINY_SIZES if args.tiny else SIZES)

    parallel = parallel_setup(args.degree or (TINY_DEGREE if args.tiny else 8))
    rows = []
    if "dit" in args.parts:
        rows += run_dit(args, parallel)
    if "ar" in args.parts:
        rows += run_ar(args, parallel.device)
    # One file for every run: rows of other parts, setups, layer counts and sizes are kept, this run's replaced.
    write_docs(merge_rows(out, rows, ("part", "setup", "layers", "size")), docs)
    print(f"results: {out}; docs: {docs}")


if __name__ == "__main__":
    main()
