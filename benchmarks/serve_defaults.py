"""`vllm-omni serve MODEL` with no options, as a new user runs it: does it start on the card, what does it admit,
and how long does one request at the model's default size take (issue 44).

For each family given, a real-size random-weight checkpoint is written first: Qwen-Image by qwen_image_e2e.py's
build (57.7 GB); the others from the released configs in benchmarks/checkpoints/<name>/ (`build_released`: each
component made from its config on the GPU in bf16, saved, freed; tokenizers and processors copied from the tiny
model of the family, whose model_index.json the folder shares). The server starts as a process with no engine
option, /health is polled until it answers 200 (or the server exits), and one request goes through the family's
route at the model's default size and steps: images/generations (Qwen-Image with the negative prompt " ": true
CFG 4.0, as its model card runs it), images/edits with one 1024x1024 source (Qwen-Image-Edit-2509), or
/v1/videos, polled until it completes (HunyuanVideo 1.5). Recorded per family, one row each in
benchmarks/results/serve_defaults.json: the card, started or not (with the refusal), the start lines (the memory
plan, the measured step, the envelope), GET /v1/models's envelope, seconds to ready, the request's seconds.
Checkpoints that do not fit the device's 64 GiB disk (FLUX.2-dev with its 24B text encoder: 112 GB; Wan2.2 A14B's
two experts and UMT5: 69 GB; LTX-2's 19B transformer and Gemma 3 12B: 68 GB) are planned on the meta device
instead: `vllm-omni plan` (`--phase plan`, no GPU).

On the device (`.whl` carried: diffusers, fastapi, starlette, uvicorn, pydantic, python-multipart):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    python3 benchmarks/serve_defaults.py --copy-to $OUT --families z-image glm-image
    python3 benchmarks/serve_defaults.py --copy-to $OUT --options "--gpu-memory-utilization 0.6"   # a 48 GiB share

Each family's folder is deleted after its row unless --keep (the disk holds one at a time). `--phase build` only
writes the checkpoints, so that a long request (HunyuanVideo 1.5's 50 steps) gets a device call of its own.
`--phase docs` rewrites the docs section from the JSON (no GPU).
"""  # noqa: E501

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "serve_defaults.json"
DOCS = ROOT / "docs" / "benchmarks.md"
PORT = 8123
H100_TOTAL_GIB = 79.18  # torch.cuda.mem_get_info's total on an H100 80GB HBM3
READY_TIMEOUT_S = 1200
# The start lines worth keeping: the plan, the measured step, the envelope, the refusal.
KEPT = re.compile(r"memory plan:|offload chosen|Measured one step|Serving up to|does not fit|Warm-up done|Engine ready")


def get(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(url, timeout=10) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as error:
        return error.code, {}
    except (urllib.error.URLError, ConnectionError, TimeoutError):
        return 0, {}


def post(url: str, body: dict[str, Any], timeout: float) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read() or b"{}")


def card() -> str:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"


def multipart(fields: dict[str, str], files: dict[str, tuple[str, bytes]]) -> tuple[bytes, str]:
    """A multipart/form-data body (and its content type) of text `fields` and `files` (name -> (filename, bytes))."""
    boundary = "serve-defaults-boundary"
    parts = [
        f'--{boundary}\r\nContent-Disposition: form-data; name="{k}"\r\n\r\n{v}\r\n'.encode() for k, v in fields.items()
    ]
    for key, (filename, data) in files.items():
        head = f'--{boundary}\r\nContent-Disposition: form-data; name="{key}"; filename="{filename}"\r\n'
        parts.append(head.encode() + b"Content-Type: image/png\r\n\r\n" + data + b"\r\n")
    return b"".join(parts) + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def send(base: str, route: str, request: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    """One request at the model's defaults through `route`; a video is polled until it completes or fails."""
    if route == "/v1/images/edits":
        from vllm_omni.diffusion.engine.admission import SOURCE_SIDE, gray_png

        body, kind = multipart(request, {"image": ("source.png", gray_png(SOURCE_SIDE, SOURCE_SIDE))})
        http = urllib.request.Request(base + route, body, {"Content-Type": kind})
        try:
            with urllib.request.urlopen(http, timeout=1800) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read() or b"{}")
    status, answer = post(base + route, request, timeout=1800)
    if route != "/v1/videos" or status != 200:
        return status, answer
    while answer.get("status") in ("queued", "in_progress"):
        time.sleep(2)
        status, answer = get(f"{base}/v1/videos/{answer['id']}")
    return (200 if answer.get("status") == "completed" else 500), answer


def serve_row(
    family: str, folder: Path, route: str, request: dict[str, Any], log_path: Path, options: list[str]
) -> dict[str, Any]:
    """Start `vllm-omni serve folder` with `options` (none: as a new user does), wait for it, send `request` to
    `route`, stop it."""
    base = f"http://127.0.0.1:{PORT}"
    command = [sys.executable, "-m", "vllm_omni.entrypoints.cli.main", "serve", str(folder), "--port", str(PORT)]
    command += options
    shown = " ".join(["vllm-omni serve FOLDER", *options])
    row: dict[str, Any] = {"family": family, "card": card(), "command": shown, "started": False}
    start = time.perf_counter()
    with open(log_path, "w") as log:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            while time.perf_counter() - start < READY_TIMEOUT_S and server.poll() is None:
                if get(f"{base}/health")[0] == 200:
                    row["started"] = True
                    break
                time.sleep(2)
            row["ready_s"] = round(time.perf_counter() - start, 1)
            if row["started"]:
                row["envelope"] = get(f"{base}/v1/models")[1]["data"][0].get("envelope")
                sent = time.perf_counter()
                status, answer = send(base, route, request)
                row["request"] = {"route": route, **{k: v for k, v in request.items() if k != "prompt"}}
                row["request"]["status"] = status
                row["request_s"] = round(time.perf_counter() - sent, 2)
                if route == "/v1/videos":  # what the defaults made: size, length, frames per second
                    row["request"].update({k: answer.get(k) for k in ("size", "seconds", "fps")})
                if status != 200:
                    row["request"]["error"] = answer
        finally:
            server.terminate()
            try:
                server.wait(timeout=60)
            except subprocess.TimeoutExpired:
                server.kill()
    lines = [line.rstrip() for line in log_path.read_text(errors="replace").splitlines() if KEPT.search(line)]
    row["start_lines"] = [line.split("] ", 1)[-1] for line in lines]
    return row


def h100_share() -> float:
    """The --gpu-memory-utilization that gives this card an H100 80GB's default budget (0.9 of its total)."""
    import torch

    return 0.9 * H100_TOTAL_GIB * 2**30 / torch.cuda.mem_get_info()[1]


def qwen_image(folder: Path) -> tuple[Path, str, dict[str, Any]]:
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import qwen_image_e2e

    qwen_image_e2e.build_checkpoint(qwen_image_e2e.REAL, folder, rebuild=False)
    request = {"prompt": "A cat holding a sign that says hello world.", "negative_prompt": " "}
    return folder, "/v1/images/generations", {**request, "response_format": "b64_json"}  # the model's defaults


# Checkpoint folder (benchmarks/checkpoints/) -> the tiny model whose tokenizers and processors it takes.
TINY = {
    "qwen-image-edit-plus": "tiny/qwen-image-edit-plus",
    "hunyuan-video-1.5": "tiny/hunyuan-video-1.5",
    "z-image": "tiny/z-image",
    "glm-image": "tiny/glm-image",
    "wan2.2-ti2v-5b": "tiny/wan2.2-ti2v",
}
# Too large for the device's disk at bf16: planned on the meta device (`--phase plan`).
PLANNED_ONLY = ("flux2-dev", "wan2.2-t2v-a14b", "ltx-2")


def glm_image_sampling(partial: Path) -> None:
    """GLM-Image's AR model samples its prior tokens until its end token; random weights would emit it anywhere.
    As benchmarks/glm_image.py: the processor's tokenizer at the real codebook (16384 vision ids, then the image
    start and end ids the config names), an end token no sample reaches, so every request generates the
    released count of tokens, and no sample past the codebook."""
    from transformers import GenerationConfig

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from glm_image import REAL_VISION_IDS, SAMPLING

    from vllm_omni.diffusion.models.glm_image.tiny import build_ar_processor, build_ar_tokenizer

    tokenizer = build_ar_tokenizer(REAL_VISION_IDS)
    shutil.rmtree(partial / "processor", ignore_errors=True)
    build_ar_processor(tokenizer).save_pretrained(partial / "processor")
    text = json.loads((partial / "vision_language_encoder" / "config.json").read_text())["text_config"]
    pad, unsampled = tokenizer.convert_tokens_to_ids("<|endoftext|>"), text["vocab_size"] - 1
    # Its head also scores the image start, end and other specials past the codebook, which a trained model never
    # samples inside an image and the DiT cannot look up (the engine refuses them): random weights would.
    beyond = list(range(REAL_VISION_IDS, text["vision_vocab_size"]))
    config = GenerationConfig(
        do_sample=True, pad_token_id=pad, eos_token_id=unsampled, suppress_tokens=beyond, **SAMPLING
    )
    config.save_pretrained(partial / "vision_language_encoder")


def qwen_vl_token_ids(partial: Path) -> None:
    """Qwen2.5-VL finds a source image's place in the prompt by the ids its config names (<|image_pad|> and the
    vision marks): those of the tiny model's tokenizer, copied in, not the released vocabulary's. Without this an
    edit fails with "Image features and image tokens do not match, tokens: 0"."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(partial / "tokenizer")
    path = partial / "text_encoder" / "config.json"
    config = json.loads(path.read_text())
    for key, token in (
        ("image_token_id", "<|image_pad|>"),
        ("video_token_id", "<|video_pad|>"),
        ("vision_start_token_id", "<|vision_start|>"),
        ("vision_end_token_id", "<|vision_end|>"),
    ):
        config[key] = tokenizer.convert_tokens_to_ids(token)
    path.write_text(json.dumps(config, indent=2) + "\n")


# What a random-weight checkpoint needs beyond its configs to run a request as the released one does.
AFTER_BUILD: dict[str, Callable[[Path], None]] = {
    "glm-image": glm_image_sampling,
    "qwen-image-edit-plus": qwen_vl_token_ids,
}


def build_released(name: str, folder: Path, configs: Path | None = None, device: str = "cuda") -> None:
    """Write a random-weight checkpoint of benchmarks/checkpoints/<name>/ (real dimensions, bf16) into `folder`,
    one component at a time on the GPU; the tokenizers and processors are the tiny model's (TINY)."""
    import diffusers
    import torch
    import transformers

    sys.path.insert(0, str(ROOT))
    from benchmarks.harness.e2e import BUILD_MARKER
    from vllm_omni.diffusion.model_source import resolve_model_path

    if (folder / BUILD_MARKER).is_file():
        print(f"build: {folder} is there", flush=True)
        return
    configs, tiny = configs or ROOT / "benchmarks" / "checkpoints" / name, resolve_model_path(TINY[name])
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    shutil.copytree(configs, partial)
    index = json.loads((configs / "model_index.json").read_text())
    start, written = time.perf_counter(), 0
    for component, (library, class_name) in ((k, v) for k, v in index.items() if isinstance(v, list) and v[0]):
        if not (configs / component / "config.json").is_file():  # tokenizers, processors: the tiny model's
            if (tiny / component).is_dir():
                shutil.copytree(tiny / component, partial / component, dirs_exist_ok=True)
            continue
        torch.manual_seed(0)
        previous = torch.get_default_dtype()
        torch.set_default_dtype(torch.bfloat16)
        try:
            with torch.device(device):
                if library == "diffusers":
                    model_class = getattr(diffusers, class_name)
                    model = model_class.from_config(model_class.load_config(configs / component))
                else:
                    config = transformers.AutoConfig.from_pretrained(configs / component)
                    model = getattr(transformers, class_name)._from_config(config, dtype=torch.bfloat16)
        finally:
            torch.set_default_dtype(previous)
        model.to(torch.bfloat16).eval().save_pretrained(partial / component, safe_serialization=True)
        size = sum(f.stat().st_size for f in (partial / component).glob("*.safetensors"))
        written += size
        print(f"build: {name} {component} {size / 1e9:.2f} GB ({time.perf_counter() - start:.0f} s)", flush=True)
        del model
        if device == "cuda":
            torch.cuda.empty_cache()
    if name in AFTER_BUILD:
        AFTER_BUILD[name](partial)
    os.sync()
    (partial / BUILD_MARKER).write_text(json.dumps({"scale": name, "bytes": written}) + "\n")
    os.replace(partial, folder)
    print(f"build: {written / 1e9:.1f} GB in {time.perf_counter() - start:.0f} s", flush=True)


def released(name: str, route: str, request: dict[str, Any]) -> Callable[[Path], tuple[Path, str, dict[str, Any]]]:
    def make(folder: Path) -> tuple[Path, str, dict[str, Any]]:
        build_released(name, folder)
        return folder, route, request

    return make


PROMPT = "A cat holding a sign that says hello world."
FAMILIES: dict[str, Callable[[Path], tuple[Path, str, dict[str, Any]]]] = {
    "qwen-image": qwen_image,
    "qwen-image-edit-plus": released("qwen-image-edit-plus", "/v1/images/edits", {"prompt": "Make the sky purple."}),
    "hunyuan-video-1.5": released("hunyuan-video-1.5", "/v1/videos", {"prompt": PROMPT}),
    "z-image": released("z-image", "/v1/images/generations", {"prompt": PROMPT, "response_format": "b64_json"}),
    "glm-image": released("glm-image", "/v1/images/generations", {"prompt": PROMPT, "response_format": "b64_json"}),
    "wan2.2-ti2v-5b": released("wan2.2-ti2v-5b", "/v1/videos", {"prompt": PROMPT}),
}


def plan_row(name: str, gib: float) -> dict[str, Any]:
    """`vllm-omni plan` of a checkpoint too large for the device's disk, on a GPU of `gib` (no GPU, no weights)."""
    sys.path.insert(0, str(ROOT))
    from vllm_omni.diffusion.engine.admission import plan_deploy
    from vllm_omni.diffusion.engine.args import EngineArgs

    deploy = plan_deploy(EngineArgs(str(ROOT / "benchmarks" / "checkpoints" / name)), int(gib * 2**30))
    row: dict[str, Any] = {"family": name, "card": f"planned for {gib:g} GiB (an H100 80GB's total)"}
    row["command"] = f"vllm-omni plan benchmarks/checkpoints/{name} --gpu-memory {gib:g}"
    row["started"] = deploy.starts
    row["envelope"] = {"description": deploy.description} if deploy.starts else None
    row["start_lines"] = deploy.lines()
    row["placement"] = deploy.plan.offload if deploy.starts else None
    return row


def placement(row: dict[str, Any]) -> str:
    """The placement `--cpu-offload auto` chose, from the start lines (or the plan)."""
    if row.get("placement"):
        return row["placement"]
    chosen = next((re.search(r"(\w+) offload chosen", x) for x in row["start_lines"] if "offload chosen" in x), None)
    return chosen.group(1) if chosen else "none"


def docs_section(results: dict[str, Any]) -> str:
    lines = [
        "### `vllm-omni serve MODEL` with no options (issue 44)",
        "",
        "Real dimensions, random bf16 weights, one request at the model's default size and steps "
        "(`benchmarks/serve_defaults.py`).",
        "",
        "| family | command | card | started | placement | envelope | ready (s) | request | request (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in results.values():
        envelope = (row.get("envelope") or {}).get("description", "-")
        started = "yes" if row["started"] else "no: " + next((x for x in row["start_lines"] if "not fit" in x), "?")
        request = row.get("request") or {}
        made = ", ".join(f"{k} {request[k]}" for k in ("size", "seconds", "num_inference_steps") if request.get(k))
        asked = f"{request.get('route', '-')} {request.get('status', '')}" + (f" ({made})" if made else "")
        cells = [row["family"], f"`{row['command']}`", row["card"], started, placement(row), envelope]
        cells += [str(row.get("ready_s", "-")), asked, str(row.get("request_s", "-"))]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        f"Planned, not served: {', '.join(PLANNED_ONLY)}: their bf16 checkpoints do not fit the device's 64 GiB disk; "
        "their rows are `vllm-omni plan` of the released configs on the meta device (`--phase plan`).",
    ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", nargs="+", default=list(FAMILIES), choices=list(FAMILIES))
    parser.add_argument(
        "--phase",
        choices=["build", "serve", "plan", "docs"],
        default="serve",
        help="build: write the families' checkpoints and keep them (a later serve reuses them); serve: build if "
        "missing, serve, delete unless --keep",
    )
    parser.add_argument("--folder-root", type=Path, default=Path("/tmp"))
    parser.add_argument("--copy-to", type=Path)
    parser.add_argument("--keep", action="store_true", help="keep each built checkpoint (default: delete it)")
    parser.add_argument(
        "--options",
        default="",
        help="serve options, one string (e.g. '--gpu-memory-utilization 0.6': a 48 GiB share of an 80 GB card); "
        "a row of its own",
    )
    parser.add_argument(
        "--steps",
        type=int,
        help="denoising steps of the request (default: the model's own); the row says so. For a default request "
        "longer than a device call (HunyuanVideo 1.5's 50 steps at 848x480x121 take about 5 minutes on an H100)",
    )
    parser.add_argument(
        "--as-h100",
        action="store_true",
        help="on a larger card (an H200), serve with --gpu-memory-utilization set so that the budget is an H100 "
        "80GB's default one (0.9 of 79.18 GiB); the row names both",
    )
    args = parser.parse_args()
    options = args.options.split()
    if args.as_h100 and args.phase == "serve":
        options += ["--gpu-memory-utilization", f"{h100_share():.4f}"]
    results = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    if args.phase == "build":
        for family in args.families:
            FAMILIES[family](args.folder_root / f"{family}-e2e")
        return
    if args.phase == "serve":
        for family in args.families:
            folder, route, request = FAMILIES[family](args.folder_root / f"{family}-e2e")
            if args.steps is not None:  # the size stays the model's default
                request = {**request, "num_inference_steps": args.steps}
            log = (args.copy_to or Path("/tmp")) / f"serve-{family}.log"
            key = f"{family} {args.options}".strip()
            results[key] = row = serve_row(family, folder, route, request, log, options)
            if args.as_h100:
                row["card"] += f" held to an H100 80GB's budget ({0.9 * H100_TOTAL_GIB:.2f} GiB)"
            if not args.keep and family != "qwen-image":  # the disk holds one checkpoint at a time
                shutil.rmtree(folder, ignore_errors=True)
            print(json.dumps(row, indent=1), flush=True)
            RESULTS.parent.mkdir(parents=True, exist_ok=True)
            RESULTS.write_text(json.dumps(results, indent=1) + "\n")
            if args.copy_to is not None:
                shutil.copy(RESULTS, args.copy_to / RESULTS.name)
    if args.phase == "plan":
        for name in PLANNED_ONLY:
            results[name] = plan_row(name, H100_TOTAL_GIB)
            print("\n".join(results[name]["start_lines"]), flush=True)
        RESULTS.write_text(json.dumps(results, indent=1) + "\n")
    sys.path.insert(0, str(ROOT))
    from benchmarks.harness.reports import replace_section

    replace_section(DOCS, "serve_defaults", docs_section(results), "serve_defaults")
    if args.copy_to is not None:
        shutil.copy(DOCS, args.copy_to / DOCS.name)


if __name__ == "__main__":
    main()
