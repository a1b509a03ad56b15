"""The README's "Offline, in Python" snippet, saved as a script exactly as written, runs; a script that makes an
`Omni` at its top level without `if __name__ == "__main__":` is refused in one line before any worker starts
(spawn runs the script again in every worker)."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
from PIL import Image
from server_process import REPO, server_env

pytestmark = pytest.mark.slow  # the README snippet as a script: whole engines


def readme_snippet() -> str:
    """The first fenced python block after the '## Offline, in Python' heading."""
    text = (REPO / "README.md").read_text()
    section = text.split("## Offline, in Python", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def run_script(folder, source: str) -> subprocess.CompletedProcess:
    (folder / "script.py").write_text(source)
    return subprocess.run(
        [sys.executable, "script.py"], cwd=folder, capture_output=True, text=True, timeout=600, env=server_env()
    )


def test_the_readme_snippet_runs_as_a_script(tmp_path):
    result = run_script(tmp_path, readme_snippet())
    assert result.returncode == 0, result.stderr[-4000:]
    with Image.open(tmp_path / "cat.png") as image:
        assert image.size == (272, 208)


def test_a_script_without_the_main_guard_is_refused_in_one_line_before_any_worker_starts(tmp_path):
    source = 'from vllm_omni import Omni\n\nomni = Omni("tiny/qwen-image", ulysses_degree=2)\n'
    result = run_script(tmp_path, source)
    assert result.returncode == 1
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("RuntimeError: ") and "script.py, line 3" in last
    assert 'put the code that makes the Omni under `if __name__ == "__main__":`' in last
    assert "Starting" not in result.stderr and "bootstrapping phase" not in result.stderr
