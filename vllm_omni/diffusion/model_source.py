"""Model id -> local diffusers folder -> pipeline spec.

A model is a tiny embedded model name (`tiny/qwen-image`, built once into a cache folder), a
local folder with model_index.json, or a Hugging Face hub id (`owner/name`): taken from the
cache (`download_dir`, else huggingface_hub's) when it is there, else downloaded with
huggingface_hub, only the files its model_index.json names (HF_TOKEN, HF_ENDPOINT and
HF_HUB_OFFLINE are huggingface_hub's own). Torch-free, so the engine can resolve a model before
any worker starts; every failure is one ModelNotFoundError line.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from vllm_omni.diffusion.models.family import attention_heads
from vllm_omni.diffusion.models.registry import TINY_MODELS, spec_for
from vllm_omni.diffusion.models.spec import PipelineSpec

# The install hint for the ray extra, from a clone (PyPI's vllm-omni is another project).
RAY_MISSING = "distributed_executor_backend='ray' needs Ray on every node: pip install -e '.[ray]' from a clone"
TINY_PREFIX = "tiny/"
MODEL_INDEX = "model_index.json"
# The hub's repo id form; anything else (an absolute or relative path, a bare name) is a local folder.
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")


class ModelNotFoundError(ValueError):
    pass


def resolve_model_path(model: str, download_dir: str | None = None, revision: str | None = None) -> Path:
    """The local folder holding `model` (a diffusers pipeline with model_index.json). A hub id is looked up in
    `download_dir` (a Hugging Face cache folder; None: huggingface_hub's) at `revision` (None: main), and
    downloaded there when it is not in it."""
    if model.startswith(TINY_PREFIX):
        spec = TINY_MODELS.get(model)
        if spec is None:
            raise ModelNotFoundError(f"unknown tiny model {model!r}; tiny models: {', '.join(TINY_MODELS)}")
        return spec.family_module("tiny").tiny_model_path(model)
    local = Path(model).expanduser()
    if local.is_dir():
        if not (local / MODEL_INDEX).is_file():
            raise ModelNotFoundError(f"{local} is a folder but has no {MODEL_INDEX} (not a diffusers pipeline)")
        return local.resolve()
    if local.exists():
        raise ModelNotFoundError(f"{local} is a file, not a diffusers pipeline folder (with {MODEL_INDEX})")
    if model.startswith((".", "~")) or not HUB_ID.fullmatch(model):
        raise ModelNotFoundError(
            f"no such folder: {model!r} (a model is a local diffusers folder, a hub id 'owner/name', or a tiny "
            f"model: {', '.join(TINY_MODELS)})"
        )
    return _hub_snapshot(model, download_dir, revision)


def _hub_snapshot(model: str, cache_dir: str | None, revision: str | None) -> Path:
    """The hub model's folder in the cache, downloaded first when it is not complete there."""
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        return _snapshot(model, cache_dir, revision, local_files_only=True)
    except (LocalEntryNotFoundError, OSError):  # not there, or only part of it (an interrupted download)
        pass
    try:
        return _snapshot(model, cache_dir, revision, local_files_only=False)
    except Exception as exc:  # noqa: BLE001 - each of huggingface_hub's errors becomes one line
        raise ModelNotFoundError(_download_error(model, cache_dir, revision, exc)) from exc


def _snapshot(model: str, cache_dir: str | None, revision: str | None, local_files_only: bool) -> Path:
    """model_index.json first, then the component folders it names (not the rest of the repo: other
    formats, examples, a second copy of the weights)."""
    from huggingface_hub import hf_hub_download, snapshot_download

    where = {"revision": revision, "cache_dir": cache_dir, "local_files_only": local_files_only}
    index_file = hf_hub_download(model, MODEL_INDEX, **where)
    try:
        index = json.loads(Path(index_file).read_text())
    except ValueError as exc:
        raise ModelNotFoundError(f"{model}: {MODEL_INDEX} is not JSON ({exc})") from exc
    components = sorted(name for name, value in index.items() if not name.startswith("_") and _is_component(value))
    patterns = [MODEL_INDEX, *(f"{name}/*" for name in components)]
    return Path(snapshot_download(model, allow_patterns=patterns, **where))


def _is_component(value: object) -> bool:
    """A model_index.json entry naming a component folder: [library, class], None where the pipeline has none."""
    return isinstance(value, list) and len(value) == 2 and value[0] is not None and value[1] is not None


def _download_error(model: str, cache_dir: str | None, revision: str | None, exc: Exception) -> str:
    from huggingface_hub import constants
    from huggingface_hub.errors import (
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RemoteEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    cache = cache_dir or constants.HF_HUB_CACHE
    at = f" at revision {revision!r}" if revision else ""
    if isinstance(exc, GatedRepoError):  # before RepositoryNotFoundError, its base
        return (
            f"model {model!r} is gated on the Hugging Face hub: accept its terms on its page "
            f"({constants.ENDPOINT}/{model}) and set HF_TOKEN to a token of that account"
        )
    if isinstance(exc, RepositoryNotFoundError):
        return (
            f"model {model!r} not found: not a local folder, and the Hugging Face hub ({constants.ENDPOINT}) has no "
            "such model (or it is private: set HF_TOKEN)"
        )
    if isinstance(exc, RevisionNotFoundError):
        return f"model {model!r} has no revision {revision!r} on the Hugging Face hub"
    if isinstance(exc, LocalEntryNotFoundError):
        offline = " (HF_HUB_OFFLINE is set)" if constants.HF_HUB_OFFLINE else ""
        return (
            f"model {model!r}{at} is not in the Hugging Face cache ({cache}) and the hub ({constants.ENDPOINT}) "
            f"cannot be reached{offline}: connect, or download it elsewhere into that cache"
        )
    if isinstance(exc, RemoteEntryNotFoundError):
        return f"model {model!r}{at} has no {MODEL_INDEX} on the Hugging Face hub: it is not a diffusers pipeline"
    if isinstance(exc, HfHubHTTPError):
        status = exc.response.status_code if exc.response is not None else "an error"
        return f"downloading model {model!r}{at} from {constants.ENDPOINT} failed: the hub answered {status}"
    if isinstance(exc, ModelNotFoundError):
        return str(exc)
    first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"downloading model {model!r}{at} into {cache} failed: {type(exc).__name__}: {first_line}"


def read_pipeline_spec(path: Path) -> PipelineSpec:
    try:
        index = json.loads((path / MODEL_INDEX).read_text())
        class_name = index["_class_name"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelNotFoundError(f"cannot read the pipeline class from {path / 'model_index.json'}: {exc}") from exc
    return spec_for(class_name, index)


def check_ulysses_degree(path: Path, ulysses_degree: int, ring_degree: int = 1, over_sp_group: bool = False) -> None:
    """ValueError when `ulysses_degree` does not divide the attention heads of a denoiser (read from
    the config.json of every transformer* component, before any worker loads; the workers check the
    loaded models again), or, `over_sp_group` (PipelineSpec.heads_over_sp_group), when the whole SP degree does
    not. The error names the (Ulysses, ring) pairs that split the same SP degree
    (`ulysses_degree` x `ring_degree`) and that the heads allow."""
    try:
        index = json.loads((path / MODEL_INDEX).read_text())
    except (OSError, ValueError):
        return
    for name in sorted(index):
        if not name.startswith("transformer") or not isinstance(index[name], list) or index[name][0] is None:
            continue
        try:
            heads = attention_heads(json.loads((path / name / "config.json").read_text()))
        except (OSError, ValueError, TypeError):
            continue  # no readable config here: the workers' check still applies
        if isinstance(heads, int) and heads >= 1:
            error = heads_error(heads, ulysses_degree, ring_degree, over_sp_group)
            if error is not None:
                raise ValueError(error)


def check_pipeline_options(spec: PipelineSpec, cfg_parallel_size: int, cache_policy: str | None) -> None:
    """ValueError when the pipeline cannot take CFG parallel or a step cache (its spec says why)."""
    if cfg_parallel_size > 1 and not spec.cfg_parallel:
        why = spec.cfg_parallel_refusal or "runs no classifier-free guidance branches to split (one forward per step)"
        raise ValueError(
            f"cfg_parallel_size={cfg_parallel_size}: {spec.diffusers_class} {why}; use cfg_parallel_size=1"
        )
    if cache_policy is not None and spec.step_cache_refusal:
        raise ValueError(f"cache={cache_policy}: {spec.diffusers_class} {spec.step_cache_refusal}")


def usp_pairs(heads: int, sp: int) -> list[tuple[int, int]]:
    """The (ulysses_degree, ring_degree) pairs of `sp` ranks whose Ulysses degree divides `heads`, most Ulysses
    first (the all-to-all inside a node is the cheaper exchange; ring takes the rest)."""
    return [(u, sp // u) for u in range(min(heads, sp), 0, -1) if heads % u == 0 and sp % u == 0]


def heads_error(heads: int, ulysses_degree: int, ring_degree: int, over_sp_group: bool) -> str | None:
    """Why a denoiser of `heads` attention heads cannot run at this split (None: it can)."""
    if heads % ulysses_degree:
        return ulysses_degree_error(ulysses_degree, heads, ring_degree)
    sp = ulysses_degree * ring_degree
    if over_sp_group and heads % sp:
        return (
            f"ulysses_degree={ulysses_degree} x ring_degree={ring_degree}: the model's cross-stream attention "
            f"exchanges its {heads} attention heads over all {sp} sequence-parallel ranks, ring ranks included, and "
            f"{sp} does not divide them; use a sequence-parallel size of {divisors(heads)}"
        )
    return None


def divisors(heads: int) -> list[int]:
    """The group sizes that split `heads` attention heads evenly."""
    return [d for d in range(1, heads + 1) if heads % d == 0]


def ulysses_degree_error(ulysses_degree: int, heads: int, ring_degree: int = 1) -> str:
    sp = ulysses_degree * ring_degree
    pairs = " or ".join(f"--ulysses-degree {u} --ring-degree {r}" for u, r in usp_pairs(heads, sp))
    return (
        f"ulysses_degree={ulysses_degree} does not divide the model's {heads} attention heads; use one of "
        f"{divisors(heads)}, and ring attention for the rest: for {sp} sequence-parallel ranks "
        f"(ulysses_degree x ring_degree), {pairs}"
    )
