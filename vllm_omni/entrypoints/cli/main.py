"""The `vllm-omni` console script, and the function vLLM hands `vllm ... --omni` to.

vLLM 0.33+ (`maybe_run_omni` in vllm/entrypoints/cli/main.py) imports this module and calls
`main()` for any command line containing `--omni`, with sys.argv untouched, so argv looks like
['vllm', 'serve', 'MODEL', '--omni', ...]. `--omni` is accepted anywhere and ignored.
Subcommands: `serve` (cli/serve.py), `generate` (cli/generate.py) and `plan` (cli/plan.py). Heavy modules load only
inside the command that needs them, so `--help` is fast.
"""

from __future__ import annotations

import argparse
import os
import sys

from vllm_omni import __version__
from vllm_omni.entrypoints.cli.generate import add_generate_args, cmd_generate
from vllm_omni.entrypoints.cli.plan import add_plan_args, cmd_plan
from vllm_omni.entrypoints.cli.serve import add_serve_args, cmd_serve

OMNI_FLAG = "--omni"


def build_parser(prog: str = "vllm-omni") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="vllm_omni: serve diffusion transformers over OpenAI-style HTTP routes (image generations "
        "and edits, chat completions that answer with images, videos, Prometheus /metrics), split over GPUs with "
        "Ulysses sequence parallelism; or run one request offline (generate), or say whether a deploy fits a GPU "
        "(plan).",
        epilog="vLLM 0.33+ hands 'vllm serve MODEL --omni ...' to this same command line.",
    )
    parser.add_argument("--version", action="version", version=f"vllm_omni {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    serve = commands.add_parser(
        "serve",
        help="start the HTTP server (POST /v1/images/generations, /v1/images/edits, /v1/chat/completions, "
        "/v1/videos, /v1/videos/sync; GET /v1/models, /health, /metrics)",
        description="Start the HTTP server. Uvicorn listens at once; /health answers 503 until every "
        "worker has loaded the model.",
    )
    add_serve_args(serve)
    serve.set_defaults(func=cmd_serve)

    generate = commands.add_parser(
        "generate",
        help="run one request through the offline engine and write the image(s)",
        description="Run one request through the offline engine, print the step breakdown, write the image(s).",
    )
    add_generate_args(generate)
    generate.set_defaults(func=cmd_generate)

    plan = commands.add_parser(
        "plan",
        help="say whether a deploy starts on a GPU of a given size and what it admits, without a GPU",
        description="Print the memory plan a server would make at start (weights per component, one step, the "
        "placement, the envelope, or the refusal and what would fit), reading no weight. Exit status 1: refused.",
    )
    add_plan_args(plan)
    plan.set_defaults(func=cmd_plan)
    return parser


def main(argv: list[str] | None = None) -> None:
    """Parse the command line (sys.argv by default), run the command, exit with its status."""
    if argv is None:
        argv = sys.argv[1:]
        prog = "vllm" if os.path.basename(sys.argv[0]) == "vllm" else "vllm-omni"
    else:
        prog = "vllm-omni"
    argv = [arg for arg in argv if arg != OMNI_FLAG]
    parser = build_parser(prog)
    args = parser.parse_args(argv)
    try:
        code = args.func(args)
    except ValueError as exc:
        # Configuration errors (deploy YAML, flags, unknown model) end the command before anything starts.
        parser.exit(2, f"{prog} {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        code = 130
    sys.exit(code)


if __name__ == "__main__":
    main()
