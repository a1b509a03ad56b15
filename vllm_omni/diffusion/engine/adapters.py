"""The served LoRA adapters: name -> file, each checked when it is loaded, and a request's `lora` resolved.

An adapter is checked once, in the engine's process, before any request uses it (at start for
`--lora-modules`, at `load_lora_adapter` for one added at run time): read with the family
pipeline's own diffusers loader (`lora_state_dict`: diffusers' formats and its kohya / ComfyUI key
converters), every key must adapt a linear weight of a denoiser this checkpoint has (read from the
checkpoint's safetensors headers: no weight is loaded), with A and B of that linear's shape, at a
rank of at most `max_lora_rank`. diffusers only warns about keys that match nothing; here the
adapter is refused naming the first one (a silent no-op adapter is the worst outcome). The workers
read the same file when a request first needs it (worker/lora.py). A path `tiny/<name>-lora` is a tiny adapter,
built once into the tiny-model cache (models/tiny_lora.py), as `tiny/<name>` is a tiny model. The checks that need
no model (`check_adapter_file`) also run in `vllm-omni serve` before it starts (`check_lora_modules`).

An adapter is one file for every denoiser, or, for a model of two experts, two: `HIGH,LOW`, the first for the
high-noise `transformer`, the second for the low-noise `transformer_2` (few-step adapters of such models ship so);
each is checked against its own expert's layers, and the workers load each into its expert only.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from vllm_omni.diffusion.config import lora_paths
from vllm_omni.diffusion.request import LoraRequest, RequestError
from vllm_omni.diffusion.worker.memory_plan import header_tensors


class LoraNotFound(RequestError):
    """A request named an adapter that is not served (HTTP: 404, as vLLM answers an unknown model)."""


def adapter_path(path: str) -> str:
    """`path` as given, or the cached folder of the tiny adapter it names (`tiny/qwen-image-lora`)."""
    if not path.startswith("tiny/"):
        return path
    from vllm_omni.diffusion.models.tiny_lora import tiny_adapter_path

    try:
        return str(tiny_adapter_path(path))
    except ValueError as exc:
        raise RequestError(str(exc), "lora_path") from None


# What diffusers' lora_state_dict reads from a folder: the top-level .safetensors files, else the pickled .bin ones.
ADAPTER_SUFFIXES = (".safetensors", ".bin")
# A pair's files, in order: the denoiser each one goes to, as the messages name it.
PAIR_DENOISERS = ("transformer", "transformer_2")
PAIR_LABELS = ("its high-noise file, for transformer", "its low-noise file, for transformer_2")


def adapter_paths(path: str | Sequence[str]) -> tuple[str, ...]:
    """An adapter's files as given (one path, 'HIGH,LOW', or a list of one or two), each as `adapter_path` resolves
    it; a RequestError naming `lora_path` for any other form (three paths, an empty one)."""
    try:
        paths = lora_paths(path)
    except ValueError as exc:
        raise RequestError(f"lora_path: {exc}", "lora_path") from None
    return tuple(adapter_path(p) for p in paths)


def _who(name: str, index: int, count: int) -> str:
    """How a message names the adapter's file `index` of `count`."""
    return f"adapter {name!r}" if count == 1 else f"adapter {name!r} ({PAIR_LABELS[index]})"


def check_adapter_file(name: str, path: str, who: str | None = None) -> None:
    """Refuse an adapter whose file cannot be one (RequestError naming `lora_path`), reading headers only: `path`
    (resolved: `adapter_path`) exists, is or holds a weights file diffusers reads, each readable, and its
    safetensors name LoRA tensors (a model's own weights do not). `who`: how messages name it (a pair's file)."""
    who = who or f"adapter {name!r}"
    given = Path(path)
    if not given.exists():
        raise RequestError(f"{who}: {path} does not exist", "lora_path")
    files = [given]
    if given.is_dir():
        files = sorted(f for f in given.iterdir() if f.suffix in ADAPTER_SUFFIXES and f.is_file())
        if not files:
            raise RequestError(
                f"{who}: {path} holds no .safetensors or .bin file: not a LoRA adapter folder", "lora_path"
            )
    keys: list[str] = []
    for file in files:
        try:
            if file.suffix == ".safetensors":
                keys += header_tensors(file)
            else:
                open(file, "rb").close()
        except OSError as exc:
            raise RequestError(f"{who}: {file} cannot be read: {exc.strerror}", "lora_path") from None
        except (ValueError, KeyError, TypeError, AttributeError):  # a header that is not safetensors'
            raise RequestError(f"{who}: {file} is not a LoRA adapter: not a safetensors file", "lora_path") from None
    # Every format diffusers converts names its factors so (lora_A/B, kohya's lora_down/up, XLabs' proj_lora).
    if keys and not any("lora" in key.lower() for key in keys):
        raise RequestError(
            f"{who}: {path} is not a LoRA adapter: none of its {len(keys)} tensors is a LoRA factor "
            "(a model's weights?)",
            "lora_path",
        )


def check_adapter_files(name: str, paths: Sequence[str]) -> None:
    """`check_adapter_file` for each of an adapter's files (resolved: `adapter_paths`), naming a pair's by expert."""
    for index, path in enumerate(paths):
        check_adapter_file(name, path, _who(name, index, len(paths)))


@contextlib.contextmanager
def _naming_module(name: str, path: str) -> Iterator[None]:
    """A `--lora-modules` entry's refusal as the flag's error (ValueError), naming the entry."""
    try:
        yield
    except RequestError as exc:
        raise ValueError(f"--lora-modules {name}={path}: {exc}") from None


def check_lora_modules(modules: Mapping[str, str]) -> None:
    """`--lora-modules`' checks that need no model, for the command line before anything starts (cli/serve.py)."""
    for name, path in modules.items():
        with _naming_module(name, path):
            check_adapter_files(name, adapter_paths(path))


class LoraRegistry:
    def __init__(
        self,
        diffusers_class: str,
        model_path: Path,
        denoisers: list[str],
        max_lora_rank: int,
        modules: Mapping[str, str] | None = None,
    ) -> None:
        import diffusers

        self.pipeline_class = getattr(diffusers, diffusers_class)
        self.diffusers_class = diffusers_class
        self.model_path = Path(model_path)
        self.denoisers = denoisers
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, tuple[str, ...]] = {}  # name -> its resolved files (a pair: high noise, low noise)
        self.versions: dict[str, int] = {}  # name -> the load that served it (LoraRequest.version)
        self.adapted: dict[str, frozenset[str]] = {}  # name -> the denoiser weights ('<module>.weight') it adapts
        # The weights the workers' memory plan keeps originals of (None: any): set by the engine at start when no
        # adapter can be loaded at run time; an adapter added later (offline, by path) must adapt no other.
        self.planned: frozenset[str] | None = None
        self._loads = itertools.count(1)
        self._lock = threading.Lock()
        self._weights: dict[str, dict[str, tuple[int, ...]]] = {}
        for name, path in (modules or {}).items():
            with _naming_module(name, path):
                self.load(name, path)

    @property
    def supported(self) -> bool:
        return hasattr(self.pipeline_class, "lora_state_dict")

    def served(self) -> dict[str, str]:
        """Name -> resolved path of each served adapter (a pair: 'HIGH,LOW'), by name (GET /v1/models lists them)."""
        with self._lock:
            return {name: ",".join(paths) for name, paths in sorted(self.adapters.items())}

    def weight_shapes(self, denoiser: str | None = None) -> dict[str, tuple[int, ...]]:
        """'<module path>.weight' -> shape, of a denoiser's 2-D weights (None: the first denoiser's; two experts
        have the same layers)."""
        denoiser = denoiser or self.denoisers[0]
        if denoiser not in self._weights:
            shapes = {}
            for file in sorted((self.model_path / denoiser).glob("*.safetensors")):
                shapes |= {name: shape for name, (_, shape) in header_tensors(file).items() if len(shape) == 2}
            self._weights[denoiser] = shapes
        return self._weights[denoiser]

    def adapted_weights(self) -> frozenset[str]:
        """Every denoiser weight ('<module>.weight') a served adapter adapts: what the workers keep originals of."""
        with self._lock:
            return frozenset().union(*self.adapted.values())

    def check(self, name: str, path: str | Sequence[str]) -> frozenset[str]:
        """Refuse an adapter that cannot serve here (RequestError naming `lora_path`), before any worker reads it;
        return the denoiser weights ('<module>.weight') it adapts. `path`: its file, or a pair's two (resolved:
        `adapter_paths`), each checked against its own expert's layers."""
        if not self.supported:
            raise RequestError(
                f"{self.diffusers_class} has no diffusers LoRA loader: adapters cannot be served", "lora"
            )
        paths = (path,) if isinstance(path, str) else tuple(path)
        if len(paths) == 2 and tuple(self.denoisers) != PAIR_DENOISERS:
            raise RequestError(
                f"adapter {name!r}: two files (HIGH,LOW) are one per expert of a two-expert model (transformer, "
                f"transformer_2); {self.diffusers_class} here has "
                f"{' and '.join(self.denoisers)} only: give one file",
                "lora_path",
            )
        check_adapter_files(name, paths)
        adapted: set[str] = set()
        for index, file in enumerate(paths):
            denoiser = self.denoisers[index] if len(paths) == 2 else self.denoisers[0]
            adapted |= self._check_file(_who(name, index, len(paths)), file, self.weight_shapes(denoiser))
        return frozenset(adapted)

    def _check_file(self, who: str, path: str, shapes: dict[str, tuple[int, ...]]) -> set[str]:
        """One adapter file's keys against a denoiser's 2-D weights: the weights it adapts."""
        try:
            state = self.pipeline_class.lora_state_dict(path)
        except Exception as exc:  # noqa: BLE001 - a file diffusers cannot read, whatever it raised
            raise RequestError(f"{who}: {path} is not a LoRA diffusers can read: {exc}", "lora_path") from None
        if isinstance(state, tuple):
            state = state[0]
        if not state:
            raise RequestError(f"{who}: {path} holds no LoRA weights", "lora_path")
        adapted = set()
        for key, tensor in sorted(state.items()):
            prefix, _, rest = key.partition(".")
            module, kind, _ = rest.partition(".lora_")
            if prefix != "transformer" or kind == "" or f"{module}.weight" not in shapes:
                raise RequestError(
                    f"{who} ({path}) does not fit {self.diffusers_class}: its key {key!r} matches no "
                    "linear layer of the denoiser (an adapter for another model?)",
                    "lora_path",
                )
            adapted.add(f"{module}.weight")
            out_features, in_features = shapes[f"{module}.weight"]
            if key.endswith("lora_A.weight"):
                rank, width = tensor.shape[0], tensor.shape[-1]
                if width != in_features:
                    raise RequestError(
                        f"{who}: {key} takes {width} inputs, the layer {in_features} (another model size?)",
                        "lora_path",
                    )
                if rank > self.max_lora_rank:
                    raise RequestError(
                        f"{who}: rank {rank} at {key} is above --max-lora-rank {self.max_lora_rank}", "lora_path"
                    )
            elif key.endswith("lora_B.weight") and tensor.shape[0] != out_features:
                raise RequestError(
                    f"{who}: {key} gives {tensor.shape[0]} outputs, the layer {out_features} (another model size?)",
                    "lora_path",
                )
        return adapted

    def load(self, name: str, path: str | Sequence[str]) -> None:
        """Serve `path` as `name` (checked first); a name already served is refused. `path`: one file for every
        denoiser, or a pair, 'HIGH,LOW' or [HIGH, LOW], one per expert of a two-expert model."""
        if not isinstance(name, str) or not name.strip():
            raise RequestError("lora_name must be a non-empty string", "lora_name")
        if isinstance(path, str) and not path.strip():
            raise RequestError("lora_path must be a path to a LoRA folder or .safetensors file", "lora_path")
        paths = adapter_paths(path)
        with self._lock:
            if name in self.adapters:
                raise RequestError(f"adapter {name!r} is already loaded (from {self._text(name)})", "lora_name")
        adapted = self.check(name, paths)
        if self.planned is not None and not adapted <= self.planned:
            outside = sorted(adapted - self.planned)
            raise RequestError(
                f"adapter {name!r} adapts {len(outside)} weight(s) the served adapters do not ({outside[0]} first): "
                "the memory plan keeps originals of those only; serve it with --lora-modules, or start with "
                "--allow-runtime-lora (which plans for any)",
                "lora_path",
            )
        with self._lock:
            if name in self.adapters:  # loaded by another caller while this one was checked
                raise RequestError(f"adapter {name!r} is already loaded (from {self._text(name)})", "lora_name")
            self.adapters[name] = tuple(str(Path(p).resolve()) for p in paths)
            self.versions[name] = next(self._loads)
            self.adapted[name] = adapted

    def _text(self, name: str) -> str:
        return ",".join(self.adapters[name])

    def unload(self, name: str) -> None:
        """Stop serving `name`: a request naming it from now on gets LoraNotFound; requests already accepted
        with it still run with it (they carry its file)."""
        with self._lock:
            if self.adapters.pop(name, None) is None:
                raise LoraNotFound(f"adapter {name!r} is not loaded", "lora_name")
            self.versions.pop(name, None)
            self.adapted.pop(name, None)

    def resolve(self, lora: Any) -> LoraRequest | None:
        """A request's `lora` (a served adapter's name, or {"name", "scale"}; offline also {"name", "path",
        "scale"}) as a LoraRequest; RequestError naming `lora` otherwise, LoraNotFound for an unknown name."""
        if lora is None:
            return None
        if not self.supported:
            raise RequestError(f"{self.diffusers_class} has no diffusers LoRA loader: it serves no adapters", "lora")
        if isinstance(lora, LoraRequest):
            return lora
        if isinstance(lora, str):
            lora = {"name": lora}
        if not isinstance(lora, dict):
            raise RequestError(f'lora must be an adapter name or {{"name": ..., "scale": ...}}, got {lora!r}', "lora")
        unknown = sorted(set(lora) - {"name", "scale", "path"})
        if unknown:
            raise RequestError(f"lora takes name, scale (and offline path), not {', '.join(unknown)}", "lora")
        name, scale, path = lora.get("name"), lora.get("scale", 1.0), lora.get("path")
        if not isinstance(name, str) or not name:
            raise RequestError("lora.name must be the name of a served adapter", "lora")
        if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not -100 <= scale <= 100:
            raise RequestError(f"lora.scale must be a number in [-100, 100], got {scale!r}", "lora")
        if path is not None:  # offline: an adapter not served yet, checked like one loaded at run time
            with self._lock:
                known = self.adapters.get(name)
            if known is None:
                self.load(name, path)
            else:
                try:
                    given = tuple(str(Path(p).resolve()) for p in adapter_paths(path))
                except RequestError as exc:
                    raise RequestError(str(exc).replace("lora_path", "lora.path", 1), "lora") from None
                if known != given:
                    raise RequestError(f"adapter {name!r} is served from {','.join(known)}, not {path}", "lora")
        with self._lock:
            served, version = self.adapters.get(name), self.versions.get(name, 0)
        if served is None:
            names = ", ".join(sorted(self.adapters)) or "none"
            raise LoraNotFound(f"adapter {name!r} is not served here (adapters: {names})", "lora")
        return LoraRequest(name, served[0], float(scale), version, served[1] if len(served) == 2 else None)
