"""docs/serving.md's lists that the code owns: the tiny models (registry TINY_MODELS), the tiny LoRA adapters,
the packaged deploy configs (vllm_omni/deploy/*.yaml) and the environment variables a user sets (envs.py). Each list
names every one and nothing else."""

from __future__ import annotations

import re
from pathlib import Path

from vllm_omni import envs
from vllm_omni.diffusion.models.registry import TINY_MODELS
from vllm_omni.diffusion.models.tiny_lora import tiny_adapters
from vllm_omni.entrypoints.deploy_config import PACKAGED_DIR

SERVING = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()


def _quoted(text: str) -> list[str]:
    return re.findall(r"`([^`]+)`", text)


def _between(start: str, end: str) -> str:
    """The docs' text from `start` up to the first `end` after it."""
    head = SERVING.index(start)
    return SERVING[head : SERVING.index(end, head)]


def test_serving_docs_name_every_tiny_model():
    listed = _quoted(_between("`MODEL` is a tiny embedded model (", "; built on first use"))[1:]  # after `MODEL`
    assert listed == list(TINY_MODELS), f"write: {', '.join(f'`{name}`' for name in TINY_MODELS)}"


def test_serving_docs_name_every_tiny_adapter():
    listed = [
        name for name in _quoted(_between("`PATH` may also name a tiny adapter", "are built once")) if "/" in name
    ]
    assert listed == [item for pair in tiny_adapters().items() for item in pair]


def test_serving_docs_name_every_packaged_deploy_config():
    row = _between("| `--deploy-config PATH` |", "\n")
    packaged = sorted(path.stem for path in PACKAGED_DIR.glob("*.yaml"))
    assert sorted(_quoted(row.split("by name:", 1)[1])) == packaged, f"write: {', '.join(packaged)}"


def test_serving_docs_name_every_environment_variable_a_user_sets():
    paragraph = _between("Environment (`vllm_omni/envs.py` declares ours)", "\n\n")
    listed = [name.split("=")[0] for name in _quoted(paragraph) if name.startswith(envs.PREFIX)]
    assert listed == list(envs.USER_VARIABLES), f"write: {', '.join(f'`{name}`' for name in envs.USER_VARIABLES)}"
