"""`vllm-omni generate MODEL --prompt ... --output out.png`: one request through the offline engine.

Starts the workers (`Omni`), runs the request, prints the step breakdown line, writes the
image(s) or video(s): `out.png` for one, `out.png, out-1.png, ...` for n > 1 (MP4 for video models).
Takes the engine flags of `serve` (cli/serve.py) but the server-only ones (the queue, replicas, warm-up,
adapters loaded at run time), deploy YAML included. Called by cli/main.py.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from vllm_omni.diffusion.engine.args import positive_int
from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS
from vllm_omni.entrypoints.cli.serve import add_engine_args

# Request fields only a server reads (a queue's order): one run has no queue, so no flag.
SERVER_ONLY_FIELDS = frozenset({"priority"})


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser, server=False)
    req = parser.add_argument_group("request")
    req.add_argument("--prompt", required=True, help="what to draw (or, for edit models, what to change)")
    req.add_argument(
        "--image",
        action="extend",
        nargs="+",
        default=None,
        metavar="PATH",
        help="source image(s) for edit models, reference images; repeat or list several",
    )
    # One flag per declared request field (request_fields.py); width and height travel as --size.
    req.add_argument(
        "--size",
        default=None,
        metavar="WxH",
        help="output width x height, e.g. 272x208; rounded down to the model's multiple (16 for these models) "
        "(default: the pipeline's, for edits the source's aspect ratio at about 1 MP)",
    )
    for f in SAMPLING_FIELDS:
        if f.cli_flag in parser._option_string_actions:  # --cache-threshold: the engine's flag sets both
            continue
        if f.name in SERVER_ONLY_FIELDS:
            continue
        if not f.in_size:
            signed = f.name == "seed"  # seed may be 0: the engine checks it
            kind = positive_int if f.type is int and not signed else str if f.type is dict else f.type
            req.add_argument(f.cli_flag, dest=f.name, type=kind, default=None, help=f.help)
    req.add_argument(
        "--output",
        default=None,
        metavar="PATH",
        help="where to write the result; n > 1 adds -1, -2, ... before the suffix "
        "(default: output.png, or output.mp4 for video models)",
    )


def request_values(args: argparse.Namespace) -> dict[str, Any]:
    """The declared request fields as given on the command line (None where not given)."""
    return {f.name: getattr(args, f.name, None) for f in SAMPLING_FIELDS if not f.in_size}


def output_paths(output: str, count: int) -> list[Path]:
    """out.png -> [out.png, out-1.png, out-2.png, ...]."""
    path = Path(output)
    return [path] + [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(1, count)]


def cmd_generate(args: argparse.Namespace) -> int:
    from vllm_omni.entrypoints.cli.serve import check_before_start, engine_args_from_cli
    from vllm_omni.entrypoints.deploy_config import apply_sampling_defaults
    from vllm_omni.entrypoints.openai.protocol import parse_size

    engine, deploy = engine_args_from_cli(args)
    check_before_start(engine)
    width = height = None
    if args.size is not None and args.size != "auto":
        width, height = parse_size(args.size, engine.limits.max_image_size)
    images = None
    if args.image:
        images = args.image if len(args.image) > 1 else args.image[0]  # paths; the engine reads them
    request = apply_sampling_defaults(
        dict(request_values(args), height=height, width=width), deploy.default_sampling_params if deploy else {}
    )
    if deploy is not None:
        deploy.apply_devices(engine)

    from vllm_omni.entrypoints.omni import Omni

    # One request: a warm-up, or a second replica, would only add work. The engine logs "Engine ready in ... s".
    with Omni(engine.model, **dict(engine.values(), warmup=False, data_parallel_size=1)) as omni:
        video = omni.engine.spec.modality == "video"
        results = omni.generate(args.prompt, image=images, output_type="uint8" if video else "pil", **request)
        output = omni.last_output
    timings = output.timings_ms
    # The same line the engine logs, on stdout too, so it survives VLLM_LOGGING_LEVEL=WARNING.
    print(
        "DiffusionEngine.step breakdown: preprocess={preprocess:.2f} ms, add_req_and_wait={add_req_and_wait:.2f} ms, "
        "postprocess={postprocess:.2f} ms, total={total:.2f} ms".format(**timings)
    )
    default_output = "output.mp4" if video else "output.png"
    paths = output_paths(args.output or default_output, len(results))
    sounds = output.audio or [None] * len(results)  # a model with sound: each video's
    for path, result, seed, sound in zip(paths, results, output.seeds, sounds, strict=True):  # i: from seed + i
        path.parent.mkdir(parents=True, exist_ok=True)
        if video:
            from vllm_omni.entrypoints.openai.media import encode_mp4

            path.write_bytes(encode_mp4(result, output.fps, audio=sound, sample_rate=output.audio_sample_rate))
            print(
                f"Wrote {path} ({output.width}x{output.height}, {output.num_frames} frames at {output.fps} fps, "
                f"seed {seed})"
            )
        else:
            result.save(path)
            print(f"Wrote {path} ({output.width}x{output.height}, seed {seed})")
    return 0
