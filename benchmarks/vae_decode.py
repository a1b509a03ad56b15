"""The VAE decode, whole against split over ranks: time and peak memory of one rank's share.

The VAE classes' default configs (HunyuanVideo 1.5's, Wan2.1/2.2 A14B's, Qwen-Image's), random
bf16 weights, one GPU. Per latent: the untiled decode (what every rank runs without the split),
the tiled decode on one rank (what the split must equal), and rank 0's share of a split over 2,
4 and 8 ranks (`ParallelTiledDecode` as a simulated rank: it decodes the tiles rank 0 owns, the
most of any rank, and skips the gather, which moves the decoded pixels once). Also the max abs
difference between the tiled and the untiled output (tile blending; with random weights only
its order of magnitude means anything). The split pays where a share takes less than the
untiled decode: that sets the default threshold (vae_parallel.AUTO_MIN_LATENT).

    python benchmarks/vae_decode.py                 # every case, one GPU (~3 minutes)
    python benchmarks/vae_decode.py --cases qwen-1024 --iters 1

Targets (issue: HunyuanVideo 1.5 848x480x121 split 8 ways): a share at most 0.2x the untiled
decode's time, and its peak memory at most 0.25x the untiled decode's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402
from vllm_omni.diffusion.worker.forward_chain import install_decode_split  # noqa: E402
from vllm_omni.diffusion.worker.vae_parallel import decode_split_class  # noqa: E402

# name: (VAE class, output WxHxF, latent shape [B, C, T, H, W] (images: T=1))
CASES = {
    "hunyuan-848x480x121": ("AutoencoderKLHunyuanVideo15", "848x480x121", (1, 32, 31, 30, 53)),
    "wan-1280x720x81": ("AutoencoderKLWan", "1280x720x81", (1, 16, 21, 90, 160)),
    "wan-848x480x81": ("AutoencoderKLWan", "848x480x81", (1, 16, 21, 60, 106)),
    "qwen-1328": ("AutoencoderKLQwenImage", "1328x1328", (1, 16, 1, 166, 166)),
    "qwen-1024": ("AutoencoderKLQwenImage", "1024x1024", (1, 16, 1, 128, 128)),
    "qwen-768": ("AutoencoderKLQwenImage", "768x768", (1, 16, 1, 96, 96)),
    "qwen-512": ("AutoencoderKLQwenImage", "512x512", (1, 16, 1, 64, 64)),
}
WORLDS = (2, 4, 8)


def timed(fn, iters: int) -> tuple[float, float, object]:
    """Median seconds and peak GiB of `fn()` (after one untimed run), and its last output."""
    fn()
    times, out = [], None
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    for _ in range(iters):
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30
    return sorted(times)[len(times) // 2], peak, out


def run_case(name: str, iters: int) -> dict:
    import diffusers

    cls_name, output, shape = CASES[name]
    torch.manual_seed(0)
    with torch.device("cuda"):
        vae = decode_split_class(getattr(diffusers, cls_name))().to(torch.bfloat16).eval()
    z = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    row: dict = {"case": name, "vae": cls_name, "output": output, "latent": list(shape)}
    with torch.inference_mode():
        vae.disable_tiling()
        row["untiled_s"], row["untiled_peak_gib"], untiled = timed(lambda: vae.decode(z).sample, iters)
        vae.enable_tiling()
        row["tiled_s"], row["tiled_peak_gib"], tiled = timed(lambda: vae.decode(z).sample, iters)
        row["tiled_vs_untiled_max_abs"] = float((tiled.float() - untiled.float()).abs().max())
        del untiled, tiled
        for world in WORLDS:
            # A simulated rank 0 (no group): its tiles only, no gather; `tiled_decode` runs its share.
            install_decode_split(vae, rank=0, world=world, group=None, control_group=None, enabled=True, on_tile=None)
            s, peak, _ = timed(lambda: vae.tiled_decode(z), iters)
            row[f"share{world}_s"], row[f"share{world}_peak_gib"] = s, peak
    return row


def docs_section(rows: list[dict], device: str) -> str:
    lines = [
        "## VAE decode: whole against one rank's share of a split (benchmarks/vae_decode.py)",
        "",
        f"The VAE classes' default configs, random bf16 weights, {device}. Seconds (median) and peak "
        "GiB of one decode; `share N`: rank 0's tiles of a split over N ranks (the most any rank decodes; "
        "the gather of the pixels is not included). Ratios against the untiled decode, which every rank "
        "runs without the split.",
        "",
        "| case | untiled s (GiB) | tiled s (GiB) | share 2 | share 4 | share 8 | share 8 / untiled: time, memory |"
        " tiled vs untiled max abs |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shares = " | ".join(f"{r[f'share{w}_s']:.3f} ({r[f'share{w}_peak_gib']:.1f})" for w in WORLDS)
        lines.append(
            f"| {r['case']} | {r['untiled_s']:.3f} ({r['untiled_peak_gib']:.1f}) | {r['tiled_s']:.3f} "
            f"({r['tiled_peak_gib']:.1f}) | {shares} | {r['share8_s'] / r['untiled_s']:.3f}, "
            f"{r['share8_peak_gib'] / r['untiled_peak_gib']:.3f} | {r['tiled_vs_untiled_max_abs']:.3g} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", nargs="+", choices=sorted(CASES), default=list(CASES))
    parser.add_argument("--iters", type=int, default=2)
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/vae_decode.json")
    add_docs_phase(parser)
    args = parser.parse_args()
    if args.phase == "docs":
        rows = load_json(args.out)
        replace_section(args.docs, "vae_decode", docs_section(rows, rows[0]["device"]))
        return
    if not torch.cuda.is_available():
        raise SystemExit("needs a CUDA GPU")
    device = torch.cuda.get_device_name()
    rows = []
    for name in args.cases:
        row = run_case(name, args.iters)
        torch.cuda.empty_cache()  # the case's VAE and outputs are gone
        row["device"] = device
        print(json.dumps(row), flush=True)
        rows.append(row)
    save_json(args.out, rows)
    replace_section(args.docs, "vae_decode", docs_section(rows, device))


if __name__ == "__main__":
    main()
