"""Z-Image: what the engine knows of the family without importing torch (models/spec.py), collected by
models/registry.py."""

from __future__ import annotations

from vllm_omni.diffusion.models.spec import COMMON_FIELDS, Family, PipelineSpec


def _z_image(diffusers_class: str, task: str) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "z_image",
        task,
        COMMON_FIELDS | {"negative_prompt", "guidance_scale"},
        # One source image at most: text-to-image checkpoints run a request with one as img2img (pipeline.py).
        max_input_images=1,
        input_image_required=task == "edit",
        # Without a source, __call__'s height/width default of 1024. img2img starts from the source, at its
        # own size floored to 16 (a requested size resizes the source first: pipeline.py).
        default_size=(1024, 1024) if task == "generate" else None,
        # Qwen3 reads 512 tokens (max_sequence_length) of the chat-templated prompt: the user's prompt and the
        # 3 + 5 template tokens around it.
        max_prompt_tokens=504,
        cfg_parallel_refusal="runs classifier-free guidance (guidance_scale > 0) as one batched forward per step "
        "(prompts and negative prompts in one call), which CFG parallel's exchange of two calls per step cannot split",
        step_cache_refusal="does not fit diffusers' First-Block-Cache (0.42.1): its transformer has no cache "
        "contexts (no CacheMixin) and its blocks name their input `x`, where the hook looks up `hidden_states` "
        "and fails; serve it uncached",
    )


FAMILY = Family(
    "z_image",
    # Z-Image and its 8-step Turbo: one single-stream DiT; CFG (guidance_scale > 0) is batched in one forward.
    # Text-to-image checkpoints take an optional source image (img2img on the same components).
    (_z_image("ZImagePipeline", "generate"), _z_image("ZImageImg2ImgPipeline", "edit")),
    {"tiny/z-image": "ZImagePipeline"},
)
