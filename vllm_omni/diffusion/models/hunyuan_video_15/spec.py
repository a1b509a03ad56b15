"""HunyuanVideo 1.5: what the engine knows of the family without importing torch (models/spec.py), collected by
models/registry.py."""

from __future__ import annotations

from vllm_omni.diffusion.models.spec import COMMON_FIELDS, VIDEO_FIELDS, Family, PipelineSpec


def _hunyuan(diffusers_class: str, fields: frozenset[str], max_input_images: int) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "hunyuan_video_15",
        "generate",
        fields | VIDEO_FIELDS | {"negative_prompt", "guidance_scale"},
        modality="video",
        max_input_images=max_input_images,
        input_image_required=max_input_images > 0,
        frame_multiple=4,  # the VAE compresses time 4x: 4k + 1 frames
        default_frames=121,
        # Text-to-video draws the 16:9 bucket, image-to-video the input image's: its latent joins the
        # first frame's channels (no tokens of its own; its 729 SigLIP tokens are fixed, text side).
        size_buckets=640,  # HunyuanVideo15Transformer3DModel's default target_size
        # Qwen2.5-VL reads 1000 tokens after the 108 of its system prompt: the user's prompt and the
        # 5 that close the chat template (tokenizer_max_length, prompt_template_encode_start_idx).
        max_prompt_tokens=995,
        # 2**17: admits the 720p checkpoints' 1280x720 x 121 frames (80 x 45 x 31 = 111600 tokens) and
        # 848x480 up to 257 frames (103350); refuses 1920x1080 x 121 (249240) and 4096x4096 x 257
        # (4.3M tokens, hours a step).
        max_tokens_per_step=131072,
        cfg_parallel=True,
    )


FAMILY = Family(
    "hunyuan_video_15",
    (
        _hunyuan("HunyuanVideo15Pipeline", COMMON_FIELDS, 0),
        # Image-to-video sizes the video from the input image's aspect ratio: no height or width.
        _hunyuan("HunyuanVideo15ImageToVideoPipeline", COMMON_FIELDS - {"height", "width"}, 1),
    ),
    {
        "tiny/hunyuan-video-1.5": "HunyuanVideo15Pipeline",
        "tiny/hunyuan-video-1.5-i2v": "HunyuanVideo15ImageToVideoPipeline",
    },
    # Measured at 848x480x121: 83.0 GiB untiled (benchmarks/results/vae_decode.json).
    decode_bytes_per_pixel={"AutoencoderKLHunyuanVideo15": 1810},
)
