"""`quantization="fp8"`: which layers the FP8 rule converts, the refusals, the settings, and SP under FP8.

The rule reads module names and shapes: checked on every family's denoiser at its real dimensions (built
on the meta device, no weights) and on the tiny models' denoisers, which have the same names at widths
below the rule's size floor. FP8 cannot be served on CPU, so the engine refuses it there before any
worker starts. torchao itself refuses CPU up front, yet its float8 tensors run their matmul there
(torch._scaled_mm on CPU): with that check lifted (test-only), the tiny Qwen-Image transformer converted
to FP8 keeps the exact SP properties, which hold because activations are scaled per token.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

os.environ.setdefault("VLLM_OMNI_CPU_THREADS", "1")

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))  # the benchmarks' real configs: one place for each family's dimensions
sys.path.insert(0, str(ROOT / "tests/diffusion/models"))  # sp_padding, the pad-content hook the model tests use
from sp_padding import random_sp_padding  # noqa: E402

from benchmarks.flux2_sp import REAL_CONFIG as FLUX2_REAL  # noqa: E402
from benchmarks.glm_image import REAL_DIT as GLM_IMAGE_REAL  # noqa: E402
from benchmarks.hunyuan_video_sp import REAL_CONFIG as HUNYUAN_REAL  # noqa: E402
from benchmarks.qwen_image21_sp import REAL_CONFIG as QWEN_IMAGE21_REAL  # noqa: E402
from benchmarks.qwen_image_sp import REAL_CONFIG as QWEN_IMAGE_REAL  # noqa: E402
from benchmarks.wan22_sp import REAL_CONFIG as WAN22_REAL  # noqa: E402
from vllm_omni import Omni  # noqa: E402
from vllm_omni.diffusion.config import OmniDiffusionConfig  # noqa: E402
from vllm_omni.diffusion.distributed.parallel_state import get_parallel_state, use_parallel_state  # noqa: E402
from vllm_omni.diffusion.engine import core as engine_module  # noqa: E402
from vllm_omni.diffusion.engine.args import EngineArgs  # noqa: E402
from vllm_omni.diffusion.model_source import read_pipeline_spec, resolve_model_path  # noqa: E402
from vllm_omni.diffusion.models.registry import TINY_MODELS  # noqa: E402
from vllm_omni.diffusion.worker.quantization import (  # noqa: E402
    FP8_RULE,
    check_quantization,
    converted_weight,
    fp8_quantize,
    grad_mode,
    quantize_denoiser,
    quantize_denoisers,
    stored_bytes,
)
from vllm_omni.diffusion.worker.runner import present_components  # noqa: E402
from vllm_omni.entrypoints.cli.main import build_parser  # noqa: E402
from vllm_omni.entrypoints.cli.serve import engine_args_from_cli  # noqa: E402
from vllm_omni.entrypoints.deploy_config import DeployConfigError, load_deploy_config  # noqa: E402

# The linear layers the rule converts to FP8, per family (block indices written N): the attention
# projections and MLPs of both streams in every repeated block; never a modulation, embedder, input or
# final projection.
FP8_LAYERS = {
    "qwen_image": {
        *(f"transformer_blocks.N.attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.N")),
        *(f"transformer_blocks.N.attn.{p}" for p in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
        *(f"transformer_blocks.N.{mlp}.net.{p}" for mlp in ("img_mlp", "txt_mlp") for p in ("N.proj", "N")),
    },
    "flux2": {
        *(f"transformer_blocks.N.attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.N")),
        *(f"transformer_blocks.N.attn.{p}" for p in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
        *(f"transformer_blocks.N.{ff}.{p}" for ff in ("ff", "ff_context") for p in ("linear_in", "linear_out")),
        "single_transformer_blocks.N.attn.to_qkv_mlp_proj",
        "single_transformer_blocks.N.attn.to_out",
    },
    "hunyuan_video_15": {
        *(f"transformer_blocks.N.attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.N")),
        *(f"transformer_blocks.N.attn.{p}" for p in ("add_q_proj", "add_k_proj", "add_v_proj", "to_add_out")),
        *(f"transformer_blocks.N.{ff}.net.{p}" for ff in ("ff", "ff_context") for p in ("N.proj", "N")),
    },
    "wan22": {
        *(f"blocks.N.{attn}.{p}" for attn in ("attn1", "attn2") for p in ("to_q", "to_k", "to_v", "to_out.N")),
        "blocks.N.ffn.net.N.proj",
        "blocks.N.ffn.net.N",
    },
    "qwen_image21": {  # single-stream blocks: one set of projections and one SwiGLU MLP
        *(f"transformer_blocks.N.attn.{p}" for p in ("to_q", "to_k", "to_v", "to_out.N")),
        *(f"transformer_blocks.N.img_mlp.{p}" for p in ("proj", "gate_layer", "out")),
    },
    "glm_image": {  # one set of projections and one feed-forward for both streams
        *(f"transformer_blocks.N.attn1.{p}" for p in ("to_q", "to_k", "to_v", "to_out.N")),
        "transformer_blocks.N.ff.net.N.proj",
        "transformer_blocks.N.ff.net.N",
    },
}
# What stays bf16 at real dimensions, and why (the rule's reasons).
BF16_LAYERS = {
    "qwen_image21": {
        "embedder": {"time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"},
        "input projection": {"img_in", "txt_in.in_layer", "txt_in.out_layer"},
        "modulation": {"modulation.N"},  # one modulation shared by every block
        "final projection": {"norm_out.linear", "proj_out"},
    },
    "qwen_image": {
        "embedder": {"time_text_embed.timestep_embedder.linear_1", "time_text_embed.timestep_embedder.linear_2"},
        "input projection": {"img_in", "txt_in"},
        "modulation": {"transformer_blocks.N.img_mod.N", "transformer_blocks.N.txt_mod.N"},
        "final projection": {"norm_out.linear", "proj_out"},
    },
    "flux2": {
        "embedder": {
            *(
                f"time_guidance_embed.{e}.linear_{i}"
                for e in ("timestep_embedder", "guidance_embedder")
                for i in (1, 2)
            ),
            "x_embedder",
            "context_embedder",
        },
        "modulation": {
            "double_stream_modulation_img.linear",
            "double_stream_modulation_txt.linear",
            "single_stream_modulation.linear",
        },
        "final projection": {"norm_out.linear", "proj_out"},
    },
    "hunyuan_video_15": {
        "embedder": {
            "image_embedder.linear_1",
            "image_embedder.linear_2",
            *(
                f"context_embedder.time_text_embed.{e}.linear_{i}"
                for e in ("timestep_embedder", "text_embedder")
                for i in (1, 2)
            ),
            "context_embedder.proj_in",
            *(
                f"context_embedder.token_refiner.refiner_blocks.N.attn.{p}"
                for p in ("to_q", "to_k", "to_v", "to_out.N")
            ),
            "context_embedder.token_refiner.refiner_blocks.N.ff.net.N.proj",
            "context_embedder.token_refiner.refiner_blocks.N.ff.net.N",
            "context_embedder.token_refiner.refiner_blocks.N.norm_out.linear",
            *(f"context_embedder_2.linear_{i}" for i in (1, 2, 3)),
            "time_embed.timestep_embedder.linear_1",
            "time_embed.timestep_embedder.linear_2",
        },
        "modulation": {"transformer_blocks.N.norm1.linear", "transformer_blocks.N.norm1_context.linear"},
        "final projection": {"norm_out.linear", "proj_out"},
    },
    "wan22": {
        "embedder": {
            *(f"condition_embedder.{e}.linear_{i}" for e in ("time_embedder", "text_embedder") for i in (1, 2)),
            "condition_embedder.time_proj",
        },
        "final projection": {"proj_out"},
    },
    "glm_image": {
        "embedder": {
            f"time_condition_embed.{e}.linear_{i}" for e in ("timestep_embedder", "condition_embedder") for i in (1, 2)
        },
        # The glyph text's and the prior tokens' projectors are 4096 wide: kept by name, not by size.
        "input projection": {
            "image_projector.proj",
            *(f"{p}.net.{layer}" for p in ("glyph_projector", "prior_projector") for layer in ("N.proj", "N")),
        },
        "modulation": {"transformer_blocks.N.norm1.linear"},
        "final projection": {"norm_out.linear", "proj_out"},
    },
}
REAL_DIMENSIONS = {
    "qwen_image": QWEN_IMAGE_REAL,
    "qwen_image21": QWEN_IMAGE21_REAL,
    "flux2": FLUX2_REAL,
    "hunyuan_video_15": HUNYUAN_REAL,
    "wan22": WAN22_REAL,
    "glm_image": GLM_IMAGE_REAL,
}
TINY_RULE = dataclasses.replace(FP8_RULE, min_features=16)  # the same names at the tiny models' widths


def collapse(name: str) -> str:
    return re.sub(r"\.\d+(?=\.|$)", ".N", name)


def linear_layers(model: torch.nn.Module, rule=FP8_RULE) -> tuple[set[str], dict[str, set[str]]]:
    """(names the rule converts, {reason: names it keeps bf16}), block indices collapsed."""
    fp8, bf16 = set(), {}
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            reason = rule.bf16_reason(name, module)
            if reason is None:
                fp8.add(collapse(name))
            else:
                bf16.setdefault(reason, set()).add(collapse(name))
    return fp8, bf16


def denoisers_on_meta(model: str) -> dict[str, torch.nn.Module]:
    """The tiny model's denoisers, built from their config.json on the meta device."""
    path = resolve_model_path(model)
    family = read_pipeline_spec(path).family_pipeline()
    out = {}
    for name in present_components(path, family.denoisers):
        cls = family.denoisers[name]
        with torch.device("meta"):
            out[name] = cls.from_config(cls.load_config(path, subfolder=name))
    return out


# ---- the rule ------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", list(FP8_LAYERS))
def test_rule_converts_the_block_matmuls_of_every_family_at_real_dimensions(family):
    spec = next(spec for spec in TINY_MODELS.values() if spec.family == family)
    cls = spec.family_pipeline().denoisers["transformer"]
    with torch.device("meta"):
        model = cls(**REAL_DIMENSIONS[family])
    fp8, bf16 = linear_layers(model)
    assert fp8 == FP8_LAYERS[family]
    assert bf16 == BF16_LAYERS[family]


@pytest.mark.parametrize("model_name", [name for name, spec in TINY_MODELS.items() if spec.family in FP8_LAYERS])
def test_tiny_models_have_the_names_the_rule_reads_and_are_below_its_size_floor(model_name):
    for name, denoiser in denoisers_on_meta(model_name).items():
        assert linear_layers(denoiser, TINY_RULE)[0] == FP8_LAYERS[TINY_MODELS[model_name].family], name
        assert FP8_RULE.fp8_layers(denoiser) == [], name  # every tiny width is below MIN_FEATURES


def test_without_quantization_nothing_changes():
    model = torch.nn.Sequential(torch.nn.Linear(2048, 2048, dtype=torch.bfloat16))
    quantize_denoisers({"transformer": model}, None)
    assert type(model[0].weight) is torch.nn.Parameter


# ---- refusals ------------------------------------------------------------------------------------


def test_engine_refuses_fp8_on_cpu_before_any_worker_starts(monkeypatch):
    def no_workers(*args, **kwargs):
        raise AssertionError("a worker group was started")

    monkeypatch.setattr(engine_module, "MultiprocExecutor", no_workers)
    # device None: the engine picks cpu on a machine without GPUs.
    for device in ["cpu"] + ([] if torch.cuda.is_available() else [None]):
        with pytest.raises(ValueError, match=r"quantization='fp8' needs CUDA GPUs .*device='cpu'"):
            Omni("tiny/qwen-image", quantization="fp8", device=device)


def test_fp8_needs_bfloat16_and_torchao(monkeypatch):
    with pytest.raises(ValueError, match="dtype bfloat16"):
        check_quantization("fp8", "cuda", "float32")
    for name in ["torchao", *(name for name in sys.modules if name.startswith("torchao."))]:
        monkeypatch.setitem(sys.modules, name, None)  # as if it were not installed
    with pytest.raises(ImportError, match=r"pip install -e '\.\[fp8\]'"):
        check_quantization("fp8", "cuda", "bfloat16")
    with pytest.raises(ImportError, match=r"pip install -e '\.\[fp8\]'"):
        fp8_quantize(torch.nn.Sequential(torch.nn.Linear(16, 16)), ["0"])


def test_fp8_checks_the_dtype_of_the_layers_it_converts_not_of_modules_kept_in_float32():
    # diffusers loads Wan in bf16 but keeps `_keep_in_fp32_modules` (its modulation table comes first) in
    # float32; the FP8 check on the model's first parameter refused every Wan2.2 deploy.
    cls = TINY_MODELS["tiny/wan2.2-t2v"].family_pipeline().denoisers["transformer"]
    with torch.device("meta"):
        model = cls(**WAN22_REAL).to(torch.bfloat16)
    for name, param in model.named_parameters():
        if any(part in cls._keep_in_fp32_modules for part in name.split(".")):
            param.data = param.data.float()
    assert next(model.parameters()).dtype == torch.float32
    assert converted_weight(model, FP8_RULE.fp8_layers(model)).dtype == torch.bfloat16


def test_a_worker_refuses_to_convert_a_cpu_model():
    model = torch.nn.Linear(2048, 2048, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="device='cpu'"):
        quantize_denoiser(model, "fp8")


# ---- settings: config, flag, YAML ----------------------------------------------------------------


def test_config_takes_fp8_and_refuses_other_methods():
    assert OmniDiffusionConfig(model="tiny/qwen-image").quantization is None
    assert OmniDiffusionConfig(model="tiny/qwen-image", quantization="fp8").quantization == "fp8"
    with pytest.raises(ValueError, match="quantization must be one of fp8"):
        OmniDiffusionConfig(model="tiny/qwen-image", quantization="int8")


def test_flag_and_yaml_set_quantization_and_bad_values_are_refused(tmp_path, capsys):
    parser = build_parser()
    args = parser.parse_args(["serve", "tiny/qwen-image", "--quantization", "fp8"])
    assert engine_args_from_cli(args)[0].engine_config().quantization == "fp8"
    assert engine_args_from_cli(parser.parse_args(["serve", "tiny/qwen-image"]))[0].quantization is None
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "tiny/qwen-image", "--quantization", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err

    stage = "stages:\n  - stage_id: 0\n    quantization: {}\n"
    good, bad = tmp_path / "fp8.yaml", tmp_path / "bad.yaml"
    good.write_text(stage.format("fp8"))
    bad.write_text(stage.format("int4"))
    assert load_deploy_config(good).options["quantization"] == "fp8"
    assert (
        EngineArgs.from_layers("tiny/qwen-image", load_deploy_config(good).options).engine_config().quantization
        == "fp8"
    )
    with pytest.raises(DeployConfigError, match=r"stages\[0\]\.quantization must be one of fp8 or unset, got 'int4'"):
        load_deploy_config(bad)


# ---- SP under FP8 (CPU, torchao's hardware check lifted) -------------------------------------------

QWEN_IMAGE = "tiny/qwen-image"
GRID, TEXT_LEN = (1, 5, 7), 11  # 35 image tokens: padded at Ulysses 2 and 3
_fp8_models: dict[str, torch.nn.Module] = {}


@contextlib.contextmanager
def fp8_on_cpu():
    """torchao asserts a CUDA GPU of compute capability 8.9+ before converting; its float8 tensors
    nevertheless run their matmul on CPU, which is what these tests need."""
    from torchao.quantization import quant_api

    check = quant_api._check_hardware_support
    quant_api._check_hardware_support = lambda granularity: None
    try:
        yield
    finally:
        quant_api._check_hardware_support = check


def tiny_transformer(fp8: bool) -> torch.nn.Module:
    """The tiny Qwen-Image transformer in bf16, converted to FP8 by the rule's names when `fp8`."""
    from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel

    path = resolve_model_path(QWEN_IMAGE)
    model = QwenImageTransformer2DModel.from_pretrained(path, subfolder="transformer", dtype=torch.bfloat16).eval()
    if fp8:
        with fp8_on_cpu():
            assert {collapse(name) for name in fp8_quantize(model, TINY_RULE.fp8_layers(model))} == FP8_LAYERS[
                "qwen_image"
            ]
    return model


def make_inputs() -> dict:
    gen = torch.Generator().manual_seed(1)
    return dict(
        hidden_states=torch.randn(1, GRID[0] * GRID[1] * GRID[2], 64, generator=gen).bfloat16(),
        encoder_hidden_states=torch.randn(1, TEXT_LEN, 64, generator=gen).bfloat16(),
        timestep=torch.tensor([0.5]).bfloat16(),
        img_shapes=[[GRID]],
        return_dict=False,
    )


def sp_fp8_forward(mask: bool = False, random_padding: bool = False) -> torch.Tensor:
    """Worker side: the FP8 tiny transformer's forward under the worker's SP group."""
    if "fp8" not in _fp8_models:
        _fp8_models["fp8"] = tiny_transformer(fp8=True)
    state = get_parallel_state()
    config = state.config.replace(mask_sp_padding=mask)
    with random_sp_padding(random_padding), use_parallel_state(dataclasses.replace(state, config=config)):
        with torch.no_grad():
            return _fp8_models["fp8"](**make_inputs())[0]


# Not installed by the test extra (pip install -e '.[fp8]' adds it): without it these tests do not start the pools.
needs_torchao = pytest.mark.skipif(importlib.util.find_spec("torchao") is None, reason="torchao is not installed")


def cpu_runs_rowwise_fp8() -> bool:
    """Whether this torch runs FP8 matmuls with a scale per row on the CPU (torch 2.11's takes only one scale a
    tensor; the project allows torch >= 2.11)."""
    a, b = torch.ones(16, 32, dtype=torch.float8_e4m3fn), torch.ones(16, 32, dtype=torch.float8_e4m3fn).t()
    try:
        torch._scaled_mm(a, b, scale_a=torch.ones(16, 1), scale_b=torch.ones(1, 16), out_dtype=torch.bfloat16)
    except (RuntimeError, NotImplementedError, ValueError):
        return False
    return True


needs_cpu_fp8 = pytest.mark.skipif(
    not cpu_runs_rowwise_fp8(), reason=f"torch {torch.__version__} runs no row-wise FP8 matmul on the CPU"
)


@pytest.fixture(scope="module")
def single_process_outputs():
    with torch.no_grad():
        return {fp8: tiny_transformer(fp8)(**make_inputs())[0] for fp8 in (False, True)}


@needs_torchao
@needs_cpu_fp8
def test_sp_trim_under_fp8_equals_single_process_of_the_same_fp8_model(single_process_outputs, sp_pool):
    expected, bf16 = single_process_outputs[True], single_process_outputs[False]
    assert not torch.equal(expected, bf16)  # the layers did run in FP8
    # Bit-identical, as in bf16: each rank's GEMMs see fewer rows but scale each row alone. (A scale shared
    # by the rows of a shard would differ between U1 and each rank, and so would every output.)
    for out in sp_pool.run(sp_fp8_forward):
        assert torch.equal(out, expected)


@needs_torchao
@needs_cpu_fp8
@pytest.mark.parametrize("mask", [False, True], ids=["trim", "mask"])
def test_sp_padding_content_never_reaches_real_tokens_under_fp8(single_process_outputs, sp_pool, mask):
    clean = sp_pool.run(sp_fp8_forward, mask)
    noisy = sp_pool.run(sp_fp8_forward, mask, random_padding=True)
    for a, b in zip(clean, noisy):
        assert torch.equal(a, b)  # padding rows are quantized with their own scales, and then dropped or masked


@needs_torchao
def test_fp8_weights_are_counted_at_their_stored_size():
    sizes = {fp8: sum(stored_bytes(p) for p in tiny_transformer(fp8).parameters()) for fp8 in (False, True)}
    converted = tiny_transformer(True)
    fp8_weights = [converted.get_submodule(name).weight for name in TINY_RULE.fp8_layers(tiny_transformer(False))]
    # One byte a weight plus a float32 scale a row, where bf16 took two bytes a weight.
    saved = sum(w.numel() - 4 * w.shape[0] for w in fp8_weights)
    assert sizes[False] - sizes[True] == saved


@needs_torchao
def test_offload_moves_fp8_weights_whole_in_the_mode_requests_run_in():
    """The offload hooks move weights during a request (accelerate's for model offload, diffusers' groups for
    layerwise: both call `tensor.to(device)`), so in the runner's grad mode. The meta device stands in for the
    GPU. Under inference mode a torchao tensor moved there keeps the old device on its wrapper while its data
    moves (what made the H200's FP8 GEMM find its weight "on cpu"); in the mode FP8 with offload runs in, the
    wrapper, the FP8 data and the scales move together, and the moved layers run there."""
    from accelerate import cpu_offload_with_hook

    meta = torch.device("meta")
    assert grad_mode("fp8", "none") is torch.inference_mode and grad_mode(None, "model") is torch.inference_mode
    with torch.inference_mode():
        assert _moved_devices(_fp8_layers()[0].weight, meta) != {"meta"}  # why FP8 offload has a mode of its own
    assert grad_mode("fp8", "layerwise") is grad_mode("fp8", "model")  # one mode for either offload
    with grad_mode("fp8", "model")():
        model = _fp8_layers()
        assert _moved_devices(model[0].weight, meta) == {"meta"}  # a group's move (then swapped in)
        seen = []
        for layer in model:
            layer.register_forward_pre_hook(lambda m, args: seen.append(_moved_devices(m.weight, None)))
        cpu_offload_with_hook(model, meta)  # what enable_model_cpu_offload puts on a component
        assert model(torch.zeros(2, 64, dtype=torch.bfloat16, device=meta)).device == meta
        assert seen == [{"meta"}, {"meta"}]  # (the way back, to the CPU, cannot copy out of meta: GPU test)


def _fp8_layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)).bfloat16()
    with fp8_on_cpu():
        fp8_quantize(model, ["0", "1"])
    return model


def _moved_devices(weight: torch.Tensor, device: torch.device | None) -> set[str]:
    """The device types of an FP8 weight moved to `device` (None: as it is): its wrapper, data and scales."""
    moved = weight if device is None else weight.to(device)
    return {t.device.type for t in (moved, moved.qdata, moved.scale)}


# ---- on a GPU with FP8 (skipped elsewhere): the engine's conversion, then compile and graphs ----------

needs_fp8_gpu = pytest.mark.skipif(
    importlib.util.find_spec("torchao") is None
    or not torch.cuda.is_available()
    or torch.cuda.get_device_capability() < (8, 9),
    reason="needs torchao and a CUDA GPU of compute capability 8.9+",
)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).norm() / ref.float().norm()).item()


@needs_fp8_gpu
def test_fp8_on_a_gpu_composes_with_compiled_blocks_and_cuda_graphs():
    from torchao.utils import TorchAOBaseTensor

    from benchmarks.qwen_image_sp import make_inputs as real_inputs
    from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel
    from vllm_omni.diffusion.worker.cuda_graphs import CUDAGraphForward, compile_repeated_blocks

    device = torch.device("cuda", 0)
    torch.manual_seed(0)
    with device:
        model = QwenImageTransformer2DModel(**dict(QWEN_IMAGE_REAL, num_layers=2)).to(torch.bfloat16).eval()
    inputs = real_inputs(32, device)  # 1024 image tokens, real widths
    compiled_bf16 = copy.deepcopy(model)
    with torch.inference_mode():
        bf16 = model(**inputs)[0]
        compile_repeated_blocks(compiled_bf16)
        bf16_compiled = compiled_bf16(**inputs)[0]
    del compiled_bf16
    quantize_denoisers({"transformer": model}, "fp8")  # as the runner does, the capability check included
    converted = {n for n, m in model.named_modules() if isinstance(getattr(m, "weight", None), TorchAOBaseTensor)}
    assert {collapse(name) for name in converted} == FP8_LAYERS["qwen_image"]
    with torch.inference_mode():
        eager = model(**inputs)[0]
        compile_repeated_blocks(model)
        model.sharded_wrapper = CUDAGraphForward(model.forward_sharded)
        captured, replayed = model(**inputs)[0], model(**inputs)[0]
    assert model.sharded_wrapper.captures == 1 and not model.sharded_wrapper.disabled
    assert torch.equal(captured, replayed)
    fp8_error = relative_error(eager, bf16)
    assert 0 < fp8_error < 0.05  # FP8 changes the numbers, a little
    # Compiling moves bf16 and FP8 alike: inductor fuses the elementwise ops and keeps their intermediates in
    # float32 where eager rounds each to bf16 (measured on an H200: 0.41 % in bf16, 0.42 % in FP8, 0.10 % and
    # 0.12 % with inductor's emulate_precision_casts; a graph replay alone moves nothing). So FP8 adds no error of
    # its own under compile and graphs: as far from compiled bf16 as eager FP8 is from eager bf16, and moved by
    # the compile no more than bf16 is.
    assert relative_error(replayed, bf16_compiled) < 1.5 * fp8_error
    assert relative_error(replayed, eager) < 1.5 * relative_error(bf16_compiled, bf16)


# ---- the benchmark's plumbing (benchmarks/speed_levers.py --tiny) --------------------------------


@pytest.mark.slow  # a whole pipeline or a compile: tens of seconds on a shared CPU
def test_speed_levers_tiny_run_writes_every_variant_and_says_why_fp8_is_skipped(tmp_path):
    out, docs = tmp_path / "speed_levers.json", tmp_path / "benchmarks.md"
    command = [
        sys.executable,
        str(ROOT / "benchmarks/speed_levers.py"),
        "--tiny",
        "--out",
        str(out),
        "--docs",
        str(docs),
    ]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(command, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    models = json.loads(out.read_text())["fp8"]["models"]
    assert set(models) == {"qwen_image", "flux2"}
    for model in models.values():
        rows = model["variants"]
        assert list(rows) == [
            "ours bf16",
            "ours fp8",
            "ours fp8 all linears",
            "ours fp8 rule + modulation",
            "diffusers compiled",
        ]
        assert rows["diffusers compiled"]["max_abs_diff"] == 0  # the same bf16 math as ours, eagerly on CPU
        assert all(rows[name]["error"] == "skipped" for name in list(rows)[1:4])
        assert "device='cpu'" in model["fp8_skipped"]
    assert "<!-- BEGIN speed_levers_fp8" in docs.read_text()
