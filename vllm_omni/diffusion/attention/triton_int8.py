"""Low-precision attention with a bf16 output (Triton), for the `triton_int8` and `triton_int8_fp8pv` backends'
dense calls (backends.py); their masked and causal calls keep the exact SDPA kernels.

SageAttention's scheme (Zhang et al. 2024/2025), forward only:
- K smoothed: its mean over the call's tokens, per (row, head, channel), is subtracted first. Exact for
  softmax: q.(k - m) = q.k - q.m, and q.m is the same for every key of a query row.
- Q and K in INT8 with fp32 scales: per token for Q (absmax over head_dim), per block of `K_BLOCK` (128)
  tokens for K, each per batch row and head. QK^T accumulates in int32, exactly; the scores are scaled to
  fp32 and the softmax (online, in the log2 domain) runs in fp32.
- P and V (`pv`): `triton_int8` keeps them 16-bit (P in V's dtype, fp32 accumulation). `triton_int8_fp8pv`
  takes V to E4M3 with per-channel scales and P to E4M3 (scaled to [0, 448]). `triton_int8_int8pv` takes V
  to INT8 with per-channel scales and P to INT8 at the key tile's own maximum: round(p * 254) in [0, 254],
  stored minus 127 because Triton's 8-bit dot is signed; the offset comes back exactly in int32 as 127 times
  V's column sums, precomputed per 64 keys as V is quantised. The tile's maximum is the one the online
  softmax takes anyway; its product is scaled by exp2(tile max - running max) as it joins the accumulator.
  In both 8-bit forms each key tile's product is summed into the fp32 accumulator on its own (no long
  low-precision accumulation chain).
- O leaves the kernel in q's dtype (bf16): there is no FP8 output rounding.

Why INT8 and not E4M3 for Q and K: E4M3 keeps 3 mantissa bits, so each element carries about 2.6 %
relative rounding whatever the block scale, and the scores' error shows in the output one to one. On
Gaussian q, k, v (head_dim 128, a few thousand keys) E4M3 Q/K alone gives a relative L2 error near 0.038;
INT8 with these scales 0.012; FP8 P and V add about 0.037 more (0.039 together), INT8 P and V about 0.011
(0.016 together): P's largest terms, which dominate the product, keep 8 bits rather than 3. Tensor throughput
on Hopper is the same for INT8 and FP8. (`reference(..., qk_format="e4m3")` reproduces the E4M3 numbers.)

Every scale is per (batch row, head, token block) of the call's own tensors: a batch row's result does not
depend on its neighbours, and a Ulysses rank holding a slice of the heads over the whole (trimmed)
sequence computes exactly U1's values for them, with no collective. No host synchronisation: CUDA graphs
capture the call.

`reference()` is the same quantisation in torch (any device, fp32 arithmetic, the kernel's online softmax
tile by tile): the CPU tests' subject and the documentation of the numerics.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

try:  # the kernels need Triton; the reference and the module's constants do not
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU wheels of torch without triton
    triton = None

MEAN_CHUNK = 1024  # tokens summed by one program of K's mean (a fixed order: see k_mean)
K_BLOCK = 128  # tokens of K sharing one scale; the buffers' lengths are padded to a multiple of it
Q_BLOCK = 128  # Q's buffer padding (its scales are per token); BLOCK_M must divide it
INT8_MAX = 127.0
E4M3_MAX = 448.0
PV_FORMATS = ("16bit", "fp8", "int8")  # P.V in V's dtype, in E4M3, or in INT8
P_LEVELS = 254.0  # INT8 P: round(p * 254) in [0, 254], stored minus 127 (an int8)
# Lazy rescaling (KernelConfig.lazy, 16-bit P.V): the running maximum moves, and the accumulator with it, only
# where a row of the program's tile exceeds it by more than this (log2 units): P then stays below 2^8, which
# bf16 and fp16 hold with their usual relative precision (FlashAttention 4's conditional rescaling).
LAZY_LOG2 = 8.0
V_SUM_BLOCK = 64  # INT8 V's column sums are per this many keys (a key tile is one or two of them)
LOG2E = 1.4426950408889634
HEAD_DIMS = (64, 128)  # what the kernel is built for; other head dims take exact SDPA (backends.py)
DTYPES = (torch.bfloat16, torch.float16)
# 1.5 * 2^23: for |s| < 2^22, the float with bits (s + 0x4B400000) is MAGIC_F + s exactly; an integer add and
# a float subtract instead of a slow int32 -> fp32 conversion per score. |QK| <= 127^2 * 256 < 2^22.
MAGIC_I = 0x4B400000
MAGIC_F = 12582912.0


@dataclass(frozen=True)
class KernelConfig:
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    lazy: bool = False  # 16-bit P.V only: rescale the accumulator only where the maximum grew by > LAZY_LOG2


# By P.V format, the fastest of benchmarks/attention_fp8.py --sweep on an H100 (Triton 3.6) at its first case:
# 16-bit P.V fits two programs of 4 warps an SM; the 8-bit P.V formats (P's layout change, INT8's int32
# product besides the fp32 accumulator) take more registers a row: 64-row programs of 4 warps.
DEFAULT_CONFIG = {
    "16bit": KernelConfig(128, 64, 4, 3),
    "fp8": KernelConfig(64, 128, 4, 3),
    "int8": KernelConfig(64, 128, 4, 3),
}


def supported(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel runs this call (else the backend takes exact SDPA). Under Triton's interpreter
    (TRITON_INTERPRET=1, the CPU tests) CPU tensors run it too."""
    return (
        (q.is_cuda or _interpreting())
        and q.dtype in DTYPES
        and k.dtype == v.dtype == q.dtype
        and q.shape[-1] in HEAD_DIMS
        and k.shape[-1] == v.shape[-1] == q.shape[-1]
        and k.shape[1] > 0
    )


# ---- quantisation -------------------------------------------------------------------------------------------


@dataclass
class Quantized:
    """The kernel's inputs. Buffers are [B, H, L_pad, D] (K and Q, int8) and [B, H, D, Lk_pad] (V in E4M3 or
    INT8, transposed: K-major for the 8-bit MMA), padded with zeros; `v` is the caller's tensor when P.V is
    16-bit."""

    q: torch.Tensor  # int8 [B, H, Lq_pad, D]
    q_scale: torch.Tensor  # fp32 [B, H, Lq_pad]: amax / 127 * softmax scale * log2(e)
    k: torch.Tensor  # int8 [B, H, Lk_pad, D], smoothed
    k_scale: torch.Tensor  # fp32 [B, H, Lk_pad / K_BLOCK]: amax / 127
    v: torch.Tensor  # [B, Lk, H, D] as given (16-bit P.V), or E4M3 or int8 [B, H, D, Lk_pad]
    v_scale: torch.Tensor | None  # fp32 [B, H, D]: amax / 448 (E4M3 V) or amax / 127 (INT8 V)
    q_len: int
    k_len: int
    v_sum: torch.Tensor | None = None  # int32 [B, H, Lk_pad / V_SUM_BLOCK, D]: INT8 V's column sums


def _pad(length: int, block: int) -> int:
    return -(-length // block) * block


def _round_int8(x: torch.Tensor) -> torch.Tensor:
    """Round half away from zero into [-127, 127] (what the kernel's truncating conversion computes)."""
    x = x.clamp(-INT8_MAX, INT8_MAX)
    return torch.trunc(x + torch.where(x >= 0, 0.5, -0.5)).to(torch.int8)


def k_mean(k: torch.Tensor) -> torch.Tensor:
    """[B, H, D] fp32 mean of k [B, L, H, D] over its tokens. Where the kernels run (CUDA, or the interpreter),
    a Triton reduction whose order depends on (row, head) alone: a Ulysses rank's heads get U1's bits, and
    the reference and the kernel share them. Elsewhere torch's sum in fp32."""
    batch, length, heads, dim = k.shape
    if triton is None or not (k.is_cuda or _interpreting()) or dim not in HEAD_DIMS:
        return (k.sum(dim=1, dtype=torch.float32) / length).contiguous()
    k = k if k.stride(-1) == 1 else k.contiguous()
    chunks = -(-length // MEAN_CHUNK)
    partial = torch.empty(batch * heads, chunks, dim, dtype=torch.float32, device=k.device)
    _k_sum_kernel[(batch * heads, chunks)](
        k, partial, *k.stride()[:3], heads, length, HEAD_DIM=dim, CHUNK=MEAN_CHUNK, ROWS=64, num_warps=4
    )
    mean = torch.empty(batch, heads, dim, dtype=torch.float32, device=k.device)
    _k_mean_kernel[(batch * heads,)](partial, mean, chunks, length, HEAD_DIM=dim, num_warps=1)
    return mean


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def v_amax(v: torch.Tensor) -> torch.Tensor:
    """[B, H, D] fp32 absmax of v [B, L, H, D] over its tokens, at least a tiny positive number."""
    return torch.maximum(v.amax(dim=1), v.amin(dim=1).neg()).float().clamp_min(1e-30).contiguous()


def _check_pv(pv: str) -> None:
    if pv not in PV_FORMATS:
        raise ValueError(f"pv must be one of {PV_FORMATS}, got {pv!r}")


def quantize_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str = "16bit", qk_format: str = "int8"
) -> Quantized:
    """The kernel's quantisation in torch (any device): the same int8 values and fp32 scales
    (`qk_format="e4m3"`: Q and K in E4M3 with the same granularity instead, for comparison only)."""
    batch, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    q_pad, k_pad = _pad(q_len, Q_BLOCK), _pad(k_len, K_BLOCK)
    top = INT8_MAX if qk_format == "int8" else E4M3_MAX

    def cast(x: torch.Tensor, amax: torch.Tensor) -> torch.Tensor:
        y = x * (torch.full_like(amax, top) / amax)  # `top / amax` would be top * (1 / amax): not the kernel's

        return _round_int8(y) if qk_format == "int8" else y.to(torch.float8_e4m3fn)

    qf = F.pad(q.float().permute(0, 2, 1, 3), (0, 0, 0, q_pad - q_len))  # [B, H, Lq_pad, D]
    q_amax = qf.abs().amax(dim=-1).clamp_min(1e-30)
    q_i = cast(qf, q_amax[..., None])
    q_scale = q_amax / top * (1.0 / math.sqrt(dim) * LOG2E)

    kf = (k.float() - k_mean(k)[:, None]).permute(0, 2, 1, 3)
    kf = F.pad(kf, (0, 0, 0, k_pad - k_len)).view(batch, heads, k_pad // K_BLOCK, K_BLOCK, dim)
    k_amax = kf.abs().amax(dim=(-1, -2)).clamp_min(1e-30)  # [B, H, blocks]
    k_i = cast(kf, k_amax[..., None, None]).view(batch, heads, k_pad, dim)
    k_scale = k_amax / top

    _check_pv(pv)
    v_sum = None
    if pv == "16bit":
        v_q, v_scale = v, None
    else:
        amax = v_amax(v)
        top = E4M3_MAX if pv == "fp8" else INT8_MAX
        vt = v.float().permute(0, 2, 3, 1) * (torch.full_like(amax, top) / amax)[..., None]
        vt = vt.to(torch.float8_e4m3fn) if pv == "fp8" else _round_int8(vt)
        v_q, v_scale = F.pad(vt, (0, k_pad - k_len)), amax / top  # padding with zeros (E4M3's zero too)
        if pv == "int8":
            blocks = v_q.view(batch, heads, dim, k_pad // V_SUM_BLOCK, V_SUM_BLOCK)
            v_sum = blocks.sum(-1, dtype=torch.int32).transpose(-1, -2).contiguous()
    return Quantized(q_i, q_scale, k_i, k_scale, v_q, v_scale, q_len, k_len, v_sum)


def quantize(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pv: str = "16bit") -> Quantized:
    """`quantize_reference`'s result through the Triton kernels (one read of q, k and v each, plus the
    mean of K and, for 8-bit V, its absmax as torch reductions)."""
    _check_pv(pv)
    batch, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    q_pad, k_pad = _pad(q_len, Q_BLOCK), _pad(k_len, K_BLOCK)
    dev = q.device
    q_i = torch.empty(batch, heads, q_pad, dim, dtype=torch.int8, device=dev)
    q_scale = torch.empty(batch, heads, q_pad, dtype=torch.float32, device=dev)
    sm = 1.0 / math.sqrt(dim) * LOG2E
    _quant_q_kernel[(q_pad // 64, batch * heads)](
        q, q_i, q_scale, *q.stride()[:3], heads, q_len, q_pad, sm, HEAD_DIM=dim, ROWS=64, num_warps=4
    )
    k_i = torch.empty(batch, heads, k_pad, dim, dtype=torch.int8, device=dev)
    k_scale = torch.empty(batch, heads, k_pad // K_BLOCK, dtype=torch.float32, device=dev)
    _quant_k_kernel[(k_pad // K_BLOCK, batch * heads)](
        k, k_mean(k), k_i, k_scale, *k.stride()[:3], heads, k_len, k_pad, HEAD_DIM=dim, ROWS=K_BLOCK, num_warps=8
    )
    v_sum = None
    if pv == "16bit":
        v_q, v_scale = v, None
    else:
        amax = v_amax(v)
        int8 = pv == "int8"
        v_q = torch.empty(batch, heads, dim, k_pad, dtype=torch.int8 if int8 else torch.float8_e4m3fn, device=dev)
        if int8:
            v_sum = torch.empty(batch, heads, k_pad // V_SUM_BLOCK, dim, dtype=torch.int32, device=dev)
        _quant_v_kernel[(k_pad // V_SUM_BLOCK, batch * heads)](
            v, amax, v_q, v_sum if int8 else amax, *v.stride()[:3], heads, k_len, k_pad,
            HEAD_DIM=dim, ROWS=V_SUM_BLOCK, INT8=int8, num_warps=4,
        )  # fmt: skip
        v_scale = amax / (INT8_MAX if int8 else E4M3_MAX)
    return Quantized(q_i, q_scale, k_i, k_scale, v_q, v_scale, q_len, k_len, v_sum)


# ---- the reference ------------------------------------------------------------------------------------------


def reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pv: str = "16bit",
    block_n: int = 128,
    qk_format: str = "int8",
    quantized: Quantized | None = None,
    lazy_block_m: int | None = None,
) -> torch.Tensor:
    """The kernel's numerics in torch: q [B, Lq, H, D], k, v [B, Lk, H, D] -> [B, Lq, H, D] in q's dtype.

    Scores from the quantised Q and K, then the online softmax over key tiles of `block_n` in fp32 (log2
    domain), P rounded to V's dtype (or to E4M3 scaled to [0, 448], with E4M3 V; or to round(p * 254) at the
    tile's own maximum, with INT8 V) for each tile's P.V. `lazy_block_m` (16-bit P.V): the lazy rescaling of
    programs of that many query rows (KernelConfig.lazy)."""
    if lazy_block_m is not None and pv != "16bit":
        raise ValueError("lazy rescaling is for 16-bit P.V")
    x = quantized if quantized is not None else quantize_reference(q, k, v, pv, qk_format)
    batch, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    qf = x.q[:, :, :q_len].float() * x.q_scale[:, :, :q_len, None]  # [B, H, Lq, D]: scores in log2 units
    kf = x.k.float().view(batch, heads, -1, K_BLOCK, dim) * x.k_scale[..., None, None]
    kf = kf.view(batch, heads, -1, dim)[:, :, :k_len]
    if pv == "16bit":
        vf = v.permute(0, 2, 1, 3)
    else:
        vf = x.v.float().transpose(-1, -2)[:, :, :k_len]  # [B, H, Lk, D], still scaled by 448 or 127 / amax
    m = torch.full((batch, heads, q_len, 1), float("-inf"), device=q.device)
    denom = torch.zeros_like(m)
    acc = torch.zeros(batch, heads, q_len, dim, device=q.device)
    for start in range(0, k_len, block_n):
        s = qf @ kf[:, :, start : start + block_n].transpose(-1, -2)
        tile_max = s.amax(-1, keepdim=True)
        m_new = torch.maximum(m, tile_max)
        if lazy_block_m is not None:  # a program's rows move together, and only past LAZY_LOG2
            rows = -(-q_len // lazy_block_m) * lazy_block_m
            grown = F.pad(tile_max - m, (0, 0, 0, rows - q_len), value=float("-inf"))
            grown = grown.view(batch, heads, -1, lazy_block_m).amax(-1) > LAZY_LOG2
            m_new = torch.where(grown.repeat_interleave(lazy_block_m, 2)[:, :, :q_len, None], m_new, m)
        alpha = torch.exp2(m - m_new)
        tile = vf[:, :, start : start + block_n]
        if pv == "int8":  # P at the tile's own maximum, its product scaled to the running one
            p = torch.exp2(s - tile_max)
            beta = torch.exp2(tile_max - m_new)
            denom = denom * alpha + beta * p.sum(-1, keepdim=True)
            acc = acc * alpha + beta * (torch.round(p * P_LEVELS) @ tile) / P_LEVELS  # half to even, as the kernel
        else:
            p = torch.exp2(s - m_new)
            denom = denom * alpha + p.sum(-1, keepdim=True)
            if pv == "fp8":
                p_q = (p * E4M3_MAX).to(torch.float8_e4m3fn).float() / E4M3_MAX
                acc = acc * alpha + p_q @ tile
            else:
                acc = acc * alpha + p.to(v.dtype).float() @ tile.float()
        m = m_new
    out = acc / denom
    if pv != "16bit":
        out = out * x.v_scale[:, :, None, :]
    return out.permute(0, 2, 1, 3).to(q.dtype)


# ---- the Triton kernels -------------------------------------------------------------------------------------


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    pv: str = "16bit",
    config: KernelConfig | None = None,
    quantized: Quantized | None = None,
) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v: q [B, Lq, H, D], k, v [B, Lk, H, D] (last dim contiguous) -> [B, Lq, H, D]
    in q's dtype. `quantized`: inputs already through `quantize` (the benchmark times the kernel alone)."""
    if triton is None:
        raise RuntimeError("the triton_int8 attention backends need Triton (pip install triton)")
    if not supported(q, k, v):
        raise ValueError(
            f"triton_int8 attention runs CUDA {[str(d) for d in DTYPES]} tensors of head_dim {HEAD_DIMS}; got "
            f"{q.dtype} {tuple(q.shape)} on {q.device}"
        )
    _check_pv(pv)
    cfg = config or DEFAULT_CONFIG[pv]
    if Q_BLOCK % cfg.block_m or K_BLOCK % cfg.block_n or (pv == "int8" and cfg.block_n % V_SUM_BLOCK):
        raise ValueError(f"block_m must divide {Q_BLOCK} and block_n {K_BLOCK} (INT8 P.V: a multiple of 64): {cfg}")
    if cfg.lazy and pv != "16bit":
        raise ValueError(f"lazy rescaling is for 16-bit P.V: {cfg}")
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    x = quantized if quantized is not None else quantize(q, k, v, pv)
    batch, q_len, heads, dim = q.shape
    out = torch.empty(batch, q_len, heads, dim, dtype=q.dtype, device=q.device)
    if pv == "16bit":
        v_scale, v_strides = x.q_scale, x.v.stride()[:3]  # v_scale unused: any fp32 pointer
    else:
        v_scale, v_strides = x.v_scale, (0, 0, 0)
    v_sum = x.v_sum if x.v_sum is not None else x.q_scale  # unused but for INT8 P.V
    grid = (triton.cdiv(q_len, cfg.block_m), batch * heads)
    _attn_kernel[grid](
        x.q,
        x.q_scale,
        x.k,
        x.k_scale,
        x.v,
        v_scale,
        v_sum,
        out,
        *v_strides,
        *out.stride()[:3],
        heads,
        q_len,
        x.k_len,
        x.q.shape[2],
        x.k.shape[2],
        **kernel_constants(cfg, pv, dim),
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
    )
    return out


def kernel_constants(cfg: KernelConfig, pv: str, head_dim: int) -> dict[str, int | bool]:
    """`_attn_kernel`'s compile-time arguments (also what benchmarks/kernel_sass.py compiles it with)."""
    return dict(HEAD_DIM=head_dim, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, KB=K_BLOCK, PV=PV_FORMATS.index(pv),
                VSB=V_SUM_BLOCK, LAZY=cfg.lazy)  # fmt: skip


if triton is not None:

    @triton.jit
    def _round_to_int8(y):
        """Round half away from zero, y already within [-127, 127]."""
        return (y + tl.where(y >= 0, 0.5, -0.5)).to(tl.int8)

    @triton.jit
    def _k_sum_kernel(X, PARTIAL, stride_b, stride_l, stride_h, H, L, HEAD_DIM: tl.constexpr, CHUNK: tl.constexpr,
                      ROWS: tl.constexpr):  # fmt: skip
        """fp32 sum of one (row, head)'s tokens [c * CHUNK, (c + 1) * CHUNK), in a fixed order."""
        bh, c = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        cols = tl.arange(0, HEAD_DIM)
        rows = tl.arange(0, ROWS)
        src = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + cols[None, :]
        acc = tl.zeros([ROWS, HEAD_DIM], dtype=tl.float32)
        for start in range(c * CHUNK, tl.minimum(c * CHUNK + CHUNK, L), ROWS):
            r = start + rows
            acc += tl.load(src + r[:, None].to(tl.int64) * stride_l, mask=r[:, None] < L, other=0.0).to(tl.float32)
        tl.store(PARTIAL + (bh.to(tl.int64) * tl.num_programs(1) + c) * HEAD_DIM + cols, tl.sum(acc, axis=0))

    @triton.jit
    def _k_mean_kernel(PARTIAL, MEAN, CHUNKS, L, HEAD_DIM: tl.constexpr):
        """The chunks' sums added in order, over L."""
        bh = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, HEAD_DIM)
        acc = tl.zeros([HEAD_DIM], dtype=tl.float32)
        for c in range(0, CHUNKS):
            acc += tl.load(PARTIAL + (bh * CHUNKS + c) * HEAD_DIM + cols)
        tl.store(MEAN + bh * HEAD_DIM + cols, acc / L)

    @triton.jit
    def _quant_q_kernel(
        X, XQ, XS, stride_b, stride_l, stride_h, H, L, L_pad, sm_scale_log2, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr
    ):
        """Per token: int8 = round(x * 127 / amax); scale = amax / 127 * sm_scale * log2(e). Rows past L: 0."""
        pid, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, HEAD_DIM)
        src = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_l
        x = tl.load(src + cols[None, :], mask=rows[:, None] < L, other=0.0).to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
        y = x * tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax)[:, None]
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        base = bh.to(tl.int64) * L_pad
        tl.store(XQ + (base + rows[:, None]) * HEAD_DIM + cols[None, :], _round_to_int8(y))
        tl.store(XS + base + rows, amax / 127.0 * sm_scale_log2)

    @triton.jit
    def _quant_k_kernel(
        X, MEAN, XQ, XS, stride_b, stride_l, stride_h, H, L, L_pad, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr
    ):
        """Per block of ROWS tokens: (x - mean) in int8 with one scale amax / 127. Rows past L: 0."""
        pid, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, HEAD_DIM)
        src = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_l
        valid = rows[:, None] < L
        x = tl.load(src + cols[None, :], mask=valid, other=0.0).to(tl.float32)
        mean = tl.load(MEAN + bh.to(tl.int64) * HEAD_DIM + cols)
        x = tl.where(valid, x - mean[None, :], 0.0)
        amax = tl.maximum(tl.max(tl.max(tl.abs(x), axis=1), axis=0), 1e-30)
        y = x * tl.math.div_rn(127.0, amax)
        y = tl.minimum(tl.maximum(y, -127.0), 127.0)
        base = bh.to(tl.int64) * L_pad
        tl.store(XQ + (base + rows[:, None]) * HEAD_DIM + cols[None, :], _round_to_int8(y))
        tl.store(XS + bh.to(tl.int64) * (L_pad // ROWS) + pid, amax / 127.0)

    @triton.jit
    def _quant_v_kernel(
        X, AMAX, XQ, VSUM, stride_b, stride_l, stride_h, H, L, L_pad, HEAD_DIM: tl.constexpr, ROWS: tl.constexpr,
        INT8: tl.constexpr,
    ):  # fmt: skip
        """Per channel: E4M3 of x * 448 / amax, or INT8 of x * 127 / amax with the block's column sums (int32,
        [B, H, L_pad / ROWS, D]), written transposed ([B, H, D, L_pad]). Columns past L: 0."""
        pid, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        rows = pid * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, HEAD_DIM)
        src = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h + rows[:, None].to(tl.int64) * stride_l
        x = tl.load(src + cols[None, :], mask=rows[:, None] < L, other=0.0).to(tl.float32)
        amax = tl.load(AMAX + bh.to(tl.int64) * HEAD_DIM + cols)
        if INT8:
            y = x * tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32), amax)[None, :]
            y = _round_to_int8(tl.minimum(tl.maximum(y, -127.0), 127.0))
            tl.store(VSUM + (bh.to(tl.int64) * tl.num_programs(0) + pid) * HEAD_DIM + cols, tl.sum(y.to(tl.int32), 0))
        else:
            y = (x * tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)[None, :]).to(tl.float8e4nv)
        dst = XQ + bh.to(tl.int64) * HEAD_DIM * L_pad + cols[None, :].to(tl.int64) * L_pad + rows[:, None]
        tl.store(dst, y)

    @triton.jit
    def _scores(q, K, start_n, offs_n, offs_d, HEAD_DIM: tl.constexpr):
        """int32 Q.K^T of one key tile (K int8 [Lk_pad, D], padded: no mask)."""
        k = tl.load(K + (start_n + offs_n)[:, None] * HEAD_DIM + offs_d[None, :])
        return tl.dot(q, tl.trans(k), out_dtype=tl.int32)

    @triton.jit
    def _softmax_pv(
        acc,
        l_i,
        m_i,
        s,
        row_scale,
        KS,
        V,
        VSUM,
        start_n,
        offs_n,
        offs_d,
        v_base,
        stride_vl,
        Lk,
        Lk_pad,
        HEAD_DIM: tl.constexpr,
        BLOCK_N: tl.constexpr,
        KB: tl.constexpr,
        PV: tl.constexpr,
        VSB: tl.constexpr,
        MASK: tl.constexpr,
        LAZY: tl.constexpr,
    ):
        """One key tile of the online softmax from its int32 scores; in log2 units they are s * q_scale * k_scale.
        PV: 0 16-bit P.V, 1 E4M3, 2 INT8 (PV_FORMATS)."""
        row = row_scale * tl.load(KS + start_n // KB)  # [BLOCK_M]
        sf = (s + 0x4B400000).to(tl.float32, bitcast=True)  # 1.5 * 2^23 + s, exactly
        if MASK:
            sf = tl.where((start_n + offs_n)[None, :] < Lk, sf, float("-inf"))
        tile_max = (tl.max(sf, axis=1) - 12582912.0) * row
        if LAZY:  # the maximum, and the accumulator with it, move only where a row grew past LAZY_LOG2
            m_new = m_i
            if tl.max(tile_max - m_i, axis=0) > 8.0:  # LAZY_LOG2 (a literal: Triton reads no module float)
                m_new = tl.maximum(m_i, tile_max)
                alpha = tl.math.exp2(m_i - m_new)
                acc = acc * alpha[:, None]
                l_i = l_i * alpha
            # (alpha: unused without RESCALE)
            acc, l_i = _pv_at_running_max(acc, l_i, l_i, sf, row, m_new, V, start_n, offs_n, offs_d, v_base,
                                          stride_vl, Lk, Lk_pad, PV, MASK, False)  # fmt: skip
            return acc, l_i, m_new
        m_new = tl.maximum(m_i, tile_max)
        alpha = tl.math.exp2(m_i - m_new)
        if PV == 2:
            acc, l_i = _pv_int8(acc, l_i, alpha, sf, row, tile_max, m_new, V, VSUM, start_n, offs_n, offs_d, Lk_pad,
                                HEAD_DIM, BLOCK_N, VSB)  # fmt: skip
        else:
            acc, l_i = _pv_at_running_max(acc, l_i, alpha, sf, row, m_new, V, start_n, offs_n, offs_d, v_base,
                                          stride_vl, Lk, Lk_pad, PV, MASK, True)  # fmt: skip
        return acc, l_i, m_new

    @triton.jit
    def _pv_int8(acc, l_i, alpha, sf, row, tile_max, m_new, V, VSUM, start_n, offs_n, offs_d, Lk_pad,
                 HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, VSB: tl.constexpr):  # fmt: skip
        """P at the tile's own maximum in [0, 254] (log2(254)) as round(p) - 127 (Triton's 8-bit dot is signed),
        INT8 V; the offset back from V's column sums, and the product joins at exp2(tile max - running max).
        No float <-> int conversion instruction (they run at an eighth of the FMA rate): both go through the
        bits of floats in [2^23, 2^24), whose mantissa holds the integer."""
        p = tl.math.exp2(sf * row[:, None] - (12582912.0 * row + tile_max - 7.988684686772166)[:, None])
        beta = tl.math.exp2(tile_max - m_new)
        l_i = l_i * alpha + beta * tl.sum(p, axis=1)
        # p + (1.5 * 2^23 - 127) rounds to an integer float whose low byte is round(p) - 127 (two's complement)
        centred = (p + 12582785.0).to(tl.int32, bitcast=True).to(tl.int8)
        vt = tl.load(V + (start_n + offs_n)[None, :] + offs_d[:, None] * Lk_pad)  # int8 [D, BLOCK_N]
        prod = tl.dot(centred, tl.trans(vt), out_dtype=tl.int32)
        blocks = start_n // VSB + tl.arange(0, BLOCK_N // VSB)
        offset = 0x4B400000 + 127 * tl.sum(tl.load(VSUM + blocks[:, None] * HEAD_DIM + offs_d[None, :]), axis=0)
        # |prod + 127 * column sum| <= 254 * 127 * 128 < 2^22: the scores' exact conversion, the offset with it;
        # bits * beta + (acc * alpha - 1.5 * 2^23 * beta): two FMAs
        bits = (prod + offset[None, :]).to(tl.float32, bitcast=True)
        return tl.fma(bits, beta[:, None], tl.fma(acc, alpha[:, None], (-12582912.0 * beta)[:, None])), l_i

    @triton.jit
    def _pv_at_running_max(acc, l_i, alpha, sf, row, m_new, V, start_n, offs_n, offs_d, v_base, stride_vl, Lk, Lk_pad,
                           PV: tl.constexpr, MASK: tl.constexpr, RESCALE: tl.constexpr):  # fmt: skip
        """P at the running maximum: in V's dtype (PV 0) or E4M3 scaled to [0, 448] (PV 1). RESCALE: the
        accumulator and l_i by alpha first (not under lazy rescaling, which did it already where needed)."""
        shift = 12582912.0 * row + m_new
        if PV == 1:
            shift -= 8.807354922057604  # log2(448): P in [0, 448], and l_i with it (the factor cancels)
        p = tl.math.exp2(sf * row[:, None] - shift[:, None])
        if RESCALE:
            l_i = l_i * alpha
        l_i += tl.sum(p, axis=1)
        if PV == 1:
            vt = tl.load(V + (start_n + offs_n)[None, :] + offs_d[:, None] * Lk_pad)  # E4M3 [D, BLOCK_N]
            # this tile's product summed into fp32 on its own: Hopper's FP8 MMA accumulates imprecisely
            acc = acc * alpha[:, None] + tl.dot(p.to(tl.float8e4nv), tl.trans(vt))
        else:
            v_ptrs = V + v_base + (start_n + offs_n)[:, None].to(tl.int64) * stride_vl + offs_d[None, :]
            if MASK:
                v = tl.load(v_ptrs, mask=(start_n + offs_n)[:, None] < Lk, other=0.0)
            else:
                v = tl.load(v_ptrs)
            if RESCALE:
                acc = acc * alpha[:, None]
            acc = tl.dot(p.to(v.dtype), v, acc)
        return acc, l_i

    @triton.jit
    def _attn_kernel(
        Q,
        QS,
        K,
        KS,
        V,
        VS,
        VSUM,
        Out,
        stride_vb,
        stride_vl,
        stride_vh,
        stride_ob,
        stride_ol,
        stride_oh,
        H,
        Lq,
        Lk,
        Lq_pad,
        Lk_pad,
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        KB: tl.constexpr,
        PV: tl.constexpr,
        VSB: tl.constexpr,
        LAZY: tl.constexpr,
    ):
        pid_m, bh = tl.program_id(0), tl.program_id(1)
        b, h = bh // H, bh % H
        bh64 = bh.to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        q = tl.load(Q + (bh64 * Lq_pad + offs_m[:, None]) * HEAD_DIM + offs_d[None, :])  # padded: no mask
        row_scale = tl.load(QS + bh64 * Lq_pad + offs_m)
        K = K + bh64 * Lk_pad * HEAD_DIM
        KS = KS + bh64 * (Lk_pad // KB)
        VSUM = VSUM + bh64 * (Lk_pad // VSB) * HEAD_DIM
        if PV == 0:
            v_base = b.to(tl.int64) * stride_vb + h.to(tl.int64) * stride_vh
        else:
            V = V + bh64 * HEAD_DIM * Lk_pad
            v_base = 0
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        full = (Lk // BLOCK_N) * BLOCK_N
        for start_n in range(0, full, BLOCK_N):
            s = _scores(q, K, start_n, offs_n, offs_d, HEAD_DIM)
            acc, l_i, m_i = _softmax_pv(
                acc, l_i, m_i, s, row_scale, KS, V, VSUM, start_n, offs_n, offs_d, v_base, stride_vl, Lk, Lk_pad,
                HEAD_DIM, BLOCK_N, KB, PV, VSB, False, LAZY,
            )  # fmt: skip
        if full < Lk:
            s = _scores(q, K, full, offs_n, offs_d, HEAD_DIM)
            acc, l_i, m_i = _softmax_pv(
                acc, l_i, m_i, s, row_scale, KS, V, VSUM, full, offs_n, offs_d, v_base, stride_vl, Lk, Lk_pad,
                HEAD_DIM, BLOCK_N, KB, PV, VSB, True, LAZY,
            )  # fmt: skip
        out = acc / l_i[:, None]
        if PV != 0:
            out = out * tl.load(VS + bh64 * HEAD_DIM + offs_d)[None, :]
        o_ptrs = Out + b.to(tl.int64) * stride_ob + h.to(tl.int64) * stride_oh
        o_ptrs += offs_m[:, None].to(tl.int64) * stride_ol + offs_d[None, :]
        tl.store(o_ptrs, out.to(Out.dtype.element_ty), mask=offs_m[:, None] < Lq)
