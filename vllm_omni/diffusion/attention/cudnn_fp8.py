"""cuDNN's FP8 attention (cuDNN graph API `sdpa_fp8`, package nvidia-cudnn-frontend), for the `cudnn_fp8`
backend's dense calls (backends.py); its masked and causal calls keep the exact masked/dense SDPA kernels.

Hopper's FP8 SDPA takes q, k, v in E4M3 with one descale each (per tensor; per-head or per-block scales are
Blackwell's MXFP8), quantizes the softmax probabilities with `scale_s` and writes O in E4M3 too (a bf16 O is
Blackwell-only). The scales, all computed on the GPU (no host sync, so CUDA graphs capture the call):
- q, k, v: 448 / amax, per batch row (the kernel runs once per row, so a request's result does not depend
  on what it is batched with), the amax agreed over the SP group (a max all-reduce): a Ulysses rank holds
  a slice of the heads, and the same scales as at U1 make trim at U2/U3 equal U1.
- the probabilities: `S_SCALE` maps [0, 1] onto E4M3's range (`attention(..., s_scale=)` tries others).
- O: 448 / (amax|V| * O_HEADROOM): a softmax row is a convex combination of V's rows, so |O| <= amax|V|,
  up to the probabilities' own rounding.
One cuDNN graph per (shape, device), built at the first call and cached; it runs on torch's current stream
with a workspace from torch's allocator.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch

from vllm_omni.diffusion.distributed.comm import all_reduce_max
from vllm_omni.diffusion.distributed.sequence_parallel import get_sp_context

E4M3_MAX = 448.0
S_SCALE = E4M3_MAX
O_HEADROOM = 1.0625  # each probability may round up by 2^-4, so |O| may pass amax|V| by as much


@dataclass
class FP8Inputs:
    """q, k, v in E4M3 ([B, L, H, D] each, contiguous) and their per-row scales."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    descale: torch.Tensor  # [4, B] float32: q, k, v, O (what the kernel multiplies by to undo each scale)
    scale_o: torch.Tensor  # [B] float32


def quantize_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> FP8Inputs:
    """E4M3 q, k, v with per-row scales 448 / amax, amax agreed over the SP group when one is active."""
    amax = torch.stack([t.abs().amax(dim=(1, 2, 3)) for t in (q, k, v)]).float()  # [3, B]
    ctx = get_sp_context()
    if ctx is not None and ctx.enabled and ctx.group is not None:
        all_reduce_max(amax, ctx.group)
    amax = amax.clamp_min(1e-12)  # an all-zero tensor quantizes to zeros, not NaN
    scale = E4M3_MAX / amax
    quantized = []
    for tensor, row_scale in zip((q, k, v), scale):
        out = torch.empty(tensor.shape, dtype=torch.float8_e4m3fn, device=tensor.device)
        # multiplied in float32 and rounded once to E4M3; |x| * 448 / amax <= 448 never saturates
        torch.mul(tensor, row_scale.view(-1, 1, 1, 1), out=out)
        quantized.append(out)
    scale_o = E4M3_MAX / (amax[2] * O_HEADROOM)
    descale = torch.cat([amax / E4M3_MAX, (1.0 / scale_o)[None]])
    return FP8Inputs(*quantized, descale=descale, scale_o=scale_o)


def dequantize_output(out: torch.Tensor, inputs: FP8Inputs, dtype: torch.dtype) -> torch.Tensor:
    """The E4M3 output [B, L, H, D] in `dtype`."""
    return (out.float() * inputs.descale[3].view(-1, 1, 1, 1)).to(dtype)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, s_scale: float = S_SCALE) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v through cuDNN's FP8 kernel; q [B, Lq, H, D], k, v [B, Lk, H, D] -> q's dtype."""
    inputs = quantize_inputs(q, k, v)
    batch, q_len, heads, _ = q.shape
    out = torch.empty(batch, q_len, heads, v.shape[-1], dtype=torch.float8_e4m3fn, device=q.device)
    constants = _constants(q.device, s_scale)
    for row in range(batch):
        _run_row(inputs, row, out, constants)
    return dequantize_output(out, inputs, q.dtype)


# ---- the cuDNN graph ---------------------------------------------------------------------------------------

_Q, _K, _V, _O, _DESCALE_Q, _DESCALE_K, _DESCALE_V, _DESCALE_S, _SCALE_S, _SCALE_O, _AMAX_S, _AMAX_O = range(1, 13)

_graphs: dict[tuple, tuple[Any, int]] = {}  # (shape, device) -> (built graph, workspace bytes)
_handles: dict[int, Any] = {}  # device index -> cudnn.Handle
_constant_cache: dict[tuple, dict[int, torch.Tensor]] = {}


def _constants(device: torch.device, s_scale: float) -> dict[int, torch.Tensor]:
    """The probabilities' scale and descale, and the amax outputs nobody reads, kept per device."""
    key = (device, s_scale)
    if key not in _constant_cache:
        # torch.full launches a fill kernel (no copy from the host), so a first call under graph capture is fine
        _constant_cache[key] = {
            _SCALE_S: torch.full((1,), s_scale, dtype=torch.float32, device=device),
            _DESCALE_S: torch.full((1,), 1.0 / s_scale, dtype=torch.float32, device=device),
            _AMAX_S: torch.zeros(1, dtype=torch.float32, device=device),
            _AMAX_O: torch.zeros(1, dtype=torch.float32, device=device),
        }
    return _constant_cache[key]


def _handle(device: torch.device) -> Any:
    import cudnn

    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _handles:
        with torch.cuda.device(index):
            _handles[index] = cudnn.create_handle()
    handle = _handles[index]
    cudnn.set_stream(handle=handle, stream=torch.cuda.current_stream(index).cuda_stream)  # no-op when unchanged
    return handle


def _graph(q_len: int, kv_len: int, heads: int, head_dim: int, v_dim: int, device: torch.device) -> tuple[Any, int]:
    """The built graph for one batch row in the [1, L, H, D] layout (BSHD strides) and its workspace size."""
    key = (q_len, kv_len, heads, head_dim, v_dim, device)
    if key in _graphs:
        return _graphs[key]
    import cudnn

    handle = _handle(device)
    graph = cudnn.pygraph(
        io_data_type=cudnn.data_type.FP8_E4M3,
        intermediate_data_type=cudnn.data_type.FLOAT,
        compute_data_type=cudnn.data_type.FLOAT,
        handle=handle,
    )

    def bshd(uid: int, length: int, dim: int) -> Any:  # logical [1, H, L, D] over memory [1, L, H, D]
        return graph.tensor(
            uid=uid,
            dim=(1, heads, length, dim),
            stride=(length * heads * dim, dim, heads * dim, 1),
            data_type=cudnn.data_type.FP8_E4M3,
        )

    def scalar(uid: int) -> Any:
        return graph.tensor(uid=uid, dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=cudnn.data_type.FLOAT)

    o, _, amax_s, amax_o = graph.sdpa_fp8(
        q=bshd(_Q, q_len, head_dim),
        k=bshd(_K, kv_len, head_dim),
        v=bshd(_V, kv_len, v_dim),
        descale_q=scalar(_DESCALE_Q),
        descale_k=scalar(_DESCALE_K),
        descale_v=scalar(_DESCALE_V),
        descale_s=scalar(_DESCALE_S),
        scale_s=scalar(_SCALE_S),
        scale_o=scalar(_SCALE_O),
        generate_stats=False,  # inference: no softmax statistics for a backward pass
        attn_scale=1.0 / math.sqrt(head_dim),
        use_causal_mask=False,
    )
    o.set_uid(_O).set_output(True).set_dim((1, heads, q_len, v_dim)).set_stride(
        (q_len * heads * v_dim, v_dim, heads * v_dim, 1)
    ).set_data_type(cudnn.data_type.FP8_E4M3)
    for uid, amax in ((_AMAX_S, amax_s), (_AMAX_O, amax_o)):
        amax.set_uid(uid).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(
            cudnn.data_type.FLOAT
        )
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    _graphs[key] = (graph, graph.get_workspace_size())
    return _graphs[key]


def _run_row(inputs: FP8Inputs, row: int, out: torch.Tensor, constants: dict[int, torch.Tensor]) -> None:
    """One batch row through the kernel, written into `out[row]` (E4M3)."""
    _, q_len, heads, head_dim = inputs.q.shape
    kv_len, v_dim = inputs.v.shape[1], inputs.v.shape[-1]
    graph, workspace_size = _graph(q_len, kv_len, heads, head_dim, v_dim, inputs.q.device)
    descale = inputs.descale[:, row : row + 1]  # one float each, on the GPU
    pack = {
        _Q: inputs.q[row : row + 1],  # [1, L, H, D]: the memory the graph's BSHD strides describe
        _K: inputs.k[row : row + 1],
        _V: inputs.v[row : row + 1],
        _O: out[row : row + 1],
        _DESCALE_Q: descale[0],
        _DESCALE_K: descale[1],
        _DESCALE_V: descale[2],
        _SCALE_O: inputs.scale_o[row : row + 1],
        **constants,
    }
    workspace = torch.empty(max(workspace_size, 1), dtype=torch.uint8, device=inputs.q.device)
    graph.execute(pack, workspace, handle=_handle(inputs.q.device))
