"""Attention kernels, chosen by name. The parallel strategy (layer.py) never calls torch directly.

A backend takes q [B, Lq, H, D] and k, v [B, Lk, H, D] and returns [B, Lq, H, D].
Names: ``sdpa`` (dense, cannot mask), ``sdpa_masked`` (takes an additive key mask), and the lossy
low-precision kernels for Hopper or newer, whose masked and causal calls run the exact SDPA kernels:
``cudnn_fp8`` (cuDNN's FP8 attention, FP8 output: attention/cudnn_fp8.py), ``triton_int8`` (INT8 Q.K
with per-block scales, 16-bit P.V, bf16 output: attention/triton_int8.py), ``triton_int8_fp8pv`` (the
same with P and V in FP8 too) and ``triton_int8_int8pv`` (P and V in INT8 instead). ``flash_attn_4`` is exact:
FlashAttention 4's CuTe kernels (the flash-attn-4 package) for dense calls on Hopper or newer. Selection: an
explicit name (config / ``--attention-backend``), else the ``VLLM_OMNI_ATTENTION_BACKEND`` environment variable, else
``sdpa_masked`` when a mask is needed and, for dense calls, the automatic exact kernel: ``flash_attn_4`` on a Hopper
GPU where flash-attn-4 is installed and the forward replays CUDA graphs, else ``sdpa`` (`automatic_dense_backend`).
A varlen backend is left out on purpose: on an H200, torch's unpad -> varlen -> re-pad measured slower than masked
SDPA.

Ring attention merges partial results through each block's log-sum-exp: `AttentionBackend.with_lse`
returns it beside the output (`attention_with_lse`: torch's flash kernel on CUDA for a dense half-precision
call, its memory-efficient kernel for a masked or fp32 one, a plain math path elsewhere, in fp32). A lossy
backend's `with_lse` is the exact kernel: cuDNN's FP8 call returns no log-sum-exp here.

A lossy (``low_precision``) backend follows the per-step precision rule: the runner reports each
denoising step (`set_denoising_step`), and the first and last ``fp8_attention_full_steps`` steps run
the exact kernel. The rule reads only (step, total steps), which every rank knows alike.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from vllm_omni import envs
from vllm_omni.logger import init_logger

logger = init_logger(__name__)
ENV_VAR = envs.ATTENTION_BACKEND


@dataclass(frozen=True)
class AttentionBackend:
    name: str
    supports_mask: bool
    low_precision: bool = False  # lossy: the per-step rule gives its full-precision steps to exact SDPA
    requires: tuple[str, str] | None = None  # (module, pip distribution) it imports when called
    min_capability: tuple[int, int] | None = None  # the CUDA compute capability it needs
    install: str | None = None  # how to install `requires` (None: the fp8 extra)

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        key_mask: torch.Tensor | None = None,
        causal: bool = False,
    ) -> torch.Tensor:
        """`causal`: query i sees keys [0, i] (no mask tensor: every dense kernel has it)."""
        if key_mask is not None and not self.supports_mask:
            raise ValueError(f"attention backend {self.name!r} cannot apply a mask")
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=key_mask, is_causal=causal
        )
        return out.transpose(1, 2)

    def with_lse(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The output [B, Lq, H, D] and its log-sum-exp [B, H, Lq] (fp32), for ring attention's merge."""
        if key_mask is not None and not self.supports_mask:
            raise ValueError(f"attention backend {self.name!r} cannot apply a mask")
        return attention_with_lse(q, k, v, key_mask)


def attention_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key_mask: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact attention of q [B, Lq, H, D] over k, v [B, Lk, H, D] (optional additive `key_mask`, broadcast to
    [B, H, Lq, Lk]): the output [B, Lq, H, D] in q's dtype and the log-sum-exp of each query's scores [B, H, Lq] in
    fp32 (-inf for a query the mask hides every key from; its output is then 0)."""
    qt, kt, vt = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    batch, heads, length, head_dim = qt.shape
    if q.device.type == "cuda":
        half = q.dtype in (torch.float16, torch.bfloat16)
        if key_mask is None and half and head_dim <= 256 and head_dim % 8 == 0:
            out, lse = torch.ops.aten._scaled_dot_product_flash_attention(qt, kt, vt)[:2]
            return out.transpose(1, 2), lse
        bias = None
        if key_mask is not None:  # the kernel reads the bias in rows aligned to 16 elements, as SDPA pads it
            keys = kt.shape[2]
            aligned = key_mask.new_empty(*key_mask.shape[:-1], -(-keys // 16) * 16, dtype=q.dtype)
            aligned[..., :keys] = key_mask
            bias = aligned[..., :keys].expand(batch, heads, length, keys)
        out, lse = torch.ops.aten._scaled_dot_product_efficient_attention(qt, kt, vt, bias, True)[:2]
        lse = lse[..., :length]  # padded to the kernel's tile of queries
    else:
        scores = torch.matmul(qt.float(), kt.float().transpose(-1, -2)) * head_dim**-0.5
        if key_mask is not None:
            scores = scores + key_mask.float()
        lse = torch.logsumexp(scores, dim=-1)
        probs = torch.exp(scores - lse.masked_fill(torch.isneginf(lse), 0)[..., None])
        out = torch.matmul(probs, vt.float()).to(q.dtype)
    if key_mask is not None:
        # A row whose every key is masked: read from the mask, not the kernel (the memory-efficient one gives it
        # lse 0 on an H100), so every kernel's merge skips it alike.
        empty = torch.isneginf(key_mask).all(dim=-1, keepdim=True)
        lse, out = lse.masked_fill(empty[..., 0], float("-inf")), out.masked_fill(empty, 0)
    return out.transpose(1, 2), lse


@dataclass(frozen=True)
class CudnnFP8Backend(AttentionBackend):
    """cuDNN's FP8 SDPA for dense calls; a masked or causal call takes the exact SDPA kernel."""

    def __call__(self, q, k, v, key_mask=None, causal=False):
        if key_mask is not None or causal:
            return super().__call__(q, k, v, key_mask, causal)
        from vllm_omni.diffusion.attention import cudnn_fp8  # imports cudnn: only once this backend runs

        return cudnn_fp8.attention(q, k, v)


@dataclass(frozen=True)
class TritonInt8Backend(AttentionBackend):
    """attention/triton_int8.py's kernel for dense calls of a head dim it is built for; a masked or causal
    call, or another head dim or dtype, takes the exact SDPA kernel."""

    pv: str = "16bit"  # P.V's format (triton_int8.PV_FORMATS): 16-bit, or FP8 or INT8 (faster, lossier)

    def __call__(self, q, k, v, key_mask=None, causal=False):
        if key_mask is not None or causal:
            return super().__call__(q, k, v, key_mask, causal)
        from vllm_omni.diffusion.attention import triton_int8  # imports triton: only once this backend runs

        if not triton_int8.supported(q, k, v):
            logger.warning_once(
                f"attention backend {self.name!r} has no kernel for {q.dtype} head_dim {q.shape[-1]} on "
                f"{q.device.type}: those calls run exact SDPA"
            )
            return super().__call__(q, k, v)
        return triton_int8.attention(q, k, v, pv=self.pv)


@dataclass(frozen=True)
class FlashAttn4Backend(AttentionBackend):
    """FlashAttention 4's CuTe kernels for dense half-precision calls: fp32 softmax and accumulation, exact as
    SDPA's kernels are. A masked or causal call (FA4 aligns a causal mask to the bottom right, SDPA to the top
    left), or a head dim or dtype it has no kernel for, takes SDPA."""

    def __call__(self, q, k, v, key_mask=None, causal=False):
        if key_mask is not None or causal or not flash_attn_4_runs(q, k, v):
            return super().__call__(q, k, v, key_mask, causal)
        from flash_attn.cute import flash_attn_func  # imports the CuTe DSL: only once this backend runs

        return flash_attn_func(q, k, v)[0]

    def with_lse(self, q, k, v, key_mask=None):
        if key_mask is not None or not flash_attn_4_runs(q, k, v):
            return super().with_lse(q, k, v, key_mask)
        from flash_attn.cute import flash_attn_func

        return flash_attn_func(q, k, v, return_lse=True)


def flash_attn_4_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether FA4 has a kernel for this call: CUDA, fp16 or bf16, one head dim for q, k and v, a multiple of 8
    up to 256 (Hopper's range; Blackwell's is narrower and FA4 itself refuses the rest)."""
    head_dim = q.shape[-1]
    return (
        q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and k.dtype == v.dtype == q.dtype
        and k.shape[-1] == v.shape[-1] == head_dim
        and head_dim % 8 == 0
        and head_dim <= 256
    )


TRITON_INSTALL = "it comes with PyTorch's CUDA wheels on Linux (or pip install triton)"
# The Triton kernel's backends by their P.V format (triton_int8.PV_FORMATS)
TRITON_PV = {"triton_int8": "16bit", "triton_int8_fp8pv": "fp8", "triton_int8_int8pv": "int8"}

BACKENDS: dict[str, AttentionBackend] = {
    "sdpa": AttentionBackend("sdpa", supports_mask=False),
    "sdpa_masked": AttentionBackend("sdpa_masked", supports_mask=True),
    "cudnn_fp8": CudnnFP8Backend(
        "cudnn_fp8",
        supports_mask=True,
        low_precision=True,
        requires=("cudnn", "nvidia-cudnn-frontend"),
        min_capability=(9, 0),
    ),
    **{
        name: TritonInt8Backend(
            name,
            supports_mask=True,
            low_precision=True,
            requires=("triton", "triton"),
            min_capability=(9, 0),
            install=TRITON_INSTALL,
            pv=pv,
        )
        for name, pv in TRITON_PV.items()
    },
    "flash_attn_4": FlashAttn4Backend(
        "flash_attn_4",
        supports_mask=True,
        requires=("flash_attn.cute", "flash-attn-4"),
        min_capability=(9, 0),
        install="pip install -e '.[fa4]' (or pip install flash-attn-4)",
    ),
}

_configured_name: str | None = None
_automatic_dense = "sdpa"  # what a dense call runs when no backend is named (automatic_dense_backend)
_full_steps = 0  # the first and last this many denoising steps run a lossy backend's attention exactly
_step: tuple[int, int] | None = None  # (step, total steps) of the denoising step running; None: none known


def check_attention_backend(name: str | None, mask_sp_padding: bool = False) -> None:
    """Raise ValueError for an unknown backend name, one that cannot mask when masking is asked for, or one
    whose package is not installed."""
    named = _named(name)
    if mask_sp_padding and named is not None and not named[0].supports_mask:
        masking = [n for n, b in BACKENDS.items() if b.supports_mask]
        raise ValueError(
            f"mask_sp_padding=True needs an attention backend that can mask, but {named[1]}={named[0].name!r} "
            f"cannot. Use {' or '.join(masking)} (or leave the backend unset), or set mask_sp_padding=False."
        )
    backend = _selected(name, needs_mask=mask_sp_padding)
    if backend.requires is not None and not _installed(backend.requires[0]):
        module, package = backend.requires
        install = backend.install or f"pip install -e '.[fp8]' (or pip install {package})"
        raise ValueError(
            f"attention backend {backend.name!r} needs the {package} package (module {module!r}), which is not "
            f"installed: {install}; or choose another --attention-backend"
        )


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a dotted name whose parent package is missing
        return False


def configure_attention_backend(
    name: str | None,
    mask_sp_padding: bool = False,
    full_steps: int = 0,
    device: torch.device | None = None,
    graphs: bool = False,
) -> None:
    """Set the process-wide backend name (None: env var or automatic) and the per-step rule's
    `full_steps`; errors early on bad settings, and (given the rank's `device`) on a GPU the backend
    cannot run on. `graphs`: the rank replays its forwards from CUDA graphs (the automatic choice's input)."""
    global _configured_name, _full_steps, _automatic_dense
    check_attention_backend(name, mask_sp_padding)
    _automatic_dense = automatic_dense_backend(device, graphs)
    if device is not None:
        _check_device(_selected(name, needs_mask=mask_sp_padding), device)
    _configured_name, _full_steps = name, full_steps
    if _automatic_dense != "sdpa" and _named(name) is None:
        logger.info(
            f"attention: {_automatic_dense} for dense calls (flash-attn-4 is installed on this Hopper GPU: faster "
            "than cuDNN's kernel and as exact); --attention-backend sdpa keeps cuDNN's"
        )


def automatic_dense_backend(device: torch.device | None, graphs: bool) -> str:
    """The exact kernel a dense call gets when no backend is named: ``flash_attn_4`` on a Hopper GPU where
    flash-attn-4 is installed and imports, and the forward replays CUDA graphs; else ``sdpa``. On an H100, replayed
    from a graph, FA4's kernel took 0.79-0.94x cuDNN's time at every shape measured, at the same error
    (docs/performance.md); launched from Python, its host work makes a short call (a Ulysses-8 rank of a 1024x1024
    image) slower than cuDNN's, so an eager rank keeps SDPA. Only Hopper was measured."""
    if device is None or device.type != "cuda" or not graphs or not _installed("flash_attn.cute"):
        return "sdpa"
    if torch.cuda.get_device_capability(device)[0] != 9:
        return "sdpa"
    try:
        import flash_attn.cute  # noqa: F401  (the CuTe DSL's libraries load here)
    except Exception as exc:  # a broken install: SDPA, which always runs, and why
        logger.warning(f"flash-attn-4 is installed but does not import ({exc}); attention runs SDPA")
        return "sdpa"
    return "flash_attn_4"


def _check_device(backend: AttentionBackend, device: torch.device) -> None:
    if backend.min_capability is None:
        return
    need = ".".join(map(str, backend.min_capability))
    if device.type != "cuda":
        raise ValueError(
            f"attention backend {backend.name!r} needs a CUDA GPU of compute capability {need} (Hopper) or newer; "
            f"this rank runs on {device.type}; choose another --attention-backend"
        )
    have = torch.cuda.get_device_capability(device)
    if have < backend.min_capability:
        raise ValueError(
            f"attention backend {backend.name!r} needs a CUDA GPU of compute capability {need} (Hopper) or newer; "
            f"{torch.cuda.get_device_name(device)} has {have[0]}.{have[1]}; choose another --attention-backend"
        )


def _named(name: str | None) -> tuple[AttentionBackend, str] | None:
    """The backend the config names, else the env var, with where its name came from; None: neither names one."""
    source = "attention_backend"
    if name is None:
        name, source = os.environ.get(ENV_VAR), ENV_VAR
    if not name:
        return None
    backend = BACKENDS.get(name)
    if backend is None:
        raise ValueError(f"unknown {source} {name!r}; choose one of: {', '.join(BACKENDS)}")
    return backend, source


def _selected(name: str | None, needs_mask: bool) -> AttentionBackend:
    """The backend for a call: the one named, else by need. A masked call under a named kernel that cannot mask
    (a model's own mask: block-causal text, a prompt's padding) runs SDPA's masked kernel; the SP padding's mask
    with such a kernel is refused at start (`check_attention_backend`)."""
    named = _named(name)
    if named is None or (needs_mask and not named[0].supports_mask):
        return BACKENDS["sdpa_masked" if needs_mask else _automatic_dense]
    return named[0]


def dense_attention_kernel() -> str:
    """The backend this process's dense attention calls run (named, else automatic), for logs and benchmarks."""
    return _selected(_configured_name, needs_mask=False).name


def fp8_attention_step(step: int, total: int, full_steps: int) -> bool:
    """The per-step rule: whether denoising step `step` of `total` runs a lossy backend's kernel (the
    first and last `full_steps` run exact attention)."""
    return full_steps <= step < total - full_steps


def set_denoising_step(step: int | None, total: int | None = None) -> None:
    """The runner's report: denoising step `step` of `total` starts (None: no step is running)."""
    global _step
    _step = None if step is None else (step, total)


def low_precision_step() -> bool:
    """Whether a lossy backend runs its own kernel now (outside a denoising loop: always)."""
    return _step is None or fp8_attention_step(*_step, _full_steps)


def attention_precision() -> str:
    """ "low" while a lossy backend's kernel runs attention, else "exact": what a captured graph holds
    (part of its key, worker/cuda_graphs.py)."""
    backend = BACKENDS.get(_configured_name or os.environ.get(ENV_VAR) or "")
    return "low" if backend is not None and backend.low_precision and low_precision_step() else "exact"


def resolve_attention_backend(needs_mask: bool, allow_low_precision: bool = True) -> AttentionBackend:
    """The backend for one attention call: configured name, else env var, else by need. A lossy backend gives
    way to the exact kernel on a full-precision step, or where the caller does not allow it."""
    backend = _selected(_configured_name, needs_mask)
    if backend.low_precision and not (allow_low_precision and low_precision_step()):
        return BACKENDS["sdpa_masked" if needs_mask else _automatic_dense]
    return backend
