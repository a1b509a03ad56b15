"""The private diffusers (and transformers) names we use (vllm_omni/diffusion/diffusers_compat.py): each exists on
the pinned diffusers, so an upgrade that renames one fails here rather than serving a wrong image; and no other
module of the package spells one."""

from __future__ import annotations

import importlib
import pathlib
import re

import pytest
import torch

import vllm_omni
from vllm_omni.diffusion import diffusers_compat
from vllm_omni.diffusion.diffusers_compat import PRIVATE_NAMES


def _instance_attribute_holders() -> dict[str, object]:
    """Instances for the names diffusers sets in `__init__` (not on the class)."""
    from diffusers.guiders import ClassifierFreeGuidance
    from diffusers.hooks import HookRegistry
    from diffusers.hooks.hooks import StateManager

    module = torch.nn.Linear(1, 1)
    HookRegistry.check_if_exists_or_initialize(module)  # sets the module's registry attribute
    return {"StateManager": StateManager(dict), "BaseGuidance": ClassifierFreeGuidance(), "HookRegistry": module}


@pytest.mark.parametrize(("module", "owner", "name"), PRIVATE_NAMES, ids=[f"{o or m}.{n}" for m, o, n in PRIVATE_NAMES])
def test_each_private_name_exists_on_the_pinned_diffusers(module, owner, name):
    target = importlib.import_module(module)
    if owner:
        target = getattr(target, owner)
    holders = _instance_attribute_holders()
    assert hasattr(target, name) or (owner in holders and hasattr(holders[owner], name)), f"{module}.{owner}.{name}"


def test_no_other_module_spells_a_private_diffusers_name():
    names = {name for _, _, name in PRIVATE_NAMES}
    package = pathlib.Path(vllm_omni.__file__).parent
    alternatives = "|".join(names)
    pattern = re.compile(rf"\.({alternatives})\b|[\"']({alternatives})[\"']")
    offenders = [
        f"{path.relative_to(package.parent)}:{number}"
        for path in package.rglob("*.py")
        if path.name != "diffusers_compat.py"
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if not line.lstrip().startswith("#") and pattern.search(line.split("#")[0])
    ]
    assert not offenders, offenders


def test_the_accessors_read_what_diffusers_keeps():
    from diffusers.hooks import HookRegistry

    module = torch.nn.Linear(1, 1)
    assert diffusers_compat.hook_registry(module) is None
    registry = HookRegistry.check_if_exists_or_initialize(module)
    assert diffusers_compat.hook_registry(module) is registry
    from diffusers.hooks.hooks import StateManager

    manager = StateManager(dict)
    assert diffusers_compat.manager_state(manager) == ({}, None)
    diffusers_compat.set_manager_state(manager, {"a": 1}, "cond")
    assert diffusers_compat.manager_state(manager) == ({"a": 1}, "cond")
