"""End to end: a pipeline call timed by phase, in this process (diffusers) or in ours' workers (`Omni`).

Shared by qwen_image_e2e.py, video_e2e.py (and through it wan22_e2e.py and hunyuan_video_e2e.py), lora.py and
speed_levers.py:

- phases: `PhaseProbe` times a call's text encoding, denoising and decode (and, with `loop_start`, the
  preparation before the loop); `install_worker_probe` installs one in each of ours' workers, which write a
  record per request that `probe_records` reads back. The workers' `Stats.phase_seconds` (encode, denoise,
  decode, onload) does not hold what the published tables show (the text encoding of a pipeline that does
  not encode first, the preparation before the loop, compile seconds, CUDA graph captures and their seconds,
  the allocator's peak), so the probe still wraps `PipelineRunner.__init__` / `run` and
  `CUDAGraphForward._capture` in the workers: the one remaining replacement of methods in a worker.
- checkpoints: a random-weight folder built once (`prepare_partial`, `save_synced`, `commit_checkpoint`,
  `build_record`), the page cache around it (`evict_from_page_cache`, `page_cache_fraction`,
  `measure_reads`), the inductor cache's size; random LoRA adapters (`write_adapter`).
- memory: `DeviceMemorySampler` (nvidia-smi's peaks per GPU).
- results: rows (`failed_row`), the JSON and the docs section written together (`save_results`), the
  agreement of pictures or frames with ours-default's (`add_agreement`), table cells (`cell`).
"""

from __future__ import annotations

import contextlib
import ctypes
import inspect
import json
import mmap
import os
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.reports import image_psnr, replace_section, save_json  # noqa: E402
from vllm_omni.diffusion.attention.backends import dense_attention_kernel  # noqa: E402

GIB = 2**30


BUILD_MARKER = "e2e_build.json"


# A variant's Omni option for a smaller card: its size in GiB, given to the engine as gpu_memory_utilization.
GPU_GIB = "gpu_memory_gib"


# Qwen2.5-VL-7B-Instruct's text model (Qwen-Image's and HunyuanVideo 1.5's text_encoder/config.json); token ids
# come from the tokenizer.
QWEN25_VL_7B_TEXT = dict(
    vocab_size=152064,
    hidden_size=3584,
    intermediate_size=18944,
    num_hidden_layers=28,
    num_attention_heads=28,
    num_key_value_heads=4,
    hidden_act="silu",
    max_position_embeddings=128000,
    max_window_layers=28,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [16, 24, 24]},
    sliding_window=32768,
    use_sliding_window=False,
    attention_dropout=0.0,
    initializer_range=0.02,
)


def compile_seconds() -> float:
    """Seconds this process has spent compiling with torch.compile (dynamo frames, inductor included)."""
    spent = getattr(torch._dynamo.utils, "calculate_time_spent", None)
    return float(spent().get("entire_frame_compile", 0.0)) if spent else 0.0


_CAPTURES = {"count": 0, "seconds": 0.0}  # CUDA graph captures of this process (ours' workers only)


class PhaseProbe:
    """Times one pipeline call's phases through wrappers on its bound methods (a diffusers pipeline's, in this
    process or, through `install_worker_probe`, in ours' workers).

    Text encoding: the `encode_prompt` calls (prompt and negative prompt). VAE decode:
    `vae.decode`. Denoising: from the end of the last `encode_prompt` to the start of the decode
    (latent preparation, timesteps, the loop). On CUDA every boundary synchronises the device,
    and the peak memory is the allocator's over the call.

    `loop_start`: the name of a pipeline method the call runs once, right before its denoising
    loop. With it, denoising is also split in two: `prep_s` (from the end of text encoding to
    that method's end: timesteps, latents) and `loop_s` (from there to the start of the decode).
    """

    def __init__(self, pipe: Any, device: torch.device, loop_start: str | None = None) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.marks: list[tuple[str, float, float]] = []
        self.loop_start = loop_start
        pipe.encode_prompt = self._timed("text", pipe.encode_prompt)
        pipe.vae.decode = self._timed("decode", pipe.vae.decode)
        if loop_start is not None:
            setattr(pipe, loop_start, self._timed("prep", getattr(pipe, loop_start)))

    def _now(self) -> float:
        if self.cuda:
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    def _timed(self, phase: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            start = self._now()
            try:
                return fn(*args, **kwargs)
            finally:
                self.marks.append((phase, start, self._now()))

        return call

    def begin(self) -> None:
        self.marks = []
        if self.cuda:
            torch.cuda.reset_peak_memory_stats(self.device)
        self.compile0, self.captures0 = compile_seconds(), dict(_CAPTURES)
        self.start = self._now()

    def end(self) -> dict[str, Any]:
        total = self._now() - self.start
        text = [(s, e) for phase, s, e in self.marks if phase == "text"]
        decode = [(s, e) for phase, s, e in self.marks if phase == "decode"]
        record = {
            "call_s": total,
            "text_s": sum(e - s for s, e in text) if text else None,
            "denoise_s": decode[0][0] - text[-1][1] if text and decode else None,
            "decode_s": sum(e - s for s, e in decode) if decode else None,
            "compile_s": compile_seconds() - self.compile0,
            "captures": _CAPTURES["count"] - self.captures0["count"],
            "capture_s": _CAPTURES["seconds"] - self.captures0["seconds"],
            "peak_alloc_gib": torch.cuda.max_memory_allocated(self.device) / GIB if self.cuda else None,
            "peak_reserved_gib": torch.cuda.max_memory_reserved(self.device) / GIB if self.cuda else None,
            "device_name": torch.cuda.get_device_name(self.device) if self.cuda else "cpu",
            "attention": dense_attention_kernel(),  # ours-default's depends on what is installed (FA4 or SDPA)
        }
        if self.loop_start is not None:
            prep = [e for phase, _, e in self.marks if phase == "prep"]
            record["prep_s"] = prep[-1] - text[-1][1] if text and prep else None
            record["loop_s"] = decode[0][0] - prep[-1] if prep and decode else None
        return record


def install_worker_probe(directory: Path, **probe_options: Any) -> None:
    """In an engine worker: time every request's phases with a PhaseProbe and count graph captures.

    `probe_options`: PhaseProbe's keyword arguments (`loop_start`)."""
    from vllm_omni.diffusion.worker import cuda_graphs, runner

    cls = runner.PipelineRunner
    init, run, capture = cls.__init__, cls.run, cuda_graphs.CUDAGraphForward._capture
    signature = inspect.signature(init)

    def probed_init(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        bound = signature.bind(self, *args, **kwargs).arguments
        self.e2e_probe = PhaseProbe(self.pipe, torch.device(bound["device"]), **probe_options)
        self.e2e_rank = bound["rank"]

    def probed_run(self, request: Any, *args: Any, **kwargs: Any) -> Any:
        self.e2e_probe.begin()
        images = run(self, request, *args, **kwargs)
        record = dict(self.e2e_probe.end(), request_id=request.request_id, rank=self.e2e_rank)
        offload = getattr(self, "model_offload", None)
        if offload is not None and offload.last_moves:  # --cpu-offload encoders or model: the weights moved in
            record["onload_s"] = sum(seconds for _, seconds in offload.last_moves.values())
            # The denoisers move in inside the loop (their first forward): a fixed cost, not one per step.
            record["onload_loop_s"] = sum(s for name, (_, s) in offload.last_moves.items() if name in self.denoisers)
            record["onload_gib"] = sum(count for count, _ in offload.last_moves.values()) / GIB
        with open(directory / f"rank{self.e2e_rank}.jsonl", "a") as log:
            log.write(json.dumps(record) + "\n")
        return images

    def counted_capture(self, kwargs: dict[str, Any]) -> Any:
        start = time.perf_counter()
        graph = capture(self, kwargs)  # a failed capture raises: not counted
        _CAPTURES["count"] += 1
        _CAPTURES["seconds"] += time.perf_counter() - start  # the first forward of a new shape compiles here
        return graph

    cls.__init__, cls.run = probed_init, probed_run
    cuda_graphs.CUDAGraphForward._capture = counted_capture


def probe_records(directory: Path, request_id: str) -> dict[int, dict[str, Any]]:
    """rank -> the worker's record of `request_id` (written before the worker answers the engine)."""
    records = {}
    for path in directory.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if record["request_id"] == request_id:
                records[record["rank"]] = record
    return records


def checkpoint_files(folder: Path) -> list[Path]:
    return sorted(path for path in folder.rglob("*") if path.is_file())


def evict_from_page_cache(files: list[Path]) -> None:
    """Drop the files' pages from the page cache (fsync first: dirty pages stay), no root needed."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def page_cache_fraction(files: list[Path]) -> float | None:
    """Fraction of the files' pages in the page cache (mincore on a mapping); None where it cannot tell."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.mmap.restype = ctypes.c_void_p
        libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
        libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    except (OSError, AttributeError):
        return None
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        if not size:
            continue
        pages = -(-size // mmap.PAGESIZE)
        vector = (ctypes.c_ubyte * pages)()
        with open(path, "rb") as file:
            address = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, file.fileno(), 0)
            if address in (None, ctypes.c_void_p(-1).value):
                return None
            try:
                if libc.mincore(address, size, vector) != 0:
                    return None
            finally:
                libc.munmap(address, size)
        resident += int((np.frombuffer(vector, dtype=np.uint8) & 1).sum())  # bit 0: page resident
        total += pages
    return resident / total if total else None


def inductor_cache_files(ours: bool) -> int | None:
    """Files in the inductor cache the compiling process uses (warm caches compile much faster)."""
    if ours:  # the engine's workers default it to this folder (cuda_graphs.compile_repeated_blocks)
        path = Path(os.environ.get("TORCHINDUCTOR_CACHE_DIR") or Path("~/.cache/vllm_omni/inductor").expanduser())
    else:
        try:
            from torch._inductor.runtime.cache_dir_utils import cache_dir
        except ImportError:
            return None
        path = Path(cache_dir())
    return sum(1 for item in path.rglob("*") if item.is_file()) if path.is_dir() else 0


def read_files(files: list[Path]) -> tuple[int, float]:
    """(bytes, seconds) to read every file start to end, 64 MiB at a time, as `cat` would."""
    buffer = bytearray(64 * 2**20)
    total = 0
    start = time.perf_counter()
    for path in files:
        with open(path, "rb", buffering=0) as file:
            while n := file.readinto(buffer):
                total += n
    return total, max(time.perf_counter() - start, 1e-9)


def filesystem_of(path: Path) -> str:
    """The type of the file system holding `path` (from /proc/mounts), e.g. ext4, overlay, tmpfs."""
    resolved, best, kind = str(path.resolve()), "", "unknown"
    with contextlib.suppress(OSError):
        for line in Path("/proc/mounts").read_text().splitlines():
            fields = line.split()
            if len(fields) < 3:
                continue
            mount = fields[1]
            inside = resolved == mount or resolved.startswith(mount.rstrip("/") + "/")
            if inside and len(mount) >= len(best):
                best, kind = mount, fields[2]
    return kind


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def already_built(folder: Path, scale_name: str, rebuild: bool) -> bool:
    """True when `folder` already holds this scale's checkpoint (and --rebuild is off); exits on a foreign folder."""
    marker = folder / BUILD_MARKER
    if marker.is_file() and not rebuild:
        if json.loads(marker.read_text()).get("scale") == scale_name:
            print(f"build: {folder} already holds the {scale_name} checkpoint", flush=True)
            return True
        raise SystemExit(f"{folder} holds another checkpoint scale; pass --rebuild or another --folder")
    if folder.exists() and not marker.is_file():
        raise SystemExit(f"{folder} exists and is not a checkpoint this script built; pick another --folder")
    return False


def prepare_partial(
    components: dict[str, torch.nn.Module], device: torch.device, dtype: torch.dtype, start: float, folder: Path
) -> tuple[float, dict[str, int], Path]:
    """The made components in `dtype` and eval mode, and an empty `<folder>.partial` with room for them.

    Returns the seconds since `start`, the parameters per component and the partial folder.
    """
    for model in components.values():
        if any(p.dtype != dtype for p in model.parameters()):  # made in `dtype` already, as a rule
            model.to(dtype)
        model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    init_s = time.perf_counter() - start
    params = {name: sum(p.numel() for p in model.parameters()) for name, model in components.items()}
    weight_bytes = sum(p.numel() * p.element_size() for m in components.values() for p in m.parameters())
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(partial.parent).free
    if free < weight_bytes * 1.05 + GIB:
        raise SystemExit(
            f"{partial.parent} has {free / GIB:.1f} GiB free; the checkpoint needs {weight_bytes / GIB:.1f}"
        )
    print(f"build: {params} parameters made in {init_s:.1f} s on {device}; writing {partial}", flush=True)
    return init_s, params, partial


def save_synced(pipe: Any, partial: Path) -> tuple[list[Path], float, int]:
    """`pipe.save_pretrained(partial)` (safetensors), synced to disk: (its files, seconds, bytes written)."""
    start = time.perf_counter()
    pipe.save_pretrained(partial, safe_serialization=True)
    files = checkpoint_files(partial)
    for path in files:  # on disk, not only in the page cache
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    write_s = time.perf_counter() - start
    written = sum(path.stat().st_size for path in files)
    return files, write_s, written


def commit_checkpoint(partial: Path, folder: Path, record: dict[str, Any], written: int, write_s: float) -> None:
    """Mark `partial` complete and rename it to `folder`."""
    (partial / BUILD_MARKER).write_text(json.dumps(record, indent=1) + "\n")
    shutil.rmtree(folder, ignore_errors=True)  # an earlier scale's folder (checked above: ours)
    os.replace(partial, folder)
    print(f"build: {written / 1e9:.2f} GB written in {write_s:.1f} s ({record['write_gb_per_s']} GB/s)", flush=True)


def build_record(
    scale: str, params: int, files: list[Path], written: int, init_s: float, write_s: float, partial: Path, **facts: Any
) -> dict[str, Any]:
    """What a build wrote, and how fast (the JSON's "build"); `facts`: the model's own (its scheduler's shift...)."""
    return {
        "scale": scale,
        "parameters": params,
        "bytes": written,
        "safetensors_files": sum(path.suffix == ".safetensors" for path in files),
        **facts,
        "init_s": round(init_s, 2),
        "write_s": round(write_s, 2),
        "write_gb_per_s": round(written / write_s / 1e9, 3),
        "filesystem": filesystem_of(partial),
        "host": socket.gethostname(),
    }


class DeviceMemorySampler:
    """Peak memory in use per GPU as nvidia-smi reports it every 200 ms: the whole device (CUDA
    contexts, NCCL buffers, every process), over the whole variant, loading included."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled and shutil.which("nvidia-smi") is not None
        self.peaks_mib: dict[int, float] = {}
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> DeviceMemorySampler:
        if self.enabled:
            query = ["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits", "-lms", "200"]
            self.process = subprocess.Popen(query, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            self.reader = threading.Thread(target=self._read, daemon=True)
            self.reader.start()
        return self

    def _read(self) -> None:
        for line in self.process.stdout:
            with contextlib.suppress(ValueError):
                index, used = (field.strip() for field in line.split(","))
                self.peaks_mib[int(index)] = max(self.peaks_mib.get(int(index), 0.0), float(used))

    def __exit__(self, *exc: Any) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.reader.join(timeout=10)

    def peaks_gib(self, gpus: int) -> list[float] | None:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
        indices = [int(i) for i in visible.split(",")] if visible.replace(",", "").isdigit() else list(range(gpus))
        if not self.peaks_mib:
            return None
        return [round(self.peaks_mib[i] / 1024, 2) if i in self.peaks_mib else None for i in indices[:gpus]]


def failed_row(variant: Any, settings: Any, exc: BaseException) -> dict[str, Any]:
    """The row of a variant that failed (a script's Variant and Settings: name, phase, gpus, what; scale.name)."""
    import traceback

    traceback.print_exc()
    text = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    print(f"{variant.name} failed: {text}", flush=True)
    return {"variant": variant.name, "phase": variant.phase, "gpus": variant.gpus, "what": variant.what,
            "scale": settings.scale.name, "host": socket.gethostname(), "error": text}  # fmt: skip


def as_card_of(options: dict[str, Any], device: str) -> dict[str, Any]:
    """Omni options with GPU_GIB (a smaller card's size) given as gpu_memory_utilization, its share of this
    device (which the engine also applies with torch.cuda.set_per_process_memory_fraction)."""
    if GPU_GIB not in options:
        return options
    options = dict(options)
    total = torch.cuda.mem_get_info()[1] if device == "cuda" else 2**40
    options["gpu_memory_utilization"] = min(1.0, options.pop(GPU_GIB) * 2**30 / total)
    return options


def add_agreement(rows: dict[str, dict[str, Any]], images: dict[str, np.ndarray]) -> None:
    """Each row's PSNR (dB, uint8 images or video frames) of its first timed output against ours-default's, for
    the variants run in this process with it ("identical" for equal outputs). `images`: by variant."""
    if "ours-default" not in images:
        return
    for name, image in images.items():
        if name != "ours-default" and name in rows and not rows[name].get("error"):
            rows[name]["psnr_vs_ours_default_db"] = image_psnr(image, images["ours-default"])


def measure_reads(folder: Path) -> dict[str, Any]:
    """Time to read the folder's bytes: after evicting it from the page cache, then again (cached)."""
    files = checkpoint_files(folder)
    evict_from_page_cache(files)
    reads = []
    for label in ("evicted", "cached"):
        cached = page_cache_fraction(files)
        size, seconds = read_files(files)
        reads.append({"label": label, "page_cache_before": None if cached is None else round(cached, 3),
                      "s": round(seconds, 2), "gb_per_s": round(size / seconds / 1e9, 2)})  # fmt: skip
        print(f"read {size / 1e9:.2f} GB ({label}, {cached} in page cache before): {seconds:.1f} s", flush=True)
    return {"bytes": size, "files": len(files), "filesystem": filesystem_of(folder), "reads": reads,
            "eviction": "fsync + posix_fadvise(POSIX_FADV_DONTNEED) per file; residency read with mincore",
            "host": socket.gethostname()}  # fmt: skip


def measure_pcie(gib: float = 1.0, repeats: int = 5) -> dict[str, Any] | None:
    """Host-device bandwidth as offload sees it: copies of `gib` GiB between pinned memory and GPU 0, each way,
    timed with CUDA events; the median of `repeats` after one untimed copy. None without a CUDA GPU."""
    if not torch.cuda.is_available():
        return None
    size = int(gib * 2**30)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    gpu = torch.empty(size, dtype=torch.uint8, device="cuda")

    def rate(dst: torch.Tensor, src: torch.Tensor) -> float:
        dst.copy_(src, non_blocking=True)
        times = []
        for _ in range(repeats):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        return round(size / sorted(times)[len(times) // 2] / 1e9, 1)

    record = {"device": torch.cuda.get_device_name(0), "host": socket.gethostname(), "bytes": size,
              "repeats": repeats, "h2d_gb_per_s": rate(gpu, host), "d2h_gb_per_s": rate(host, gpu)}  # fmt: skip
    print(f"PCIe, pinned copies of {gib} GiB: host to GPU {record['h2d_gb_per_s']} GB/s, "
          f"GPU to host {record['d2h_gb_per_s']} GB/s", flush=True)  # fmt: skip
    return record


def load_results(path: Path) -> dict[str, Any]:
    if path.is_file():
        results = json.loads(path.read_text())
        if isinstance(results, dict) and "variants" in results:
            return results
    return {"variants": {}}


def save_results(
    results: dict[str, Any],
    path: Path,
    docs: Path,
    key: str,
    section: Callable[[dict[str, Any]], str],
    script: str | None = None,
) -> None:
    """The JSON first; a docs failure never loses a measurement (`--phase docs` rewrites them later).

    `section` (results -> the text of the docs section `key`); `script`: the script named as its writer
    (default: `key`)."""
    save_json(path, results)
    try:
        replace_section(docs, key, section(results), script)
    except Exception:  # noqa: BLE001
        import traceback

        traceback.print_exc()


def cell(value: Any, digits: int = 2) -> str:
    if value is None:
        return "n/a"
    if isinstance(value, list):
        return " / ".join(cell(v, digits) for v in value)
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def copy_outputs(copy_to: Path | None, out: Path, docs: Path) -> None:
    """--copy-to: the JSON and the docs page, copied there after each save."""
    if copy_to:
        copy_to.mkdir(parents=True, exist_ok=True)
        for path in (out, docs):
            shutil.copy(path, copy_to / path.name)


RANK = 64  # the random adapters' rank
TARGETS = (  # attention and MLP linears of a block, by the end of their module path
    ".attn.to_q", ".attn.to_k", ".attn.to_v", ".attn.to_out.0", ".attn.add_q_proj", ".attn.add_k_proj",
    ".attn.add_v_proj", ".attn.to_add_out", ".attn1.to_q", ".attn1.to_k", ".attn1.to_v", ".attn1.to_out.0",
    ".attn2.to_q", ".attn2.to_k", ".attn2.to_v", ".attn2.to_out.0", ".ff.net.0.proj", ".ff.net.2",
    ".img_mlp.net.0.proj", ".img_mlp.net.2", ".txt_mlp.net.0.proj", ".txt_mlp.net.2", ".ff.linear_in",
    ".ff.linear_out", ".ff_context.linear_in", ".ff_context.linear_out", ".attn.to_qkv_mlp_proj", ".attn.to_out",
    ".ffn.net.0.proj", ".ffn.net.2",
)  # fmt: skip


def write_adapter(model: torch.nn.Module, folder: Path, seed: int) -> int:
    """A random rank-RANK adapter on every targeted linear, in diffusers' format; returns the linears adapted."""
    from safetensors.torch import save_file

    generator = torch.Generator("cpu").manual_seed(seed)
    state = {}
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and path.endswith(TARGETS) and "blocks." in path:
            out_features, in_features = module.weight.shape
            a = torch.randn(RANK, in_features, generator=generator) / in_features**0.5
            b = torch.randn(out_features, RANK, generator=generator) * 0.01
            state[f"transformer.{path}.lora_A.weight"] = a.to(torch.bfloat16)
            state[f"transformer.{path}.lora_B.weight"] = b.to(torch.bfloat16)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(state, str(folder / "pytorch_lora_weights.safetensors"))
    return len(state) // 2
