"""LTX-2 pipelines (`LTX2Pipeline` text-to-video, `LTX2ImageToVideoPipeline`) with our SP transformer.

The diffusers pipeline does everything else: Gemma 3 prompt encoding and the text connectors (one for each stream),
the video and audio latents, the scheduler, guidance (classifier-free guidance as one batched forward of
[negative, prompt] rows, then spatio-temporal and modality guidance as forwards of their own, at the pipeline's
defaults), the video VAE decode, and the audio VAE decode into a mel spectrogram that the vocoder turns into a
waveform. The result carries both: `frames` and `audio` (one [channels, samples] waveform a video, at the vocoder's
`output_sampling_rate`), which the runner hands on with the frames (`FamilyPipeline.audio`).

A checkpoint of the text-to-video pipeline (the released LTX-2) serves image-to-video too: a request with an image
runs `LTX2ImageToVideoPipeline` built on the same components.
"""

from __future__ import annotations

import json
import weakref
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from diffusers import LTX2ImageToVideoPipeline
from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

from vllm_omni.diffusion.models.family import FamilyPipeline, call_arg
from vllm_omni.diffusion.models.ltx2.transformer import LTX2VideoTransformer3DModel
from vllm_omni.diffusion.request import Audio, DiffusionRequest

if TYPE_CHECKING:
    from vllm_omni.diffusion.models.spec import PipelineSpec

EMBEDS = ("prompt_embeds", "prompt_attention_mask", "negative_prompt_embeds", "negative_prompt_attention_mask")

# The H.264 quality the image-to-video pipeline re-compresses its input image at, per loaded pipeline: it reads it
# from the text encoder's generation, which an SP peer does not load (text encoded once), so it is read from the
# checkpoint's config once and passed explicitly, the same on every rank.
_image_crf: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def checkpoint_image_crf(pipe: Any) -> int:
    """The image-conditioning CRF the pipeline would resolve from its text encoder, read from the checkpoint's
    text_encoder/config.json where the encoder is not loaded."""
    if getattr(pipe, "text_encoder", None) is not None:
        return resolve_default_image_crf(pipe.text_encoder)
    model_type = None
    config = Path(str(pipe.config.get("_name_or_path", ""))) / "text_encoder" / "config.json"
    if config.is_file():
        model_type = json.loads(config.read_text()).get("model_type")
    return resolve_default_image_crf(SimpleNamespace(config=SimpleNamespace(model_type=model_type)))


class LTX2Family(FamilyPipeline):
    # CFG runs as one batched forward ([negative, prompt] rows), so `uses_cfg` (two calls a step) stays False.
    denoisers = {"transformer": LTX2VideoTransformer3DModel}
    default_negative_prompt = ""  # encode_prompt's, when a CFG request gives none
    # Gemma 3 and its tokenizer serve only prompt encoding (the connectors run in the pipeline on the embeddings).
    text_encoders = ("text_encoder", "tokenizer")

    def pipeline_kwargs(self, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """Keyword arguments of the pipeline's `__call__` (None fields keep the pipeline's defaults)."""
        kwargs: dict[str, Any] = {
            "prompt": request.prompt,
            "negative_prompt": request.negative_prompt,
            "num_inference_steps": request.num_inference_steps,
            "num_videos_per_prompt": request.num_images,
        }
        for name, value in (
            ("height", request.height),
            ("width", request.width),
            ("num_frames", request.num_frames),
            ("frame_rate", request.fps),  # the audio's duration is num_frames / frame_rate
            ("guidance_scale", request.guidance_scale),
        ):
            if value is not None:
                kwargs[name] = value
        if request.images:
            kwargs["image"] = request.images[0]  # resized to the video's size by the pipeline
        elif spec.input_image_required:
            raise ValueError("image-to-video needs an input image")
        return kwargs

    def prepare_pipeline(self, pipe: Any) -> None:
        _image_crf[pipe] = checkpoint_image_crf(pipe)

    def pipeline_for(self, pipe: Any, request: DiffusionRequest) -> Any:
        """The image-to-video pipeline on `pipe`'s components for a request with an image; else `pipe`."""
        if not request.images or isinstance(pipe, LTX2ImageToVideoPipeline):
            return pipe
        image_to_video = LTX2ImageToVideoPipeline(**pipe.components)  # the same modules: no weights copied
        image_to_video.set_progress_bar_config(**getattr(pipe, "_progress_bar_config", {}))
        return image_to_video

    def call_kwargs(self, pipe: Any, request: DiffusionRequest, spec: PipelineSpec) -> dict[str, Any]:
        """`pipeline_kwargs`, with the input image's re-compression quality stated (the same on every rank), and
        spatio-temporal guidance left out where the transformer has nothing to perturb.

        The pipeline's default runs spatio-temporal guidance (`stg_scale` 1.0) as a forward of its own each step,
        its blocks' self-attention perturbed; a transformer without perturbed attention (LTX-2.0's,
        `perturbed_attn` False) runs that forward as the prompt's own, so its guidance term is the prompt's
        prediction minus itself: zero up to the rounding of a batch of one against the CFG batch's row. Leaving
        it out saves one forward of the three a step and changes the result by that rounding alone."""
        kwargs = self.pipeline_kwargs(request, spec)
        if "image" in kwargs:
            kwargs["image_crf"] = _image_crf[pipe] if pipe in _image_crf else checkpoint_image_crf(pipe)
        if not pipe.transformer.config.get("perturbed_attn", False):
            kwargs["stg_scale"] = kwargs["audio_stg_scale"] = 0.0
        return kwargs

    def encode_text(
        self, pipe: Any, kwargs: dict[str, Any], device: torch.device, progress: Any = None
    ) -> dict[str, torch.Tensor]:
        """The prompt's Gemma embeddings and mask, and the negative prompt's where the call runs CFG (video or
        audio guidance above 1, as `do_classifier_free_guidance`), num_videos_per_prompt rows each: given
        embeddings, the pipeline takes its batch from them and repeats nothing."""
        scale = call_arg(pipe, kwargs, "guidance_scale")
        audio_scale = call_arg(pipe, kwargs, "audio_guidance_scale") or scale  # as __call__ resolves it
        embeds = pipe.encode_prompt(
            kwargs["prompt"],
            kwargs.get("negative_prompt"),
            do_classifier_free_guidance=scale > 1 or audio_scale > 1,
            num_videos_per_prompt=call_arg(pipe, kwargs, "num_videos_per_prompt"),
            max_sequence_length=call_arg(pipe, kwargs, "max_sequence_length"),
            device=device,
        )
        return {name: tensor for name, tensor in zip(EMBEDS, embeds) if tensor is not None}

    def audio(self, pipe: Any, result: Any) -> Audio:
        """The vocoder's waveforms ([n, channels, samples], stereo for LTX-2) at its output sampling rate."""
        samples = result.audio
        samples = (
            samples.float().cpu().numpy() if isinstance(samples, torch.Tensor) else np.asarray(samples, np.float32)
        )
        return Audio(samples, int(pipe.vocoder.config.output_sampling_rate))

    def with_text(self, kwargs: dict[str, Any], embeds: dict[str, torch.Tensor]) -> dict[str, Any]:
        """The prompts replaced, and one video per embeddings row (they hold num_videos_per_prompt rows)."""
        if not embeds:
            return kwargs
        return dict(super().with_text(kwargs, embeds), num_videos_per_prompt=1)


FAMILY = LTX2Family()
