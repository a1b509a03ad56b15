"""The request fields are declared once (request_fields.py); every surface must carry exactly them.

A field added to the declaration and missing from a surface (or a surface growing a field the
declaration lacks) fails here, naming the field and the surface.
"""

from __future__ import annotations

import dataclasses
import inspect

import pytest
import yaml
from pydantic import ValidationError

from vllm_omni.diffusion.engine.request_fields import FIELDS_BY_NAME, SAMPLING_FIELDS
from vllm_omni.diffusion.models.registry import FAMILIES, REGISTRY
from vllm_omni.diffusion.models.spec import VIDEO_FIELDS
from vllm_omni.diffusion.request import GenerationParams
from vllm_omni.entrypoints.cli.generate import SERVER_ONLY_FIELDS
from vllm_omni.entrypoints.cli.main import build_parser
from vllm_omni.entrypoints.deploy_config import SAMPLING_PARAM_TYPES, load_deploy_config
from vllm_omni.entrypoints.omni import Omni
from vllm_omni.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    ImageEditRequest,
    ImageGenerationRequest,
    VideoCreateRequest,
)

DECLARED = set(FIELDS_BY_NAME)
IMAGE_FIELDS = {f.name for f in SAMPLING_FIELDS if not f.video_only}
NOT_SAMPLING = {"prompt", "image", "output_type", "request_id"}


def test_generation_params_has_exactly_the_declared_fields():
    names = {f.name for f in dataclasses.fields(GenerationParams)} - NOT_SAMPLING
    assert names == DECLARED


def test_http_image_bodies_carry_the_declared_image_fields():
    for model in (ImageGenerationRequest, ImageEditRequest):
        fields = set(model.model_fields)
        in_size = {f.name for f in SAMPLING_FIELDS if f.in_size}
        assert "size" in fields
        assert IMAGE_FIELDS - in_size <= fields, IMAGE_FIELDS - in_size - fields
        assert not fields & (VIDEO_FIELDS | in_size)  # frames belong to the videos API; sizes to `size`
        for f in SAMPLING_FIELDS:
            if f.name in fields:
                assert model.model_fields[f.name].annotation == (f.type | None), f.name


def test_http_video_body_carries_the_declared_fields_but_n():
    fields = set(VideoCreateRequest.model_fields)
    in_size = {f.name for f in SAMPLING_FIELDS if f.in_size}
    assert {"size", "seconds"} <= fields and not fields & (in_size | {"n"})  # one job is one video
    assert DECLARED - in_size - {"n"} <= fields, DECLARED - in_size - {"n"} - fields
    for f in SAMPLING_FIELDS:
        if f.name in fields:
            assert VideoCreateRequest.model_fields[f.name].annotation == (f.type | None), f.name


def test_cli_generate_has_a_flag_for_every_declared_field_but_a_servers_queue_order():
    parser = build_parser()
    generate = next(a for a in parser._subparsers._actions if a.dest == "command").choices["generate"]
    flags = {option: action for action in generate._actions for option in action.option_strings}
    assert SERVER_ONLY_FIELDS == {"priority"} and "--priority" not in flags
    for f in SAMPLING_FIELDS:
        if f.name in SERVER_ONLY_FIELDS:
            continue
        assert f.cli_flag in flags, f"{f.name}: no {f.cli_flag} flag"
        if not f.in_size:
            assert flags[f.cli_flag].dest == f.name
    args = parser.parse_args(["generate", "tiny/qwen-image", "--prompt", "p", "--num-frames", "9", "--fps", "8"])
    assert (args.num_frames, args.fps) == (9, 8)


def test_deploy_yaml_defaults_accept_every_declared_field_with_its_type():
    assert SAMPLING_PARAM_TYPES == {f.name: f.type for f in SAMPLING_FIELDS}


def test_omni_generate_takes_the_declared_fields_and_refuses_others():
    params = inspect.signature(Omni.generate).parameters
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    omni = Omni.__new__(Omni)  # no workers: the name check runs before the engine
    try:
        omni.generate("a cat", num_stepz=4)
    except TypeError as exc:
        assert "num_stepz" in str(exc) and "num_inference_steps" in str(exc)
    else:
        raise AssertionError("an unknown field was accepted")


def test_every_pipeline_spec_takes_only_declared_fields():
    for spec in REGISTRY.values():
        assert spec.fields <= DECLARED, (spec.diffusers_class, spec.fields - DECLARED)
        assert (spec.modality == "video") == bool(spec.fields & VIDEO_FIELDS), spec.diffusers_class
    for family in FAMILIES:
        assert family.tiny_models and set(family.tiny_models.values()) <= set(REGISTRY)


def test_priority_reaches_every_surface_as_any_integer(tmp_path):
    """vLLM's `priority` (lower first, may be negative): each HTTP surface carries it as given; the engine checks it
    (`generate` runs one request, with no queue to order: no flag)."""
    assert all(spec.takes("priority") for spec in REGISTRY.values())
    bodies = [
        ImageGenerationRequest(prompt="p", priority=-3),
        ImageEditRequest(prompt="p", priority=-3),
        ChatCompletionRequest(messages=[{"role": "user", "content": "p"}], priority=-3),
        VideoCreateRequest(prompt="p", priority=-3),
    ]
    assert [body.priority for body in bodies] == [-3] * 4
    with pytest.raises(ValidationError, match="expected a number"):
        ImageGenerationRequest(prompt="p", priority=True)
    deploy = tmp_path / "deploy.yaml"
    deploy.write_text(yaml.safe_dump({"stages": [{"stage_id": 0, "default_sampling_params": {"priority": -1}}]}))
    assert load_deploy_config(deploy).default_sampling_params == {"priority": -1}
    assert GenerationParams("p", priority=-2).priority == -2
    with pytest.raises(TypeError, match=r"unknown argument\(s\) num_stepz;"):  # priority is a known one
        Omni.__new__(Omni).generate("a cat", priority=1, num_stepz=4)
