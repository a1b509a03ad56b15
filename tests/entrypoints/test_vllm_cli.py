"""`vllm serve tiny/qwen-image --omni --ulysses-degree 2` through vLLM's real CLI.

vLLM lives in its own virtualenv outside the clone (default ~/.cache/vllm_omni/vllm-venv, or
$VLLM_OMNI_VLLM_VENV), so its torch pin never touches the test environment. The first run
creates it (`pip install vllm`: minutes, about 10 GB), later runs reuse it; this clone is then
installed into it in editable mode without letting pip change vLLM's torch. The test skips
only where vLLM cannot be installed, and says why. Run it alone with `pytest -m vllm`.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from server_process import HTTP_TIMEOUT_S, REPO, ServerProcess, decode_image, server_env

VENV = Path(os.environ.get("VLLM_OMNI_VLLM_VENV", "~/.cache/vllm_omni/vllm-venv")).expanduser()
VLLM_INSTALL_TIMEOUT_S = 3600
NEEDS_FREE_BYTES = 12 * 1024**3  # vLLM with its CUDA wheels is about 9.5 GB


def _python(code: str) -> subprocess.CompletedProcess:
    # cwd=/ so that the clone in the working directory cannot shadow what is installed.
    return subprocess.run(
        [str(VENV / "bin" / "python"), "-c", code], capture_output=True, text=True, cwd="/", timeout=300
    )


def _pip(*args: str, timeout: float) -> subprocess.CompletedProcess:
    return subprocess.run(
        [str(VENV / "bin" / "python"), "-m", "pip", *args], capture_output=True, text=True, timeout=timeout
    )


def _tail(result: subprocess.CompletedProcess) -> str:
    return (result.stdout + result.stderr)[-2000:]


def _vllm_importable() -> bool:
    return (VENV / "bin" / "python").exists() and _python("import vllm.entrypoints.cli.main").returncode == 0


def _install_vllm() -> None:
    """Create the virtualenv and pip install vllm; skip (saying why) if that cannot be done here."""
    VENV.parent.mkdir(parents=True, exist_ok=True)
    if shutil.disk_usage(VENV.parent).free < NEEDS_FREE_BYTES:
        pytest.skip(f"vLLM cannot be installed here: it needs about 10 GB free under {VENV.parent}")
    if not (VENV / "bin" / "python").exists():
        made = subprocess.run([sys.executable, "-m", "venv", str(VENV)], capture_output=True, text=True)
        if made.returncode != 0:
            pytest.skip(f"vLLM cannot be installed here: cannot create a virtualenv at {VENV}: {_tail(made)}")
    result = _pip("install", "vllm", timeout=VLLM_INSTALL_TIMEOUT_S)
    if result.returncode != 0 or not _vllm_importable():
        pytest.skip(f"vLLM cannot be installed here (pip install vllm failed):\n{_tail(result)}")


def _install_this_clone() -> None:
    """Editable install of this clone into the vLLM venv, with vLLM's torch pinned as it is."""
    where = _python("import os, vllm_omni; print(os.path.dirname(os.path.abspath(vllm_omni.__file__)))")
    if where.returncode == 0 and Path(where.stdout.strip()) == REPO / "vllm_omni":
        return
    # The distribution's version (torch.__version__ may carry a build label pip cannot match).
    torch_version = _python("from importlib.metadata import version; print(version('torch'))").stdout.strip()
    assert torch_version, "vLLM's virtualenv has no torch"
    pins = VENV / "omni-constraints.txt"
    pins.write_text(f"torch=={torch_version}\n")
    result = _pip("install", "-e", str(REPO), "-c", str(pins), timeout=1800)
    assert result.returncode == 0, f"installing this clone next to vLLM failed:\n{_tail(result)}"
    assert _python("from importlib.metadata import version; print(version('torch'))").stdout.strip() == torch_version


@pytest.fixture(scope="module")
def vllm_executable() -> Path:
    VENV.parent.mkdir(parents=True, exist_ok=True)
    with open(VENV.parent / f"{VENV.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # two test runs must not install into the same venv at once
        if not _vllm_importable():
            _install_vllm()
        _install_this_clone()
    return VENV / "bin" / "vllm"


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_hands_a_command_line_with_omni_to_our_parser(vllm_executable):
    env = server_env()
    env.pop("PYTHONPATH")
    result = subprocess.run(
        [str(vllm_executable), "serve", "tiny/qwen-image", "--omni", "--help"],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )
    assert result.returncode == 0, _tail(result)
    assert result.stdout.startswith("usage: vllm serve") and "--no-trim-sp-padding" in result.stdout


@pytest.mark.vllm
@pytest.mark.slow
def test_vllm_serve_with_omni_starts_our_server(vllm_executable, tmp_path):
    env = server_env()
    env.pop("PYTHONPATH")  # the venv's own (editable) install of this clone, as a user would have it
    command = [str(vllm_executable), "serve", "tiny/qwen-image", "--omni", "--ulysses-degree", "2"]
    server = ServerProcess(command, tmp_path / "server.log", env)
    try:
        server.wait_ready()
        response = httpx.post(
            f"{server.url}/v1/images/generations",
            json={"model": "tiny/qwen-image", "prompt": "a cat", "size": "272x208", "num_inference_steps": 2},
            timeout=HTTP_TIMEOUT_S,
        )
        assert response.status_code == 200, response.text
        assert decode_image(response.json()["data"][0]["b64_json"]).size == (272, 208)
        server.wait_for_log(r"DiffusionEngine\.step breakdown: preprocess=")
        assert "ulysses_degree=2" in server.log()
        assert server.terminate() == 0
    finally:
        server.close()
