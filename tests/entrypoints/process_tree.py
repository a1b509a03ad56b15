"""Which processes a process started, and whether they are gone: for the worker-lifetime tests."""

from __future__ import annotations

import time
from pathlib import Path

from server_process import process_alive


def children_of(pid: int) -> list[int]:
    """Every process whose parent is `pid` (workers and multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                found.append(int(entry.name))
    return found


def still_alive_after(pids: list[int], seconds: float) -> list[str]:
    """The command lines of `pids` still running once `seconds` passed (polling; returns early when none is)."""
    deadline = time.monotonic() + seconds
    while any(map(process_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.05)
    alive = []
    for pid in filter(process_alive, pids):
        try:
            alive.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass  # gone in between
    return alive
