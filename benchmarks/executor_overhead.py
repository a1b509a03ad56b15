"""What the Ray executor costs against the multiprocessing one: start, one request, stop (CPU, tiny model).

Runs tiny/qwen-image at Ulysses 2 (208x272, 2 steps, uint8, one CPU thread per rank) on
- mp: one worker process per rank (the default),
- ray, private: `distributed_executor_backend="ray"` with no cluster (the engine starts a
  private Ray instance on this machine and stops it at close),
- ray, 2 nodes: two simulated Ray nodes on this machine (ray.cluster_utils.Cluster, one CPU
  each: one rank per node), already running, as a `ray start` cluster would be.
Each configuration is started `--rounds` times, in turn; start = Omni(...) until every rank has
loaded, request = the median of `--requests` requests after a warm-up one, stop = close().

    python benchmarks/executor_overhead.py      # writes results/executor_overhead.json + the docs/multinode.md table
"""

from __future__ import annotations

import argparse
import os
import platform
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.harness.reports import add_docs_phase, load_json, replace_section, save_json  # noqa: E402
from vllm_omni import Omni  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MODEL = "tiny/qwen-image"
REQUEST = dict(height=208, width=272, num_inference_steps=2, seed=1, output_type="uint8")
CONFIGS = ("mp", "ray, private", "ray, 2 nodes")


def measure(backend: str, requests: int) -> dict[str, float]:
    begun = time.perf_counter()
    omni = Omni(MODEL, ulysses_degree=2, distributed_executor_backend=backend)
    started = time.perf_counter() - begun
    try:
        omni.generate("a cat", **REQUEST)  # warm-up
        times = []
        for _ in range(requests):
            begun = time.perf_counter()
            omni.generate("a cat", **REQUEST)
            times.append(time.perf_counter() - begun)
    finally:
        begun = time.perf_counter()
        omni.close()
        stopped = time.perf_counter() - begun
    return {"start_s": started, "request_ms": statistics.median(times) * 1e3, "stop_s": stopped}


def run(config: str, requests: int) -> dict[str, float]:
    if config != "ray, 2 nodes":
        return measure(config.split(",")[0], requests)
    import ray
    from ray.cluster_utils import Cluster

    begun = time.perf_counter()
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "object_store_memory": 100 << 20})
    try:
        cluster.add_node(num_cpus=1, object_store_memory=100 << 20)
        ray.init(address=cluster.address, log_to_driver=False)
        cluster_s = time.perf_counter() - begun
        return {**measure("ray", requests), "cluster_start_s": cluster_s}
    finally:
        ray.shutdown()
        cluster.shutdown()


def table(result: dict) -> str:
    rows = result["configs"]
    base = rows["mp"]
    lines = [
        f"tiny/qwen-image, Ulysses 2, 208x272, 2 steps, CPU ({result['cpus']} cores, {result['machine']}), "
        f"Ray {result['ray']}; medians of {result['rounds']} starts, {result['requests']} requests each.",
        "",
        "| executor | start (s) | request (ms) | request vs mp | stop (s) |",
        "|---|---|---|---|---|",
    ]
    for name, row in rows.items():
        ratio = row["request_ms"] / base["request_ms"]
        lines.append(
            f"| {name} | {row['start_s']:.1f} | {row['request_ms']:.0f} | {ratio:.2f}x | {row['stop_s']:.1f} |"
        )
    if "cluster_start_s" in rows.get("ray, 2 nodes", {}):
        lines += [
            "",
            f"Starting the two simulated nodes took {rows['ray, 2 nodes']['cluster_start_s']:.1f} s (not in start).",
        ]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--requests", type=int, default=8)
    parser.add_argument("--no-docs", action="store_true", help="print the table, do not write docs/multinode.md")
    add_docs_phase(parser, docs=ROOT / "docs" / "multinode.md")
    args = parser.parse_args()
    out = ROOT / "benchmarks" / "results" / "executor_overhead.json"
    if args.phase == "docs":
        replace_section(args.docs, "executor_overhead", table(load_json(out)))
        return
    import ray

    samples: dict[str, list[dict[str, float]]] = {config: [] for config in CONFIGS}
    for _ in range(args.rounds):
        for config in CONFIGS:
            samples[config].append(run(config, args.requests))
            print(config, samples[config][-1], flush=True)
    result = {
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "ray": ray.__version__,
        "rounds": args.rounds,
        "requests": args.requests,
        "configs": {
            config: {key: statistics.median(s[key] for s in runs) for key in runs[0]}
            for config, runs in samples.items()
        },
        "samples": samples,
    }
    save_json(out, result, indent=2)
    print(table(result))
    if not args.no_docs:
        replace_section(args.docs, "executor_overhead", table(result))


if __name__ == "__main__":
    main()
