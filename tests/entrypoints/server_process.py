"""A real `vllm-omni serve` process for the serving tests: start, wait on /health, read its log, stop.

The server runs as a subprocess on 127.0.0.1 and a free port, CPU workers with one thread each,
its stdout and stderr in one log file the tests read (step breakdown, auto-pad lines, request
log). Used by the test_serve_*.py modules and test_vllm_cli.py.
"""

from __future__ import annotations

import base64
import hashlib
import io
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import time
from pathlib import Path

import httpx
from PIL import Image

from vllm_omni import envs

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 240.0  # generous: the first run also builds the tiny model
HTTP_TIMEOUT_S = 180.0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def server_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["VLLM_OMNI_CPU_THREADS"] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH", "")) if p)
    env.pop("VLLM_API_KEY", None)
    env[envs.WORKER_MULTIPROC_METHOD] = "spawn"  # a server's workers start as they ship (tests/conftest.py)
    env.update(extra)
    return env


def omni_command(*args: str, python: str = sys.executable) -> list[str]:
    return [python, "-m", "vllm_omni.entrypoints.cli.main", *args]


def sha256(data: bytes) -> str:
    """A digest to compare files by: a failed assert shows two lines, not a diff of two MP4s."""
    return hashlib.sha256(data).hexdigest()


def decode_image(b64: str) -> Image.Image:
    return Image.open(io.BytesIO(base64.b64decode(b64)))


class ServerProcess:
    """One server subprocess. `command` gets `--host 127.0.0.1 --port P` appended; `verify` is the SSL context of
    an HTTPS server (its URL then starts with https)."""

    def __init__(
        self,
        command: list[str],
        log_path: Path,
        env: dict[str, str] | None = None,
        verify: ssl.SSLContext | None = None,
    ) -> None:
        self.port = free_port()
        self.verify = verify or True
        self.url = f"{'https' if verify else 'http'}://127.0.0.1:{self.port}"
        self.log_path = log_path
        self._log = open(log_path, "wb")
        self.proc = subprocess.Popen(
            [*command, "--host", "127.0.0.1", "--port", str(self.port)],
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=env or server_env(),
            cwd=log_path.parent,
            start_new_session=True,  # its own process group: teardown can always end it and its workers
        )

    # ---- log --------------------------------------------------------------------------------

    def log(self, start: int = 0) -> str:
        return self.log_path.read_bytes()[start:].decode(errors="replace")

    def log_size(self) -> int:
        return self.log_path.stat().st_size

    def wait_for_log(self, pattern: str, start: int = 0, timeout: float = HTTP_TIMEOUT_S) -> re.Match:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            match = re.search(pattern, self.log(start))
            if match:
                return match
            if self.proc.poll() is not None:
                break
            time.sleep(0.1)
        raise AssertionError(f"{pattern!r} not in the server log:\n{self.log(start)[-4000:]}")

    def wait_past(self, pattern: str, start: int = 0, timeout: float = HTTP_TIMEOUT_S) -> int:
        """Like `wait_for_log`; returns the log offset just past the match."""
        match = self.wait_for_log(pattern, start, timeout)
        return start + len(match.string[: match.end()].encode())

    # ---- lifecycle ----------------------------------------------------------------------------

    def first_health(self) -> httpx.Response:
        """The first answer /health gives once the port is open."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                return httpx.get(f"{self.url}/health", timeout=5, verify=self.verify)
            except httpx.TransportError:
                time.sleep(0.05)
        raise AssertionError(f"server did not open its port:\n{self.log()[-4000:]}")

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if httpx.get(f"{self.url}/health", timeout=5, verify=self.verify).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        raise AssertionError(f"server not ready in {START_TIMEOUT_S} s:\n{self.log()[-4000:]}")

    def wait_exit(self, timeout: float = 60) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"server did not exit within {timeout} s:\n{self.log()[-4000:]}") from None

    def terminate(self, timeout: float = 60) -> int:
        """SIGTERM, then the exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.wait_exit(timeout)

    def kill(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # the group this process leads: itself and its workers
        except ProcessLookupError:
            pass
        self.proc.wait(timeout=30)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.terminate()
            except AssertionError:
                pass
        self._log.close()

    def worker_pids(self) -> list[int]:
        """The engine's worker processes (multiprocessing spawn children of the server)."""
        pids = []
        for entry in Path("/proc").iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
                cmdline = (entry / "cmdline").read_bytes()
            except OSError:
                continue
            ppid = int(stat.rsplit(")", 1)[1].split()[1])
            if ppid == self.proc.pid and b"spawn_main" in cmdline:
                pids.append(int(entry.name))
        return sorted(pids)


def open_request(url: str, path: str, body: dict, headers: dict[str, str] | None = None) -> socket.socket:
    """Send a JSON POST on a raw socket and leave it open: closing it is a client disconnect."""
    host, port = url.removeprefix("http://").split(":")
    payload = json.dumps(body).encode()
    lines = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", "Content-Type: application/json"]
    lines += [f"{k}: {v}" for k, v in (headers or {}).items()]
    lines.append(f"Content-Length: {len(payload)}")
    sock = socket.create_connection((host, int(port)))
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode() + payload)
    return sock


def process_alive(pid: int) -> bool:
    """Running (a zombie waiting to be reaped does not count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def start_server(args: list[str], log_path: Path, verify: ssl.SSLContext | None = None, **env: str) -> ServerProcess:
    """`vllm-omni serve ARGS`, started and ready (`verify`: the SSL context of an HTTPS server)."""
    server = ServerProcess(omni_command("serve", *args), log_path, server_env(**env), verify)
    try:
        server.wait_ready()
    except BaseException:
        server.close()
        raise
    return server
