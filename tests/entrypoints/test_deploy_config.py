"""Deploy YAML loading and the merge of YAML and flags (no processes started)."""

from __future__ import annotations

import os

import pytest

from vllm_omni.diffusion.config import StepCacheConfig
from vllm_omni.diffusion.engine.args import EngineArgs
from vllm_omni.diffusion.models.registry import REGISTRY
from vllm_omni.entrypoints.cli.main import build_parser
from vllm_omni.entrypoints.cli.serve import engine_args_from_cli
from vllm_omni.entrypoints.deploy_config import (
    DeployConfig,
    DeployConfigError,
    apply_sampling_defaults,
    load_deploy_config,
)

GOOD = """\
stages:
  - stage_id: 0
    devices: "0,1"
    parallel_config: {ulysses_degree: 2, mask_sp_padding: true}
    default_sampling_params: {num_inference_steps: 8, true_cfg_scale: 2.5}
"""


def write(tmp_path, text: str):
    path = tmp_path / "deploy.yaml"
    path.write_text(text)
    return path


@pytest.mark.parametrize(
    "name", ["qwen_image", "qwen_image_edit", "qwen_image_21", "hunyuan_video_15", "wan22_t2v_a14b"]
)
def test_packaged_deploys_load_by_name(name):
    deploy = load_deploy_config(name)
    assert deploy.path.name == f"{name}.yaml"
    assert deploy.options["ulysses_degree"] == 8 and deploy.devices == list(range(8))
    assert deploy.default_sampling_params["num_inference_steps"] == (
        40 if name.startswith(("wan", "qwen_image_21")) else 50
    )


@pytest.mark.parametrize(
    "text,key",
    [
        (GOOD + "extra: 1\n", "'extra'"),
        (GOOD.replace("stage_id: 0", "stage_id: 0\n    engine: x"), "'engine'"),
        (GOOD.replace("ulysses_degree: 2", "ulysses_degre: 2"), "'ulysses_degre'"),
        (GOOD.replace("num_inference_steps: 8", "num_steps: 8"), "'num_steps'"),
        (GOOD + "    limits: {max_framez: 9}\n", "'max_framez'"),
    ],
    ids=["top-level", "stage", "parallel_config", "default_sampling_params", "limits"],
)
def test_unknown_key_anywhere_is_an_error_naming_it(tmp_path, text, key):
    with pytest.raises(DeployConfigError, match=f"unknown .*{key}"):
        load_deploy_config(write(tmp_path, text))


@pytest.mark.parametrize(
    "text,words",
    [
        ("stages: []\n", "non-empty list"),
        (GOOD + GOOD.replace("stages:\n", ""), "single-stage"),
        (GOOD.replace('"0,1"', '"zero"'), "devices"),
        (GOOD.replace("num_inference_steps: 8", "num_inference_steps: 0"), "num_inference_steps must be >= 1"),
        (GOOD.replace("true_cfg_scale: 2.5", "true_cfg_scale: high"), "true_cfg_scale must be a number"),
        (GOOD.replace("ulysses_degree: 2", "ulysses_degree: 0"), "ulysses_degree must be a positive integer"),
        (GOOD.replace("mask_sp_padding: true", "mask_sp_padding: 3"), "mask_sp_padding must be a boolean"),
        ("stages: [\n", "cannot read it as YAML"),
        (GOOD + "    limits: {max_frames: 0}\n", "limits.max_frames must be a positive integer"),
    ],
)
def test_bad_values_are_errors_naming_the_key(tmp_path, text, words):
    with pytest.raises(DeployConfigError, match=words):
        load_deploy_config(write(tmp_path, text))


def test_missing_file_is_an_error_listing_the_packaged_ones():
    with pytest.raises(DeployConfigError, match="qwen_image, qwen_image_21, qwen_image_edit"):
        load_deploy_config("/nonexistent/deploy.yaml")


def resolved(tmp_path, *flags: str) -> tuple[EngineArgs, DeployConfig]:
    args = build_parser().parse_args(
        ["serve", "tiny/qwen-image", "--deploy-config", str(write(tmp_path, GOOD)), *flags]
    )
    return engine_args_from_cli(args)


def settings(tmp_path, *flags: str) -> EngineArgs:
    return resolved(tmp_path, *flags)[0]


def test_yaml_applies_where_no_flag_is_given(tmp_path):
    engine, deploy = resolved(tmp_path)
    assert engine.parallel_config.ulysses_degree == 2 and engine.parallel_config.mask_sp_padding is True
    assert deploy.default_sampling_params == {"num_inference_steps": 8, "true_cfg_scale": 2.5}
    assert deploy.devices == [0, 1]


def test_given_flags_override_the_yaml(tmp_path):
    resolved = settings(tmp_path, "--ulysses-degree", "3", "--no-mask-sp-padding", "--no-trim-sp-padding")
    parallel = resolved.parallel_config
    assert (parallel.ulysses_degree, parallel.sequence_parallel_size) == (3, 3)
    assert parallel.mask_sp_padding is False and parallel.trim_sp_padding is False
    assert parallel.padding_mode == "none"


def test_limit_flags_set_engine_limits(tmp_path):
    resolved = settings(tmp_path, "--max-steps", "12", "--max-queue", "3", "--max-upload-bytes", "1000")
    assert (resolved.limits.max_steps, resolved.limits.max_queue, resolved.limits.max_upload_bytes) == (12, 3, 1000)
    assert resolved.limits.max_n == 4  # untouched default


def test_the_tokens_per_step_limit_is_the_models_unless_the_yaml_or_a_flag_sets_it(tmp_path):
    spec = REGISTRY["HunyuanVideo15Pipeline"]
    limits = settings(tmp_path).limits
    assert limits.max_tokens_per_step is None
    assert limits.for_model(spec).max_tokens_per_step == spec.max_tokens_per_step == 131072
    yaml = str(write(tmp_path, GOOD + "    limits: {max_tokens_per_step: 200000}\n"))
    parse = build_parser().parse_args
    limits = engine_args_from_cli(parse(["serve", "tiny/qwen-image", "--deploy-config", yaml]))[0].limits
    assert limits.for_model(spec).max_tokens_per_step == 200000
    flags = ["serve", "tiny/qwen-image", "--deploy-config", yaml, "--max-tokens-per-step", "5000"]
    assert engine_args_from_cli(parse(flags))[0].limits.max_tokens_per_step == 5000


def test_deadline_flags_reach_the_engine_config_and_default_to_the_env(tmp_path, monkeypatch):
    monkeypatch.setenv("VLLM_OMNI_STALL_TIMEOUT_S", "42")
    config = settings(tmp_path, "--load-timeout", "1200", "--no-warmup").engine_config()
    assert (config.load_timeout_s, config.stall_timeout_s) == (1200.0, 42.0)
    config = settings(tmp_path, "--stall-timeout", "7.5").engine_config()
    assert config.stall_timeout_s == 7.5


@pytest.mark.parametrize("value", ["0", "-3", "soon", "inf"])
def test_a_deadline_flag_must_be_a_positive_number_of_seconds(tmp_path, value, capsys):
    with pytest.raises(SystemExit):
        settings(tmp_path, "--load-timeout", value)
    assert "positive number of seconds" in capsys.readouterr().err


def test_yaml_limits_apply_and_limit_flags_override_them(tmp_path):
    args = build_parser().parse_args(
        [
            "serve",
            "tiny/hunyuan-video-1.5",
            "--deploy-config",
            str(write(tmp_path, GOOD + "    limits: {max_frames: 61, max_steps: 20}\n")),
            "--max-steps",
            "12",
        ]
    )
    limits = engine_args_from_cli(args)[0].limits
    assert (limits.max_frames, limits.max_steps, limits.max_n) == (61, 12, 4)


@pytest.mark.parametrize(
    ("name", "pipeline", "size", "heads"),
    [
        ("hunyuan_video_15", "HunyuanVideo15Pipeline", (848, 480, 121), 16),
        ("wan22_t2v_a14b", "WanPipeline", (1280, 720, 81), 40),  # A14B: 40 heads per expert
        ("ltx2", "LTX2Pipeline", (768, 512, 121), 32),  # 32 heads in the video and in the audio stream
    ],
)
def test_the_packaged_video_deploy_defaults_fit_its_limits_and_the_frame_rule(name, pipeline, size, heads):
    deploy = load_deploy_config(name)
    defaults, engine = deploy.default_sampling_params, EngineArgs(name, **deploy.options)
    spec = REGISTRY[pipeline]
    assert (defaults["width"], defaults["height"], defaults["num_frames"]) == size
    assert defaults["num_frames"] % spec.frame_multiple == 1 and defaults["num_frames"] <= engine.max_frames
    assert max(defaults["width"], defaults["height"]) <= engine.max_image_size
    assert heads % engine.ulysses_degree == 0  # the heads split evenly
    assert defaults["width"] % spec.size_multiple == 0 == defaults["height"] % spec.size_multiple
    tokens = spec.tokens_per_step(defaults["width"], defaults["height"], defaults["num_frames"], [])
    assert tokens <= engine.limits.for_model(spec).max_tokens_per_step


def test_sampling_defaults_fill_only_what_the_request_left_out():
    defaults = {"num_inference_steps": 8, "true_cfg_scale": 2.5, "negative_prompt": None}
    merged = apply_sampling_defaults({"num_inference_steps": 2, "negative_prompt": " ", "seed": None}, defaults)
    assert merged["num_inference_steps"] == 2 and merged["true_cfg_scale"] == 2.5
    # True CFG needs a negative prompt: without one the default scale is not forced on.
    assert apply_sampling_defaults({"negative_prompt": None}, defaults)["true_cfg_scale"] is None


def test_devices_count_within_an_existing_cuda_visible_devices(tmp_path, monkeypatch):
    engine, deploy = resolved(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    deploy.apply_devices(engine)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "4,5"
    too_few, deploy = resolved(tmp_path, "--ulysses-degree", "3")
    with pytest.raises(ValueError, match="needs 3"):
        deploy.apply_devices(too_few)


def test_devices_are_pinned_once_for_every_replica(tmp_path, monkeypatch):
    """The server pins the deploy's GPUs before each replica's engine starts: the second time they are
    already pinned, and counting "2,3" within "6,7" again would run past the list (or pick other GPUs)."""
    engine = EngineArgs("tiny/qwen-image", ulysses_degree=2, device="cuda")
    deploy = load_deploy_config(write(tmp_path, GOOD.replace('"0,1"', '"2,3"')))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    deploy.apply_devices(engine)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"
    deploy.apply_devices(engine)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6,7"


def test_executor_backend_comes_from_the_yaml_or_the_flag_and_the_ray_address_from_the_flag(tmp_path):
    text = GOOD.replace("mask_sp_padding: true}", "mask_sp_padding: true, distributed_executor_backend: ray}")
    yaml_only = EngineArgs.from_layers("tiny/qwen-image", load_deploy_config(write(tmp_path, text)).options)
    assert yaml_only.parallel_config.distributed_executor_backend == "ray"
    assert settings(tmp_path).parallel_config.distributed_executor_backend == "mp"  # the default
    resolved = settings(tmp_path, "--distributed-executor-backend", "ray", "--ray-address", "10.0.0.1:6379")
    config = resolved.engine_config()
    assert config.parallel_config.distributed_executor_backend == "ray" and config.ray_address == "10.0.0.1:6379"
    with pytest.raises(DeployConfigError, match="distributed_executor_backend must be one of mp, ray"):
        load_deploy_config(write(tmp_path, text.replace("backend: ray", "backend: slurm")))


def test_the_step_cache_comes_from_the_yaml_and_the_flags_override_its_threshold(tmp_path):
    yaml = write(tmp_path, GOOD + "    cache: {policy: first_block, threshold: 0.2}\n")

    def resolve(*flags: str) -> EngineArgs:
        args = build_parser().parse_args(["serve", "tiny/qwen-image", "--deploy-config", str(yaml), *flags])
        return engine_args_from_cli(args)[0]

    assert resolve().step_cache == StepCacheConfig("first_block", 0.2)
    assert resolve("--cache-threshold", "0.3").step_cache == StepCacheConfig("first_block", 0.3)
    assert resolve().engine_config().cache == StepCacheConfig("first_block", 0.2)
    assert settings(tmp_path).step_cache is None  # no YAML cache, no flag: none
    assert settings(tmp_path, "--cache", "first_block").step_cache == StepCacheConfig()


@pytest.mark.parametrize(
    "flags,words",
    [
        (["--cache-threshold", "0.2"], "--cache-threshold needs a cache"),
        (["--cache", "first_block", "--cache-threshold", "0"], "cache_threshold must be a number > 0"),
        (["--cache", "first_block", "--max-batch-size", "4"], "a batch's rows would share one step cache"),
    ],
)
def test_step_cache_flags_that_cannot_be_served_are_refused_with_the_reason(tmp_path, flags, words):
    with pytest.raises(ValueError, match=words):
        settings(tmp_path, *flags)


@pytest.mark.parametrize(
    "cache,words",
    [
        ("first_block", "stages\\[0\\].cache must be a mapping"),
        ("{policy: teacache}", "cache must be one of first_block"),
        ("{policy: first_block, threshold: -1}", "cache_threshold must be a number > 0"),
        ("{policy: first_block, every: 2}", "unknown stages\\[0\\].cache key"),
    ],
)
def test_a_bad_yaml_cache_is_an_error_naming_it(tmp_path, cache, words):
    with pytest.raises(DeployConfigError, match=words):
        load_deploy_config(write(tmp_path, GOOD + f"    cache: {cache}\n"))


def test_packaged_klein_deploy_has_the_distilled_defaults():
    deploy = load_deploy_config("flux2_klein")
    assert deploy.options["ulysses_degree"] == 8 and deploy.devices == list(range(8))
    assert deploy.default_sampling_params == {"num_inference_steps": 4}


def test_a_default_priority_needs_the_priority_policy(tmp_path):
    """A deploy whose every request would carry a priority the server refuses (400 naming priority) does not start."""
    yaml = str(write(tmp_path, GOOD.replace("true_cfg_scale: 2.5", "true_cfg_scale: 2.5, priority: 2")))
    parse = build_parser().parse_args
    with pytest.raises(ValueError, match="default_sampling_params.priority 2 needs --scheduling-policy priority"):
        engine_args_from_cli(parse(["serve", "tiny/qwen-image", "--deploy-config", yaml]))
    engine, deploy = engine_args_from_cli(
        parse(["serve", "tiny/qwen-image", "--deploy-config", yaml, "--scheduling-policy", "priority"])
    )
    assert engine.scheduling_policy == "priority" and deploy.default_sampling_params["priority"] == 2
