"""The checks every family passes, in one place; each family's test files call them with their own inputs, cases and
tolerances (as diffusers' ModelTesterMixin, without the class).

Transformers (tests/diffusion/models/test_<family>_transformer.py):
- one process: a checkpoint saved by the diffusers class, loaded by ours, gives the reference's output and has its
  parameter names (and config);
- under Ulysses on the gloo pools (tests/sp_pool.py, 2 and 3 ranks): at padded sizes the exact modes (mask, trim)
  equal one process and are silent; what the padding holds never reaches a real token; unmasked padding ("none")
  is close but not equal and warns once, naming the degree; where nothing pads, "none" is exact;
- under ring attention (USP) on the ring pools (ring 2, ring 3, Ulysses 2 x ring 2): the same, in one check
  (`assert_ring_conformance`), at sizes whose padding lands inside a ring block.
A family hands the SP checks an `SPForward`: `(mode, random_padding) -> [(output, warnings logged), per rank]`,
usually `lambda mode, noisy: sp_pool.run(sp_forward, folder, case, mode, random_padding=noisy)`.

Whole engines (tests/entrypoints/test_omni_<family>.py): the engines a module shares, and unmasked padding through
`Omni`, close to one process, the same at every call, and warned once by each worker.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable

import numpy as np
import pytest
import torch

SPForward = Callable[[str, bool], list[tuple[object, list[str]]]]
EXACT_MODES = ("mask", "trim")
ATOL = 1e-5  # fp32, the same weights: a few ulps of reassociation


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float = ATOL) -> None:
    torch.testing.assert_close(actual, expected, rtol=0, atol=atol)


def save_reference(reference: torch.nn.Module, folder, scale: float = 0.02) -> torch.nn.Module:
    """Move every weight of `reference` off its initial value by noise of `scale` (modulations, norms, pad tokens: no
    path is trivially zero) and save it to `folder`, the checkpoint both classes load. Returns `reference`."""
    with torch.no_grad():
        for p in reference.parameters():
            p.add_(torch.randn_like(p) * scale)
    reference.save_pretrained(folder)
    return reference


def load_pair(reference_class, our_class, folder) -> tuple[torch.nn.Module, torch.nn.Module]:
    """The reference and ours from one checkpoint, in eval mode."""
    return reference_class.from_pretrained(folder).eval(), our_class.from_pretrained(folder).eval()


def checkpoint_fixture(reference_class, config: dict, name: str):
    """A module fixture `checkpoint`: the folder of a reference built from `config` (seed 0), saved by
    `save_reference`."""

    @pytest.fixture(scope="module")
    def checkpoint(tmp_path_factory) -> str:
        torch.manual_seed(0)
        folder = tmp_path_factory.mktemp(name)
        save_reference(reference_class(**config).eval(), folder)
        return str(folder)

    return checkpoint


def models_fixture(reference_class, our_class):
    """A module fixture `models`: (reference, ours) loaded from the module's `checkpoint`."""

    @pytest.fixture(scope="module")
    def models(checkpoint):
        return load_pair(reference_class, our_class, checkpoint)

    return models


def public_config(config) -> dict:
    """A config without its private keys, through JSON (tuples read back as lists), as a saved config.json holds it."""
    return json.loads(json.dumps({k: v for k, v in config.items() if not k.startswith("_")}))


def assert_parameter_names_are_the_checkpoints(ref: torch.nn.Module, ours: torch.nn.Module, config: str | None) -> None:
    """The same state-dict names in the same order (the checkpoint's contract), and the same config: "all" of it,
    its "public" keys as saved, or None (not compared)."""
    assert list(ref.state_dict()) == list(ours.state_dict())
    if config == "all":
        assert dict(ref.config) == dict(ours.config)
    elif config == "public":
        assert public_config(ours.config) == public_config(ref.config)
    else:
        assert config is None, config


def assert_sp_exact_modes_match(sp: SPForward, expected, compare: Callable = assert_close, silent: bool = True) -> None:
    """Mask and trim equal one process on every rank (`compare(output, expected)`); `silent`: and log no warning."""
    for mode in EXACT_MODES:
        for out, warnings in sp(mode, False):
            compare(out, expected)
            if silent:
                assert warnings == []


def assert_sp_padding_content_never_reaches_real_tokens(sp: SPForward, mode: str, equal: Callable = torch.equal):
    """Random values in the padding (and what travels with it) give the same bits as zeros, on every rank."""
    clean, noisy = sp(mode, False), sp(mode, True)
    for (a, _), (b, _) in zip(clean, noisy):
        assert equal(a, b)


def assert_sp_padding_hook_changes_unmasked_output(sp: SPForward, clean: list | None = None) -> None:
    """The hook really writes the padding: in none mode random padding changes real tokens (`clean`: the none-mode
    results already at hand)."""
    for (a, _), (b, _) in zip(clean or sp("none", False), sp("none", True)):
        assert not torch.equal(a, b)


def assert_sp_unmasked_padding_is_close_but_not_equal(
    sp: SPForward,
    expected: torch.Tensor,
    world_size: int | None,
    once: bool = False,
    part: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> list:
    """None mode at a padded size: every rank's output is off, by less than half the output's scale (`part`: the
    rows that see the padding). With `world_size`, each rank warned once, naming the degree; with `once`, the next
    forward is silent. Returns the first forward's results."""
    results = sp("none", False)
    for out, warnings in results:
        diff = (part(out) - part(expected)).abs().max().item()
        assert 0 < diff < 0.5 * expected.abs().max().item()
        if world_size is not None:
            assert len(warnings) == 1 and "unmasked SP padding" in warnings[0]
            assert f"ulysses_degree={world_size}" in warnings[0]
    if once:  # once per process
        assert all(warnings == [] for _, warnings in sp("none", False))
    return results


def assert_sp_none_mode_exact_without_padding(
    sp: SPForward, expected, silent: bool, compare: Callable = assert_close
) -> None:
    """Where no stream pads, none mode equals one process; `silent`: and warns nothing."""
    for out, warnings in sp("none", False):
        compare(out, expected)
        if silent:
            assert warnings == []


def assert_ring_conformance(
    sp: SPForward,
    expected,
    ring_degree: int | None,
    compare: Callable = assert_close,
    equal: Callable = torch.equal,
    part: Callable[[torch.Tensor], torch.Tensor] = lambda t: t,
) -> None:
    """Ring attention at a padded size: mask and trim equal one process (and are silent); random padding gives the
    same bits as zeros (trim); unmasked padding is close but not equal, and, given the `ring_degree` (the forward
    records its warnings, and forgets those given once before), warns once naming it."""
    assert_sp_exact_modes_match(sp, expected, compare, silent=ring_degree is not None)
    assert_sp_padding_content_never_reaches_real_tokens(sp, "trim", equal)
    results = assert_sp_unmasked_padding_is_close_but_not_equal(sp, expected, None, part=part)
    if ring_degree is not None:
        for _, warnings in results:
            assert len(warnings) == 1 and f"ring_degree={ring_degree}" in warnings[0], warnings


# ---- whole engines ------------------------------------------------------------------------------


def engines_fixture(model: str):
    """A module fixture `engines`: `engines(degree=1, mode="trim", cfg=1)` gives `model`'s `Omni` engine, started on
    first use and shared by the module's tests (tests/entrypoints/conftest.py's `omni_engines`)."""

    @pytest.fixture(scope="module")
    def engines(omni_engines):
        return functools.partial(omni_engines, model)

    return engines


def generator(prompt: str, **defaults) -> Callable[..., np.ndarray]:
    """`generate(omni, **fields)`: `prompt`'s outputs from `omni`, stacked; the module's `defaults` unless given."""

    def generate(omni, **fields) -> np.ndarray:
        return np.stack(omni.generate(prompt, **(defaults | fields)))

    return generate


def assert_engine_unmasked_padding_warns_once_per_worker(outputs: list, expected: np.ndarray, err: str) -> None:
    """`outputs` of one Ulysses-2 engine without trim, called in a row: all the same, close to one process but not
    equal, and its stderr `err` holds one unmasked-padding warning from each of its two workers."""
    for output in outputs[1:]:
        np.testing.assert_array_equal(output, outputs[0])
    diff = float(np.abs(outputs[0] - expected).max())
    assert 0 < diff < 0.5, diff
    warnings = [line for line in err.splitlines() if "unmasked SP padding" in line]
    assert sorted(re.search(r"\[(omni-worker-\d)", w).group(1) for w in warnings) == ["omni-worker-0", "omni-worker-1"]
