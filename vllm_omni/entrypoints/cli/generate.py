"""`vllm-omni generate MODEL --prompt ... --output out.png`: one request through the offline engine.

Starts the workers (`Omni`), runs the request, prints the step breakdown line, writes the
image(s): `out.png` for one, `out.png, out-1.png, ...` for n > 1. Takes the same engine flags as
`serve` (cli/serve.py), deploy YAML included. Called by cli/main.py.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from vllm_omni.entrypoints.cli.serve import add_engine_args, positive_int


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    add_engine_args(parser)
    req = parser.add_argument_group("request")
    req.add_argument("--prompt", required=True, help="what to draw (or, for edit models, what to change)")
    req.add_argument("--negative-prompt", default=None, help="what to steer away from; enables true CFG")
    req.add_argument(
        "--image",
        action="extend",
        nargs="+",
        default=None,
        metavar="PATH",
        help="source image(s) for edit models; repeat or list several for Edit-Plus",
    )
    req.add_argument(
        "--size",
        default=None,
        metavar="WxH",
        help="output width x height, e.g. 272x208; rounded down to a multiple of 16 "
        "(default: the pipeline's, for edits the source's aspect ratio at about 1 MP)",
    )
    req.add_argument("--steps", type=positive_int, default=None, help="denoising steps (default: the model's, 50)")
    req.add_argument("--guidance-scale", type=float, default=None, help="guidance scale (distilled guidance models)")
    req.add_argument(
        "--true-cfg-scale",
        type=float,
        default=None,
        help="classifier-free guidance scale, used with --negative-prompt (default: 4.0 with one, else off)",
    )
    req.add_argument("--n", type=positive_int, default=None, help="number of images (default: 1)")
    req.add_argument("--seed", type=int, default=None, help="random seed (default: drawn and printed)")
    req.add_argument(
        "--output",
        default="output.png",
        metavar="PATH",
        help="where to write the image; n > 1 adds -1, -2, ... before the suffix (default: output.png)",
    )


def output_paths(output: str, count: int) -> list[Path]:
    """out.png -> [out.png, out-1.png, out-2.png, ...]."""
    path = Path(output)
    return [path] + [path.with_name(f"{path.stem}-{i}{path.suffix}") for i in range(1, count)]


def cmd_generate(args: argparse.Namespace) -> int:
    from vllm_omni.entrypoints.cli.serve import engine_settings_from_args
    from vllm_omni.entrypoints.deploy_config import apply_sampling_defaults
    from vllm_omni.entrypoints.openai.protocol import parse_size

    settings = engine_settings_from_args(args)
    width = height = None
    if args.size is not None and args.size != "auto":
        width, height = parse_size(args.size, settings.limits.max_image_size)
    images = None
    if args.image:
        images = args.image if len(args.image) > 1 else args.image[0]  # paths; the engine reads them
    request = apply_sampling_defaults(
        dict(
            negative_prompt=args.negative_prompt,
            height=height,
            width=width,
            num_inference_steps=args.steps,
            guidance_scale=args.guidance_scale,
            true_cfg_scale=args.true_cfg_scale,
            n=args.n,
            seed=args.seed,
        ),
        settings.default_sampling_params,
    )
    if request["n"] is None:
        request["n"] = 1
    settings.apply_devices()

    from vllm_omni.entrypoints.omni import Omni

    parallel = settings.parallel_config
    start = time.perf_counter()
    with Omni(
        settings.model,
        ulysses_degree=parallel.ulysses_degree,
        ring_degree=parallel.ring_degree,
        cfg_parallel_size=parallel.cfg_parallel_size,
        mask_sp_padding=parallel.mask_sp_padding,
        trim_sp_padding=parallel.trim_sp_padding,
        device=settings.device,
        dtype=settings.dtype,
        attention_backend=settings.attention_backend,
        enforce_eager=settings.enforce_eager,
        limits=settings.limits,
    ) as omni:
        print(f"Engine ready in {time.perf_counter() - start:.1f} s", flush=True)
        results = omni.generate(args.prompt, image=images, **request)
        output = omni.last_output
    timings = output.timings_ms
    # The same line the engine logs, on stdout too, so it survives VLLM_LOGGING_LEVEL=WARNING.
    print(
        "DiffusionEngine.step breakdown: preprocess={preprocess:.2f} ms, add_req_and_wait={add_req_and_wait:.2f} ms, "
        "postprocess={postprocess:.2f} ms, total={total:.2f} ms".format(**timings)
    )
    for path, image in zip(output_paths(args.output, len(results)), results):
        path.parent.mkdir(parents=True, exist_ok=True)
        image.save(path)
        print(f"Wrote {path} ({output.width}x{output.height}, seed {output.seed})")
    return 0
