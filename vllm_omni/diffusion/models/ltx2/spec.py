"""LTX-2 (text-to-video and image-to-video, with sound): what the engine knows of the family without importing torch
(models/spec.py), collected by models/registry.py."""

from __future__ import annotations

from vllm_omni.diffusion.models.spec import COMMON_FIELDS, VIDEO_FIELDS, Family, PipelineSpec

# Why the two-stage recipe's own pipeline is refused (registry.REFUSED: the engine's start error).
TWO_STAGE_REFUSAL = (
    "is the middle step of LTX-2's two-stage recipe (stage 1 with LTX2Pipeline, this latent upsampler, then a "
    "distilled refining pass with LTX2Pipeline again at the stage-2 sigmas): three pipeline calls, which "
    "LTX2Pipeline does not run as one; serve the LTX2Pipeline checkpoint (one stage, at the requested size)"
)


def _ltx2(diffusers_class: str, image_required: bool) -> PipelineSpec:
    return PipelineSpec(
        diffusers_class,
        "ltx2",
        "generate",
        COMMON_FIELDS | VIDEO_FIELDS | {"negative_prompt", "guidance_scale"},
        modality="video",
        # Text-to-video checkpoints (LTX2Pipeline: the released one) take an optional image: image-to-video on the
        # same components (pipeline.py).
        max_input_images=1,
        input_image_required=image_required,
        size_multiple=32,  # the video VAE's 32x, 1x1 patches (the pipelines refuse other sizes)
        frame_multiple=8,  # the VAE compresses time 8x: 8k + 1 frames
        default_steps=30,
        # One step is NaN: the released scheduler stretches its sigmas to shift_terminal, dividing by 1 - sigma at
        # the last step, which is 0 when the first step is the last.
        min_steps=2,
        default_size=(768, 512),  # both pipelines' height/width defaults
        default_frames=121,
        default_fps=24,  # frame_rate: the audio lasts num_frames / fps seconds
        # An image without a size: the video takes its aspect ratio at the default's area (rounded to 32), rather
        # than stretching it to 768x512.
        source_resize="area",
        source_area=768 * 512,
        # Gemma 3 reads 1024 tokens (max_sequence_length), its <bos> included.
        max_prompt_tokens=1023,
        # 2**17: admits 3840x2176 x 121 frames (120 x 68 x 16 = 130560 video tokens; the audio adds 126); the
        # released default, 768x512 x 121, is 6144.
        max_tokens_per_step=131072,
        heads_over_sp_group=True,  # StreamCrossAttention: one all-to-all over every SP rank, ring ranks too
        cfg_parallel_refusal="runs classifier-free guidance as one batched forward per step (the prompt's and the "
        "negative prompt's rows in one call, then spatio-temporal and modality guidance as forwards of their own), "
        "which CFG parallel's exchange of two calls per step cannot split",
    )


FAMILY = Family(
    "ltx2",
    (_ltx2("LTX2Pipeline", image_required=False), _ltx2("LTX2ImageToVideoPipeline", image_required=True)),
    {"tiny/ltx-2": "LTX2Pipeline", "tiny/ltx-2-i2v": "LTX2ImageToVideoPipeline"},
    refused={"LTX2LatentUpsamplePipeline": TWO_STAGE_REFUSAL},
)
