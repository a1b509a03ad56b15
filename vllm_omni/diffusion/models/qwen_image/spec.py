"""Qwen-Image, -Edit and -Edit-Plus: what the engine knows of the family without importing torch (models/spec.py),
collected by models/registry.py."""

from __future__ import annotations

from vllm_omni.diffusion.models.spec import COMMON_FIELDS, Family, PipelineSpec


def _qwen(diffusers_class: str, task: str, max_input_images: int) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "qwen_image",
        task,
        COMMON_FIELDS | {"negative_prompt", "guidance_scale", "true_cfg_scale"},
        max_input_images=max_input_images,
        input_image_required=task == "edit",
        # Qwen-Image's scheduler stretches sigmas to a terminal shift: one step divides 0 by 0 (NaN image).
        min_steps=2,
        default_true_cfg_scale=4.0,
        default_size=(1024, 1024),  # default_sample_size 128 x the VAE's 8
        # Each source is encoded at about 1 MP and its tokens join the sequence. Without a size the
        # output takes Edit's (first) source's size, Edit-Plus's last one's.
        source_resize="area" if task == "edit" else None,
        sources_in_sequence=task == "edit",
        auto_size_source=-1 if max_input_images > 1 else 0,
        # Edit-Plus shows each source to the text encoder at about 384x384 and Qwen2.5-VL's image
        # processor refuses sides more than 200:1 apart: 100:1 stays clear of both (and of Edit's 1 MP).
        max_source_aspect_ratio=100.0 if task == "edit" else None,
        # The generation pipeline keeps 512 text tokens (max_sequence_length) after its system
        # prompt: the user's prompt and the 5 tokens that close the chat template.
        max_prompt_tokens=507 if task == "generate" else None,
        cfg_parallel=True,
    )


FAMILY = Family(
    "qwen_image",
    (
        _qwen("QwenImagePipeline", "generate", 0),
        _qwen("QwenImageEditPipeline", "edit", 1),
        _qwen("QwenImageEditPlusPipeline", "edit", 3),
    ),
    {
        "tiny/qwen-image": "QwenImagePipeline",
        "tiny/qwen-image-edit": "QwenImageEditPipeline",
        "tiny/qwen-image-edit-plus": "QwenImageEditPlusPipeline",
    },
    {"tiny/qwen-image-lora": "tiny/qwen-image"},
    refused={
        "QwenImageLayeredPipeline": "returns several RGBA layers per image (a list of layers per prompt), while the "
        "engine returns images per request; serving it needs a per-family output hook and a `layers` request "
        "field, and diffusers 0.42.1's pipeline splits the layers of a batch of more than one image at the wrong "
        "offsets",
    },
    # Measured at 1024x1024 and 1328x1328: 4.14 and 6.96 GiB untiled (benchmarks/results/vae_decode.json).
    decode_bytes_per_pixel={"AutoencoderKLQwenImage": 4240},
)
