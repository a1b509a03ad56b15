"""Where model offload's time goes (issue 44): moving a denoiser's weights between the GPU and the CPU.

accelerate's model offload (diffusers' `enable_model_cpu_offload`) moves a component back with `module.to("cpu")`,
which copies every weight into newly allocated pageable host memory; the next component's `module.to("cuda")`
copies from pageable memory. Measured side by side on one GPU with a module of random bf16 weights (`--gib`):
that `.to("cpu")`, the same copy into pinned buffers allocated once, the pageable and pinned host-to-device
copies, and, for a weight that does not change, keeping the pinned copy and dropping the device one (no copy).

    python3 benchmarks/offload_copies.py --gib 16 --out $OUT/offload_copies.json
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    layers = int(args.gib * 2**30 / (2 * 3072 * 12288))  # 3072 x 12288 bf16 matrices, an MLP's size
    module = torch.nn.ModuleList(torch.nn.Linear(3072, 12288, bias=False, dtype=torch.bfloat16) for _ in range(layers))
    module.to("cuda")
    nbytes = sum(p.numel() * p.element_size() for p in module.parameters())
    pinned = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in module.parameters()]
    rows = {}
    rows["to_cpu_pageable_s"] = timed(lambda: module.to("cpu"))  # accelerate's offload
    rows["to_cuda_from_pageable_s"] = timed(lambda: module.to("cuda"))  # accelerate's onload
    rows["copy_to_pinned_s"] = timed(
        lambda: [d.copy_(p.data, non_blocking=True) for d, p in zip(pinned, module.parameters())]
    )

    def onload_pinned() -> None:
        for d, p in zip(pinned, module.parameters()):
            p.data = d.to("cuda", non_blocking=True)

    def drop_device_copy() -> None:
        for d, p in zip(pinned, module.parameters()):
            p.data = d  # the weights did not change: the pinned copy is still theirs

    rows["drop_device_copy_s"] = timed(drop_device_copy)
    rows["to_cuda_from_pinned_s"] = timed(onload_pinned)
    result = {"card": torch.cuda.get_device_name(0), "gib": round(nbytes / 2**30, 2)}
    result.update({k: round(v, 3) for k, v in rows.items()})
    for key in ("to_cpu_pageable_s", "to_cuda_from_pageable_s", "copy_to_pinned_s", "to_cuda_from_pinned_s"):
        result[key.replace("_s", "_gb_per_s")] = round(nbytes / 1e9 / max(rows[key], 1e-9), 2)
    print(json.dumps(result, indent=1))
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
