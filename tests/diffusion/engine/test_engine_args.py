"""`EngineArgs`: every option is a `serve`/`generate` flag, a deploy-YAML key and an `Omni` keyword, and
nothing else is; unknown names are refused naming them; a check across options reads the same from every face."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from vllm_omni.diffusion.config import (
    ATTENTION_BACKENDS,
    Admission,
    BatchingConfig,
    DiffusionParallelConfig,
    EngineLimits,
    OmniDiffusionConfig,
    StepCacheConfig,
)
from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS
from vllm_omni.entrypoints.cli.main import build_parser
from vllm_omni.entrypoints.cli.serve import engine_args_from_cli
from vllm_omni.entrypoints.deploy_config import DeployConfigError, load_deploy_config
from vllm_omni.entrypoints.omni import Omni

MODEL = "tiny/qwen-image"
OPTIONS = set(EngineArgs.option_names())
SERVER_ONLY = set(EngineArgs.server_only_names())
# The flags that are no engine option: the model, the deploy file, and the server's own settings.
# tensor_parallel_size: vLLM's flag, accepted as 1 and refused above it (no engine option).
COMMON_DESTS = {"help", "model", "deploy_config", "tensor_parallel_size"}
SERVER_DESTS = {"host", "port", "served_model_name", "api_key", "body_read_timeout", "max_body_reads"}
SERVER_DESTS |= {"video_dir", "video_max_age", "video_max_bytes", "video_max_videos"}
SERVER_DESTS |= {"root_path", "ssl_keyfile", "ssl_certfile", "uvicorn_log_level", "disable_log_requests"}
SERVER_DESTS |= {"allowed_origins", "allowed_methods", "allowed_headers", "allow_credentials"}
GENERATE_DESTS = {"prompt", "image", "size", "output"} | {f.name for f in SAMPLING_FIELDS if not f.in_size}


def _command(name: str):
    parser = build_parser()
    return next(a for a in parser._subparsers._actions if a.dest == "command").choices[name]


def _write(tmp_path, stage: dict):
    path = tmp_path / "deploy.yaml"
    path.write_text(yaml.safe_dump({"stages": [{"stage_id": 0, **stage}]}))
    return path


def _stage(values: dict[str, object]) -> dict:
    """A deploy stage that sets `values` (options by name), each at its key from `EngineArgs.yaml_keys`."""
    stage: dict = {}
    for section, keys in EngineArgs.yaml_keys().items():
        for key, name in keys.items():
            if name in values:
                (stage if section is None else stage.setdefault(section, {}))[key] = values[name]
    return stage


@pytest.mark.parametrize(
    "command,options,others",
    [("serve", OPTIONS, SERVER_DESTS), ("generate", OPTIONS - SERVER_ONLY, GENERATE_DESTS - {"priority"})],
)
def test_every_option_is_a_flag_of_serve_and_generate_and_no_other_flag_is(command, options, others):
    """serve has every option; generate every one but those only a server uses (and no request's queue priority)."""
    actions = {a.dest: a for a in _command(command)._actions}
    assert options <= set(actions), options - set(actions)
    assert set(actions) <= options | COMMON_DESTS | others, set(actions) - (options | COMMON_DESTS | others)
    for name in options:
        assert actions[name].option_strings and actions[name].default is None, name  # None: "not given"


def test_generate_help_offers_nothing_only_a_server_uses():
    text = _command("generate").format_help()
    for words in ("--allow-runtime-lora", "--max-queue", "429", "--max-num-seqs", "--data-parallel-size"):
        assert words not in text, words
    for words in ("--scheduling-policy", "--max-batch-size", "--batch-wait-ms", "--priority", "server started with"):
        assert words not in text, words
    assert SERVER_ONLY >= {"allow_runtime_lora", "max_queue", "max_num_seqs", "data_parallel_size", "warmup"}


def test_help_shows_the_choices_and_ranges_and_every_packaged_deploy():
    from vllm_omni.diffusion.attention.backends import BACKENDS
    from vllm_omni.entrypoints.deploy_config import PACKAGED_DIR

    assert ATTENTION_BACKENDS == tuple(BACKENDS)  # the torch-free list the flag offers is the kernels'
    actions = {a.dest: a for a in _command("serve")._actions}
    assert tuple(actions["attention_backend"].choices) == ATTENTION_BACKENDS
    assert "X>0" in actions["cache_threshold"].metavar
    help_text = " ".join(actions["deploy_config"].help.split())
    for path in PACKAGED_DIR.glob("*.yaml"):
        assert path.stem in help_text, path.stem


def test_every_option_is_a_deploy_yaml_key_and_no_other_key_is(tmp_path):
    keys = EngineArgs.yaml_keys()
    assert sorted(name for section in keys.values() for name in section.values()) == sorted(OPTIONS)
    # Each option with a value by default, written at its key, comes back as that option.
    defaults = {f.name: f.default for f in EngineArgs.options() if f.default is not None}
    assert load_deploy_config(_write(tmp_path, _stage(defaults))).options == defaults


@pytest.mark.parametrize("section", ["parallel_config", "limits", "batching", "cache", None])
def test_a_yaml_key_that_is_no_option_is_an_error_naming_the_key_and_the_file(tmp_path, section):
    stage = {"made_up_option": 1} if section is None else {section: {"made_up_option": 1}}
    path = _write(tmp_path, stage)
    with pytest.raises(DeployConfigError, match="unknown .*'made_up_option'") as raised:
        load_deploy_config(path)
    assert str(path) in str(raised.value)


def test_every_option_is_an_omni_keyword_and_an_unknown_one_is_a_type_error_naming_it():
    defaults = {f.name: f.default for f in EngineArgs.options()}
    assert EngineArgs.from_kwargs(MODEL, **defaults) == EngineArgs(MODEL)
    with pytest.raises(TypeError, match="ulysses_degre\\b"):
        Omni(MODEL, ulysses_degre=2)  # refused before any worker starts
    with pytest.raises(TypeError, match="model_path"):
        EngineArgs.from_kwargs(MODEL, ulysses_degree=2, model_path="x")


def test_one_value_given_by_flag_yaml_or_keyword_makes_the_same_engine_args(tmp_path):
    flags = ["--ulysses-degree", "2", "--no-trim-sp-padding", "--dtype", "bf16", "--warmup-size", "64x32"]
    flags += ["--max-steps", "12", "--max-queue", "3", "--cache", "first_block", "--cache-threshold", "0.3"]
    flags += ["--scheduling-policy", "priority"]
    values = dict(ulysses_degree=2, trim_sp_padding=False, dtype="bfloat16", warmup_size=(64, 32))
    values |= dict(max_steps=12, max_queue=3, cache="first_block", cache_threshold=0.3, scheduling_policy="priority")
    by_flags, _ = engine_args_from_cli(build_parser().parse_args(["serve", MODEL, *flags]))
    path = _write(tmp_path, _stage(dict(values, warmup_size=[64, 32])))
    by_yaml, _ = engine_args_from_cli(build_parser().parse_args(["serve", MODEL, "--deploy-config", str(path)]))
    by_keywords = EngineArgs.from_kwargs(MODEL, **values)
    assert by_flags == by_yaml == by_keywords
    assert by_keywords.step_cache == StepCacheConfig("first_block", 0.3) and by_keywords.limits.max_queue == 3
    assert by_keywords.engine_config().scheduling_policy == "priority"


@pytest.mark.parametrize(
    "values,words",
    [
        ({"cache": "first_block", "max_batch_size": 4}, "a batch's rows would share one step cache"),
        ({"lora_modules": "a=/adapters/a", "quantization": "fp8"}, "which FP8 holds in 8 bits"),
        ({"lora_modules": "a=/adapters/a", "cpu_offload": "model"}, "offload moves between devices"),
    ],
    ids=["cache-and-batching", "lora-and-fp8", "lora-and-offload"],
)
def test_a_check_across_options_fires_with_the_same_words_from_cli_yaml_and_omni(tmp_path, values, words):
    flags = []
    for name, value in values.items():
        flags += ["--" + name.replace("_", "-"), str(value)]
    path = _write(tmp_path, _stage(values))
    faces = {
        "cli": lambda: engine_args_from_cli(build_parser().parse_args(["serve", MODEL, *flags])),
        "yaml": lambda: engine_args_from_cli(build_parser().parse_args(["serve", MODEL, "--deploy-config", str(path)])),
        "omni": lambda: Omni(MODEL, **values),  # refused before any worker starts
    }
    messages = {}
    for face, start in faces.items():
        with pytest.raises(ValueError, match=words) as raised:
            start()
        messages[face] = str(raised.value)
    assert len(set(messages.values())) == 1, messages


def test_the_defaults_are_the_configs_own():
    args = EngineArgs(MODEL)
    assert args.parallel_config == DiffusionParallelConfig() and args.limits == EngineLimits()
    assert args.batching == BatchingConfig() and args.step_cache is None
    # The rows a forward may hold (max_n); the engine adds the tokens it must admit.
    assert args.engine_config() == OmniDiffusionConfig(MODEL, admission=Admission(0, 0, EngineLimits().max_n))
    assert args.engine_config(replica=1).replica == 1


def test_the_earlier_shorthands_of_omni_still_set_the_options():
    args = EngineArgs.from_kwargs(MODEL, limits=EngineLimits(max_steps=9), cache=StepCacheConfig(threshold=0.2))
    assert args.max_steps == 9 and args.step_cache == StepCacheConfig("first_block", 0.2)
    with pytest.raises(ValueError, match="cache_threshold goes inside the StepCacheConfig"):
        EngineArgs.from_kwargs(MODEL, cache=StepCacheConfig(), cache_threshold=0.3)
    with pytest.raises(ValueError, match="--cache-threshold needs a cache"):
        EngineArgs.from_kwargs(MODEL, cache_threshold=0.3)


def test_engine_args_import_neither_torch_nor_the_server_and_are_exported():
    script = "import sys\nfrom vllm_omni import EngineArgs\nEngineArgs('m').engine_config()\n"
    # The families' specs too (each package's spec.py, through the registry), as the engine reads a model.
    script += "import vllm_omni.diffusion.model_source, vllm_omni.diffusion.models.registry\n"
    script += "print(sorted(m for m in ('torch', 'fastapi', 'diffusers') if m in sys.modules))\n"
    repo = Path(__file__).resolve().parents[3]
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120, cwd=repo)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"
    assert dataclasses.is_dataclass(EngineArgs)
