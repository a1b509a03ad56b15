"""LTX-2 end to end: the whole text-to-video-with-sound pipeline, ours against diffusers, on one GPU.

Real dimensions with random bf16 weights, configs written below (no downloads): the LTX-2 (2.0) transformer
(benchmarks/ltx2_sp.py's REAL_CONFIG: 48 layers, a 4096-wide video stream and a 2048-wide audio stream; 18.9B),
the text connectors, the video VAE, the audio VAE and the vocoder at their released configs (diffusers'
scripts/convert_ltx2_to_diffusers.py, version "2.0"), and a Gemma 3 text encoder (`Gemma3ForConditionalGeneration`)
SHRUNK to fit the device's 64 GiB disk beside the transformer: Gemma 3 12B's width (3840, 16 heads x 256, MLP 15360)
and vocabulary (262208), but 12 of its 48 layers (3.7B instead of 12.2B) and a one-layer vision tower (the text path
never runs it); the connectors read its 13 hidden states (text_proj_in_factor 13, not 49). Both sides run the same
encoder, once a request, so the shrink moves both totals alike. The tiny model's tokenizer and the released
(not distilled) scheduler. The request: LTX2Pipeline's defaults, 768x512, 121 frames at 24 fps (6144 video tokens,
126 audio tokens), 30 steps, guidance as the pipeline runs it (CFG 3.0 for the video, 7.0 for the audio, as one
batched forward; modality guidance 3.0, a forward of its own; spatio-temporal guidance 1.0, a forward of its own in
diffusers, left out by ours where the transformer has no perturbed attention, as LTX-2.0's: its term is zero up to
rounding, models/ltx2/pipeline.py), negative prompt "", one fixed prompt and seed; the result is the frames and the
24 kHz stereo sound. Variants, by phase:

    build      the random-weight checkpoint folder (safetensors, about 50 GB), weights made on the GPU in bf16
    diffusers  diffusers-eager: LTX2Pipeline as is (one GPU, in this process)
    ours       ours-default: Omni(folder) (compiled blocks, CUDA graphs, its warm-up requests);
               ours-eager: Omni(folder, enforce_eager=True); the FP8 variants as the other video families'.

`--steps N` (default 30) measures N steps and the 30-step total is extrapolated: the fixed phases (text encoding,
latent preparation, VAE decode, the rest of the call: the audio decode and the vocoder, MP4 encoding) as measured,
plus the measured denoising seconds per step times 30. The phases, the warm-up request (--warmup-steps: 2 here, as one step is NaN at the released scheduler: min_steps),
the runs and the docs are benchmarks/harness/video_e2e.py's (the probe's loop starts at the end of LTX2Pipeline's
`prepare_audio_latents`). The MP4 column times the frames' encoding alone.

One call on the one-GPU kind, about 8 minutes (build 2, diffusers 2, ours 4):

    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
    PYTHONUNBUFFERED=1 python3 benchmarks/ltx2_e2e.py --copy-to $OUT --steps 5 --warmup-steps 2 --phase build diffusers ours --variants diffusers-eager ours-default

The smoke mode, on CPU:

    python benchmarks/ltx2_e2e.py --tiny --warmup-steps 2 --phase build diffusers ours --out /tmp/ltx2.json --docs /tmp/ltx2.md

runs the same code with the tiny model's configs (tiny/ltx-2: 96x64, 9 frames, 2 steps, float32, CPU workers); its
numbers mean nothing.
"""  # noqa: E501

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from benchmarks.harness.video_e2e import Scale, VideoFamily, install_probe_in_worker, main  # noqa: E402
from benchmarks.harness.video_e2e import docs_section as video_docs_section  # noqa: E402
from benchmarks.ltx2_sp import REAL_CONFIG as REAL_TRANSFORMER  # noqa: E402

TINY_MODEL = "tiny/ltx-2"
FULL_STEPS = 30  # LTX2Pipeline's default
TEXT_LAYERS = 12  # of Gemma 3 12B's 48: the disk holds the 19B transformer beside it
REAL_TEXT = dict(  # Gemma 3 12B's text model, at TEXT_LAYERS layers
    vocab_size=262208,
    hidden_size=3840,
    intermediate_size=15360,
    num_hidden_layers=TEXT_LAYERS,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=256,
    max_position_embeddings=131072,
    sliding_window=1024,
    rope_scaling={"rope_type": "linear", "factor": 8.0},
)
SMALL_VISION = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2)
REAL_CONNECTORS = dict(  # version "2.0", text_proj_in_factor for TEXT_LAYERS
    caption_channels=3840,
    text_proj_in_factor=TEXT_LAYERS + 1,
    video_connector_num_attention_heads=30,
    video_connector_attention_head_dim=128,
    video_connector_num_layers=2,
    video_connector_num_learnable_registers=128,
    audio_connector_num_attention_heads=30,
    audio_connector_attention_head_dim=128,
    audio_connector_num_layers=2,
    audio_connector_num_learnable_registers=128,
    connector_rope_base_seq_len=4096,
    rope_theta=10000.0,
    rope_double_precision=True,
    causal_temporal_positioning=False,
    rope_type="split",
    per_modality_projections=False,
    proj_bias=False,
)
REAL_VAE = dict(
    in_channels=3,
    out_channels=3,
    latent_channels=128,
    block_out_channels=(256, 512, 1024, 2048),
    decoder_block_out_channels=(256, 512, 1024),
    layers_per_block=(4, 6, 6, 2, 2),
    decoder_layers_per_block=(5, 5, 5, 5),
    spatio_temporal_scaling=(True, True, True, True),
    decoder_spatio_temporal_scaling=(True, True, True),
    decoder_inject_noise=(False, False, False, False),
    downsample_type=("spatial", "temporal", "spatiotemporal", "spatiotemporal"),
    upsample_type=("spatiotemporal", "spatiotemporal", "spatiotemporal"),
    upsample_residual=(True, True, True),
    upsample_factor=(2, 2, 2),
    timestep_conditioning=False,
    patch_size=4,
    patch_size_t=1,
    resnet_norm_eps=1e-6,
    encoder_causal=True,
    decoder_causal=False,
    encoder_spatial_padding_mode="zeros",
    decoder_spatial_padding_mode="reflect",
    spatial_compression_ratio=32,
    temporal_compression_ratio=8,
)
REAL_AUDIO_VAE = dict(
    base_channels=128,
    output_channels=2,
    ch_mult=(1, 2, 4),
    num_res_blocks=2,
    attn_resolutions=None,
    in_channels=2,
    resolution=256,
    latent_channels=8,
    norm_type="pixel",
    causality_axis="height",
    dropout=0.0,
    mid_block_add_attention=False,
    sample_rate=16000,
    mel_hop_length=160,
    is_causal=True,
    mel_bins=64,
    double_z=True,
)
REAL_VOCODER = dict(
    in_channels=128,
    hidden_channels=1024,
    out_channels=2,
    upsample_kernel_sizes=[16, 15, 8, 4, 4],
    upsample_factors=[6, 5, 2, 2, 2],
    resnet_kernel_sizes=[3, 7, 11],
    resnet_dilations=[[1, 3, 5], [1, 3, 5], [1, 3, 5]],
    act_fn="leaky_relu",
    leaky_relu_negative_slope=0.1,
    antialias=False,
    final_act_fn="tanh",
    final_bias=True,
    output_sampling_rate=24000,
)


def tiny_folder() -> Path:
    from vllm_omni.diffusion.models.ltx2.tiny import tiny_model_path

    return tiny_model_path(TINY_MODEL)


def pipeline_parts() -> dict[str, Any]:
    """LTX2Pipeline's unweighted arguments: the tiny model's tokenizer and scheduler (the released one's config),
    no processor, prompt enhancer or duration head (LTX-2.0 has none)."""
    import diffusers
    from transformers import GemmaTokenizer

    tiny = tiny_folder()
    return {
        "tokenizer": GemmaTokenizer.from_pretrained(tiny / "tokenizer"),
        "scheduler": diffusers.FlowMatchEulerDiscreteScheduler.from_pretrained(tiny / "scheduler"),
        "processor": None,
        "prompt_enhancer": None,
        "duration_head": None,
    }


def make_components(scale: Scale, parts: dict[str, Any]) -> dict[str, torch.nn.Module]:
    """The weighted modules, made under the build's device and dtype."""
    import diffusers
    from diffusers.pipelines.ltx2 import LTX2TextConnectors
    from diffusers.pipelines.ltx2.vocoder import LTX2Vocoder
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    tokenizer = parts["tokenizer"]
    if scale.name == "tiny":
        tiny = tiny_folder()
        configs = {
            name: cls.load_config(tiny / name)
            for name, cls in (
                ("transformer", diffusers.LTX2VideoTransformer3DModel),
                ("vae", diffusers.AutoencoderKLLTX2Video),
                ("audio_vae", diffusers.AutoencoderKLLTX2Audio),
                ("connectors", LTX2TextConnectors),
                ("vocoder", LTX2Vocoder),
            )
        }
        text = Gemma3Config.from_pretrained(tiny / "text_encoder")
    else:
        configs = {
            "transformer": dict(REAL_TRANSFORMER),
            "vae": dict(REAL_VAE),
            "audio_vae": dict(REAL_AUDIO_VAE),
            "connectors": dict(REAL_CONNECTORS),
            "vocoder": dict(REAL_VOCODER),
        }
        n = len(tokenizer)
        text = Gemma3Config(
            text_config=dict(
                REAL_TEXT,
                pad_token_id=tokenizer.pad_token_id,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
            ),
            vision_config=SMALL_VISION,
            boi_token_index=n,
            eoi_token_index=n + 1,
            image_token_index=n + 2,
        )
    if len(tokenizer) > text.text_config.vocab_size:
        raise SystemExit("the tiny tokenizer's ids do not fit the vocabulary")
    return {
        "transformer": diffusers.LTX2VideoTransformer3DModel.from_config(configs["transformer"]),
        "text_encoder": Gemma3ForConditionalGeneration(text),
        "connectors": LTX2TextConnectors.from_config(configs["connectors"]),
        "vae": diffusers.AutoencoderKLLTX2Video.from_config(configs["vae"]),
        "audio_vae": diffusers.AutoencoderKLLTX2Audio.from_config(configs["audio_vae"]),
        "vocoder": LTX2Vocoder.from_config(configs["vocoder"]),
    }


def cfg_text(row: dict[str, Any], build: dict[str, Any]) -> str:
    return (
        "guidance as LTX2Pipeline runs it (CFG 3.0 video / 7.0 audio as one batched forward, modality guidance 3.0; "
        'spatio-temporal guidance 1.0 in diffusers, left out by ours on this transformer), negative prompt ""'
    )


FAMILY = VideoFamily(
    key="ltx2_e2e",
    title="LTX-2 (video with sound)",
    pipeline="LTX2Pipeline",
    denoisers={"transformer": "LTX2VideoTransformer3DModel"},
    loop_start="prepare_audio_latents",
    # Words the tiny tokenizer's corpus holds (tiny_qwen_tokenizer.ENGLISH_TEXT), so it splits them into pieces.
    prompt="A busy city street at night, neon signs reflected in puddles after the rain.",
    fps=24,
    full_steps=FULL_STEPS,
    sizes=(Scale("real", 768, 512, 121, FULL_STEPS, "cuda", "bfloat16"),),
    tiny=Scale("tiny", 96, 64, 9, 2, "cpu", "float32"),
    folder_name="ltx2-e2e",
    pipeline_parts=pipeline_parts,
    make_components=make_components,
    checkpoint_facts=lambda pipe: {
        "text_encoder_layers": pipe.text_encoder.config.text_config.num_hidden_layers,
        "perturbed_attn": pipe.transformer.config.perturbed_attn,
        "vocoder_rate": pipe.vocoder.config.output_sampling_rate,
    },
    components_text="transformer 18.9B (real), Gemma 3 12B's width and vocabulary at 12 of its 48 layers (3.7B: "
    "shrunk to fit the 64 GiB disk), the released connectors, video VAE, audio VAE and vocoder",
    cfg_text=cfg_text,
    text_encoders_text="Gemma 3 (shrunk, see above), then the connectors",
    targets_text="The target: ours at most 0.75x diffusers end to end.",
    not_run_text="Not run yet. On one H100 or H200, one call (the docstring of benchmarks/ltx2_e2e.py gives the "
    "command line): `--steps 5 --warmup-steps 2 --phase build diffusers ours --variants diffusers-eager ours-default`; "
    "one forward at U1 and at a simulated U8 rank (trim / none / mask, where the audio stream pads and where both "
    "streams do): `python benchmarks/ltx2_sp.py --simulate --degree 8`.",
    targets={"ours-default": "<= 0.75"},
)


def docs_section(results: dict[str, Any]) -> str:
    return video_docs_section(FAMILY, results)


install_probe_in_worker(FAMILY, __name__)

if __name__ == "__main__":
    main(FAMILY, __doc__)
