"""Wan2.2 (T2V-A14B, I2V-A14B, TI2V-5B): what the engine knows of the family without importing torch
(models/spec.py), collected by models/registry.py."""

from __future__ import annotations

from vllm_omni.diffusion.models.spec import COMMON_FIELDS, VIDEO_FIELDS, Family, PipelineSpec

WAN_EXPERT_FIELDS = {False: frozenset({"guidance_scale_2"}), True: frozenset()}


def _wan22(diffusers_class: str, max_input_images: int, five_b: bool = False) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "wan22",
        "generate",
        # guidance_scale_2 is the low-noise expert's scale, which TI2V-5B (one transformer) has not.
        COMMON_FIELDS | VIDEO_FIELDS | {"negative_prompt", "guidance_scale"} | WAN_EXPERT_FIELDS[five_b],
        modality="video",
        max_input_images=max_input_images,
        input_image_required=max_input_images > 0,
        # A14B: the Wan2.1 VAE's 8x and 2x2 patches; TI2V-5B: the Wan2.2 VAE's 16x and 2x2 patches.
        size_multiple=32 if five_b else 16,
        frame_multiple=4,  # 4k + 1 frames
        default_frames=81,
        default_size=(832, 480),  # both pipelines' height/width defaults
        default_fps=24 if five_b else 16,  # the checkpoints' frame rates
        # Image-to-video resizes the input image to the video's size; without a size, the video takes the
        # image's aspect ratio at the default's area (rounded to 32), rather than stretching it to 832x480.
        source_resize="area" if max_input_images else None,
        source_area=832 * 480,
        # UMT5 reads 512 tokens, the closing </s> included (max_sequence_length).
        max_prompt_tokens=511,
        # A14B: 76800 admits its released 1280x720 x 81 frames (80 x 45 x 21 = 75600 tokens) and 832x480 up
        # to 193 frames, and lets both experts serve from one H200 at the default --gpu-memory-utilization
        # (the memory plan refuses one at 2**17: a step there needs 100 GiB beside 64 GiB of weights).
        # TI2V-5B (one 5B transformer): 2**17, as HunyuanVideo 1.5; its 1280x704 x 121 frames is 27280.
        max_tokens_per_step=131072 if five_b else 76800,
        cfg_parallel=True,
        model_index=(("expand_timesteps", True),) if five_b else (),
    )


FAMILY = Family(
    "wan22",
    # T2V-A14B and I2V-A14B (two experts), TI2V-5B (one transformer, per-token timesteps) as text-to-video.
    (_wan22("WanPipeline", 0), _wan22("WanImageToVideoPipeline", 1), _wan22("WanPipeline", 0, five_b=True)),
    {
        "tiny/wan2.2-t2v": "WanPipeline",
        "tiny/wan2.2-i2v": "WanImageToVideoPipeline",
        "tiny/wan2.2-ti2v": "WanPipeline",
    },
    {"tiny/wan2.2-t2v-lora": "tiny/wan2.2-t2v"},
    # Measured at 848x480x81 and 1280x720x81: 4.65 and 10.5 GiB untiled (benchmarks/results/vae_decode.json).
    decode_bytes_per_pixel={"AutoencoderKLWan": 152},
)
