"""How the executor words a request's failure for its client: what ran out of memory, where, and what helps.
The group's lifecycle (base.py) and the requests in flight (flights.py) both raise these; one wording for both.
"""

from __future__ import annotations

from vllm_omni.diffusion.protocol import Failed
from vllm_omni.diffusion.request import DiffusionRequest, RequestOutOfMemory

_PHASE_WORDS = {"encode": "encoding the prompt", "denoise": "denoising", "decode": "decoding"}


def out_of_memory_error(request: DiffusionRequest, failed: Failed, restarting: bool) -> RequestOutOfMemory:
    """The error of a request that ran out of memory on `failed.rank`: its size, where, and what helps."""
    rows = request.rows
    size = f"{request.width}x{request.height}" if request.width else "the default size"
    if request.num_frames:
        size += f", {request.num_frames} frames"
    size += f", n={request.num_images}"
    if len(rows) > 1:
        size += f", batched with {len(rows) - 1} other request(s)"
    # torch's first sentences (what it tried to allocate); the rest is in the worker's log.
    detail = (str(failed.error).splitlines() or [""])[0].split(". GPU ")[0].rstrip(".")
    after = "the workers are restarting" if restarting else "the server freed its memory and serves on"
    return RequestOutOfMemory(
        f"request {request.request_id} ({size}) ran out of memory on rank {failed.rank} while "
        f"{_PHASE_WORDS.get(failed.out_of_memory, 'running')}: {detail}; {after}. What helps: a smaller size, fewer "
        "frames or images (n); on the server, FP8 (--quantization fp8), a higher --ulysses-degree, or a GPU "
        "with more free memory"
    )
