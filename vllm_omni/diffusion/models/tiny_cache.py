"""Build-once cache for the tiny embedded models (tests and the default demo run on them).

Each family's tiny.py knows how to write a complete diffusers folder; this module decides
where it lives (`$VLLM_OMNI_CACHE/tiny/NAME-VERSION`, default ~/.cache/vllm_omni) and builds
it once, safely when several processes (SP workers, test runs) ask at the same time.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import tempfile
from collections.abc import Callable

from vllm_omni import envs


def cache_root(cache_dir: str | None = None) -> pathlib.Path:
    if cache_dir is None:
        cache_dir = os.environ.get(envs.CACHE) or os.path.join("~", ".cache", "vllm_omni")
    return pathlib.Path(cache_dir).expanduser()


def cached_tiny_model(
    name: str,
    version: str,
    build: Callable[[str, pathlib.Path], None],
    cache_dir: str | None = None,
    marker: str = "model_index.json",
) -> pathlib.Path:
    """The cached folder of tiny model `name` ("tiny/x"), built by `build(name, folder)` on first use; the folder
    is complete once it holds `marker` (a tiny adapter's is its weights file).

    Concurrent callers may both build; each builds into its own temporary folder next to the
    target and renames it into place, and the loser of the rename discards its copy.
    """
    target = cache_root(cache_dir) / "tiny" / f"{name.split('/', 1)[1]}-{version}"
    if (target / marker).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent))
    try:
        build(name, tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache folder should read like any other
        try:
            os.rename(tmp, target)
        except OSError:
            # Another process finished first (the target is now a non-empty folder).
            if not (target / marker).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
