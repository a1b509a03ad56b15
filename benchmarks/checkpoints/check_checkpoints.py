"""Check the config-only checkpoint folders next to this script (benchmarks/checkpoints/<name>/).

Each folder holds a released checkpoint's model_index.json and its components' config files, no weights. For
every component with weights this builds its class from the config on the meta device (nothing is allocated),
counts the parameters and compares them with the released count where one is known; it also checks that the
engine's registry picks a spec for the folder (`spec_for(index["_class_name"], index)`). One line per component:

    checkpoint  component  class  parameters (billions)  [released count, verdict]

    python benchmarks/checkpoints/check_checkpoints.py            # every folder
    python benchmarks/checkpoints/check_checkpoints.py qwen-image # some

Exits 1 when a component does not build, a count is more than 2% off the released one, or no spec is found.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1]))

# Released parameter counts (billions) to compare with; a component not listed is only reported.
RELEASED = {
    ("qwen-image", "transformer"): 20.43,  # measured in this repo (benchmarks/qwen_image_e2e.py)
    ("qwen-image", "text_encoder"): 8.29,  # Qwen2.5-VL-7B with its vision tower, measured in this repo
    ("qwen-image-edit-plus", "transformer"): 20.43,
    ("qwen-image-edit-plus", "text_encoder"): 8.29,
    ("flux2-dev", "transformer"): 32.2,
    ("flux2-dev", "text_encoder"): 24.0,  # Mistral-Small-3.x-24B
    ("flux2-klein", "transformer"): 4.0,  # "4B" in the name
    ("flux2-klein", "text_encoder"): 4.02,  # Qwen3-4B
    ("z-image", "transformer"): 6.15,  # "6B" on the model card; benchmarks/z_image_sp.py: 6.2B
    ("z-image", "text_encoder"): 4.02,  # Qwen3-4B as Qwen3Model (its lm_head is tied: no parameters of its own)
    ("hunyuan-video-1.5", "transformer"): 8.33,
    ("hunyuan-video-1.5", "text_encoder"): 7.07,  # Qwen2.5-VL-7B text model
    ("hunyuan-video-1.5", "text_encoder_2"): 0.22,  # ByT5-small's encoder
    ("hunyuan-video-1.5", "vae"): 1.26,
    ("wan2.2-t2v-a14b", "transformer"): 14.29,
    ("wan2.2-t2v-a14b", "transformer_2"): 14.29,
    ("wan2.2-t2v-a14b", "text_encoder"): 5.68,  # UMT5-XXL encoder
    ("wan2.2-t2v-a14b", "vae"): 0.127,  # Wan2.1 VAE
    ("wan2.2-ti2v-5b", "transformer"): 5.0,
    ("wan2.2-ti2v-5b", "text_encoder"): 5.68,
    ("glm-image", "transformer"): 7.0,  # "7B diffusion decoder" (model card)
    ("glm-image", "vision_language_encoder"): 10.0,  # "9B AR generator" (model card) plus its vision tower and VQ
    ("ltx-2", "transformer"): 18.9,  # "19B" (model card): the audio-video transformer, benchmarks/ltx2_sp.py
    ("ltx-2", "text_encoder"): 12.2,  # Gemma 3 12B with its SigLIP vision tower
}
TOLERANCE = 0.02
WIDE = {
    ("glm-image", "transformer"),
    ("glm-image", "vision_language_encoder"),
    ("wan2.2-ti2v-5b", "transformer"),
    ("flux2-klein", "transformer"),
}
WIDE_TOLERANCE = 0.15  # the model card's round numbers


def count(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())  # parameters() lists a tied weight once


def check(folder: Path) -> list[str]:
    """Print the folder's lines; return its failures."""
    from vllm_omni.diffusion.models.registry import spec_for
    from vllm_omni.diffusion.worker.memory_plan import component_on_meta

    name = folder.name
    index = json.loads((folder / "model_index.json").read_text())
    failures = []
    try:
        spec = spec_for(index["_class_name"], index)
        variant = f" selected by {dict(spec.model_index)}" if spec.model_index else ""
        print(f"{name:22} {'(pipeline)':24} {index['_class_name']:36} spec: {spec.diffusers_class}{variant}")
    except ValueError as exc:
        failures.append(f"{name}: no spec ({exc})")
    for component, value in sorted(index.items()):
        if component.startswith("_") or not isinstance(value, list) or value[0] is None:
            continue
        class_name = value[1]
        if not (folder / component / "config.json").is_file():
            continue  # scheduler, guider, tokenizer, processor: no weights
        try:
            model = component_on_meta(folder / component)
        except Exception as exc:  # noqa: BLE001 - reported, the other components still run
            failures.append(f"{name}/{component}: does not build ({type(exc).__name__}: {exc})")
            print(f"{name:22} {component:24} {class_name:36} DOES NOT BUILD")
            continue
        billions = count(model) / 1e9
        del model
        line = f"{name:22} {component:24} {class_name:36} {billions:8.3f}B"
        released = RELEASED.get((name, component))
        if released is not None:
            tolerance = WIDE_TOLERANCE if (name, component) in WIDE else TOLERANCE
            ok = abs(billions - released) <= tolerance * released
            line += f"  released ~{released}B: {'ok' if ok else 'MISMATCH'}"
            if not ok:
                failures.append(f"{name}/{component}: {billions:.3f}B, released ~{released}B")
        print(line, flush=True)
    return failures


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("names", nargs="*", help="checkpoint folders to check (default: all)")
    args = parser.parse_args()
    folders = [HERE / n for n in args.names] or sorted(p.parent for p in HERE.glob("*/model_index.json"))
    failures = [failure for folder in folders for failure in check(folder)]
    for failure in failures:
        print("FAIL", failure)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
