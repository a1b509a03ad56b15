"""Request checks: what a user asked for -> a `DiffusionRequest` the workers can run as is.

`RequestPreprocessor` is `DiffusionEngine.preprocess`: it runs in the engine's process before a
request is queued, so bad input is refused at once and no worker sees it. Every problem is a
`RequestError` naming the field. Besides types and limits it settles what the pipeline would
otherwise decide by itself, so that it can be checked: the output size (a default, or one
derived from a source image), the frame count and the seed. The work of one denoising step is
bounded by its tokens (`PipelineSpec.tokens_per_step` against `max_tokens_per_step`), so a
request no GPU finishes within the stall deadline is refused here instead of restarting the
workers; the same count estimates the request's work for the fair scheduling policy. Prompts
are counted in the model's own tokenizer (loaded here; cheap next to the workers' load) and
source images are checked from their headers only (images.py). Nothing here needs torch.
"""

from __future__ import annotations

import dataclasses
import json
import math
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_omni.diffusion.config import EngineLimits, Envelope, StepCacheConfig
from vllm_omni.diffusion.engine.request_fields import SAMPLING_FIELDS
from vllm_omni.diffusion.images import inspect_image
from vllm_omni.diffusion.models.spec import PipelineSpec
from vllm_omni.diffusion.request import DiffusionRequest, GenerationParams, LoraRequest, RequestError
from vllm_omni.logger import init_logger

logger = init_logger(__name__)

MAX_SEED = 2**63 - 1


def check_int(name: str, value: Any, low: int, high: int) -> int:
    if isinstance(value, bool):  # True would pass as 1
        raise RequestError(f"{name} must be an integer, got {value!r}", name)
    if not isinstance(value, int):
        try:
            if float(value) != int(value):
                raise ValueError
            value = int(value)
        except (TypeError, ValueError, OverflowError):
            raise RequestError(f"{name} must be an integer, got {value!r}", name) from None
    if not low <= value <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {value}", name)
    return value


def check_float(name: str, value: Any, low: float, high: float) -> float:
    if isinstance(value, bool):
        raise RequestError(f"{name} must be a number, got {value!r}", name)
    try:
        value = float(value)
    except (TypeError, ValueError):
        raise RequestError(f"{name} must be a number, got {value!r}", name) from None
    if not math.isfinite(value) or not low <= value <= high:
        raise RequestError(f"{name} must be between {low} and {high}, got {value}", name)
    return value


class PromptTokenCounter:
    """Counts prompt tokens with the model folder's tokenizer, without tokenizing absurd texts.

    No tokenizer in the folder (or one transformers cannot load): no token count, only the
    character bound.
    """

    def __init__(self, model_path: Path) -> None:
        self.tokenizer = None
        self.max_token_chars = 64  # a bound on one token's characters, for texts with no tokenizer
        folder = model_path / "tokenizer"
        if not folder.is_dir():
            return
        try:
            from transformers import AutoTokenizer

            self.tokenizer = AutoTokenizer.from_pretrained(folder)
        except Exception as exc:  # noqa: BLE001 - the workers load it their own way; only the count is lost
            logger.warning("Cannot load the tokenizer in %s (%s): prompts are bounded by characters only", folder, exc)
            return
        # A token's vocabulary string has at least as many characters as the text it covers
        # (byte-level BPE spells each byte as one character), added tokens included.
        self.max_token_chars = max(map(len, self.tokenizer.get_vocab()))

    def check(self, name: str, text: str, limit: int) -> None:
        """RequestError when `text` has more than `limit` tokens."""
        if len(text) > (limit + 1) * self.max_token_chars:
            # More than limit + 1 tokens for sure: refused without spending seconds on tokenizing it.
            raise RequestError(f"{name} is far longer than the limit of {limit} tokens ({len(text)} characters)", name)
        if self.tokenizer is None:
            return
        count = len(self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"])
        if count > limit:
            raise RequestError(f"{name} is {count} tokens; the limit is {limit}", name)


def bucket_target_size(model_path: Path, default: int) -> int:
    """The checkpoint's `target_size` (transformer/config.json) that a bucketed pipeline sizes videos by; `default`
    (the family's `size_buckets`) where the config has none."""
    config = json.loads((model_path / "transformer" / "config.json").read_text())
    return config.get("target_size", default)


class RequestPreprocessor:
    def __init__(
        self,
        spec: PipelineSpec,
        limits: EngineLimits,
        model_path: Path,
        cache: StepCacheConfig | None = None,
        resolve_lora: Callable[[Any], LoraRequest | None] | None = None,
    ) -> None:
        self.spec = spec
        self.resolve_lora = resolve_lora  # LoraRegistry.resolve (adapters.py); None: no adapters
        self.cache = cache  # the server's step cache (its default threshold), None for none
        self.limits = limits.for_model(spec)
        self.tokens = PromptTokenCounter(model_path)
        self.max_prompt_tokens = min(limits.max_prompt_tokens, spec.max_prompt_tokens or limits.max_prompt_tokens)
        self.target_size = bucket_target_size(model_path, spec.size_buckets) if spec.size_buckets else None
        # The deploy's envelope once its ranks found it (admission.py; the engine sets it): a row holds no more.
        self.envelope: Callable[[], Envelope | None] = lambda: None

    def __call__(self, params: GenerationParams, request_id: str, cancel_token: int) -> DiffusionRequest:
        start = time.perf_counter()
        limits, spec = self.limits, self.spec
        if params.output_type not in ("pil", "np", "uint8"):
            raise RequestError(f"output_type must be 'pil', 'np' or 'uint8', got {params.output_type!r}", "output_type")
        for f in SAMPLING_FIELDS:
            if getattr(params, f.name) is not None and not spec.takes(f.name):
                raise RequestError(f"{f.name} is not accepted by {spec.diffusers_class}", f.name)
        self._check_text("prompt", params.prompt, required=True)
        self._check_text("negative_prompt", params.negative_prompt, required=False)
        height, width = (self._check_size(n, v) for n, v in (("height", params.height), ("width", params.width)))
        if not spec.input_image_required and (height is None) != (width is None):
            raise RequestError("give both height and width, or neither", "height" if height is None else "width")
        steps = params.num_inference_steps if params.num_inference_steps is not None else spec.default_steps
        steps = check_int("num_inference_steps", steps, spec.min_steps, limits.max_steps)
        n = check_int("n", 1 if params.n is None else params.n, 1, limits.max_n)
        guidance, guidance_2 = (
            None if value is None else check_float(name, value, 0, 100)
            for name, value in (
                ("guidance_scale", params.guidance_scale),
                ("guidance_scale_2", params.guidance_scale_2),
            )
        )
        true_cfg = None
        if spec.takes("true_cfg_scale"):
            # True CFG needs a negative prompt; without one the default is plain sampling, not a warning.
            true_cfg = params.true_cfg_scale
            if true_cfg is None:
                true_cfg = spec.default_true_cfg_scale if params.negative_prompt is not None else 1.0
            true_cfg = check_float("true_cfg_scale", true_cfg, 0, 100)
        num_frames = fps = None
        if spec.modality == "video":
            num_frames = self._check_frames(params.num_frames)
            if num_frames is None and spec.default_frames is not None:
                num_frames = spec.default_frames  # checked like a requested count, then passed on
                if num_frames > limits.max_frames:
                    raise RequestError(
                        f"without num_frames, this request would run {num_frames} frames (the model's default); "
                        f"num_frames must be at most {limits.max_frames}: ask for fewer",
                        "num_frames",
                    )
            fps = check_int("fps", spec.default_fps if params.fps is None else params.fps, 1, limits.max_fps)
        seed = params.seed
        if seed is None:
            seed = secrets.randbelow(2**31)
            logger.info("No seed given: drew seed %d", seed)
        seed = check_int("seed", seed, 0, MAX_SEED)
        priority = check_int("priority", 0 if params.priority is None else params.priority, -MAX_SEED - 1, MAX_SEED)
        cache_threshold = self._check_cache_threshold(params.cache_threshold)
        lora = None
        if params.lora is not None:
            if self.resolve_lora is None:
                raise RequestError("this engine serves no LoRA adapters", "lora")
            lora = self.resolve_lora(params.lora)
        images, source_sizes = self._check_images(params.image)
        if height is None or width is None:
            width, height = self._derived_size(width, height, source_sizes)
        tokens = self._check_tokens(width, height, num_frames, source_sizes)
        # Image-to-video pipelines size the video from the image themselves (not passed to them); the size
        # derived here is the one they pick, so the request carries it for the job's record from the start.

        request = DiffusionRequest(
            request_id=request_id,
            prompt=params.prompt,
            negative_prompt=params.negative_prompt,
            images=images,
            height=height,
            width=width,
            num_inference_steps=steps,
            guidance_scale=guidance,
            guidance_scale_2=guidance_2,
            true_cfg_scale=true_cfg,
            num_images=n,
            seed=seed,
            cache_threshold=cache_threshold,
            num_frames=num_frames,
            fps=fps,
            lora=lora,
            priority=priority,
            # Classifier-free guidance (two forwards a step for some requests) is left out: the family decides it.
            work=steps * tokens * n,
            tokens=tokens,
            cancel_token=cancel_token,
            output_type=params.output_type,
        )
        request.preprocess_ms = (time.perf_counter() - start) * 1e3
        return request

    def _check_cache_threshold(self, value: Any) -> float | None:
        if value is None:
            return None if self.cache is None else self.cache.threshold
        if self.cache is None:
            raise RequestError(
                "cache_threshold needs a server with a step cache (started with --cache first_block); it runs none",
                "cache_threshold",
            )
        try:
            return dataclasses.replace(self.cache, threshold=value).threshold  # the config's own check
        except ValueError as exc:
            raise RequestError(str(exc), "cache_threshold") from None

    def _check_text(self, name: str, text: Any, required: bool) -> None:
        if text is None and not required:
            return
        if not isinstance(text, str) or (required and not text.strip()):
            raise RequestError(f"{name} must be a non-empty string" if required else f"{name} must be a string", name)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as exc:
            # JSON can spell a lone surrogate ("\ud800"); no tokenizer can take one.
            raise RequestError(
                f"{name} is not valid Unicode text: lone surrogate {text[exc.start]!r} at character {exc.start}", name
            ) from None
        self.tokens.check(name, text, self.max_prompt_tokens)

    def _check_size(self, name: str, value: Any) -> int | None:
        if value is None:
            return None
        value = check_int(name, value, 1, self.limits.max_image_size)
        multiple = self.spec.size_multiple
        if value < multiple:
            raise RequestError(f"{name} must be at least {multiple}, got {value}", name)
        if value % multiple:
            if self.spec.exact_size:
                raise RequestError(
                    f"{name}={value} is not a multiple of {multiple}: {self.spec.diffusers_class} needs both "
                    f"sides on its {multiple}-pixel grid (ask for {value // multiple * multiple} or "
                    f"{(value // multiple + 1) * multiple})",
                    name,
                )
            rounded = value // multiple * multiple
            logger.warning("%s=%d is not a multiple of %d: rounded down to %d", name, value, multiple, rounded)
            value = rounded
        return value

    def _check_frames(self, value: Any) -> int | None:
        """None (the pipeline's default) or a frame count the VAE can encode: k * frame_multiple + 1."""
        if value is None:
            return None
        value = check_int("num_frames", value, 1, self.limits.max_frames)
        multiple = self.spec.frame_multiple
        if (value - 1) % multiple:
            rounded = (value - 1) // multiple * multiple + 1
            logger.warning("num_frames=%d is not k*%d+1: rounded down to %d", value, multiple, rounded)
            value = rounded
        return value

    def _check_images(self, image: Any) -> tuple[list[Any] | None, list[tuple[int, int]]]:
        spec, limits = self.spec, self.limits
        sources = image if isinstance(image, (list, tuple)) else [image]
        sources = [s for s in sources if s is not None]
        if spec.max_input_images == 0 and sources:
            raise RequestError(
                f"image is not accepted by {spec.diffusers_class}: it takes a text prompt only "
                f"(image-to-{spec.modality} is not served by it)",
                "image",
            )
        if spec.input_image_required and not sources:
            raise RequestError(f"image is required by {spec.diffusers_class}", "image")
        if not sources:
            return None, []
        most = min(spec.max_input_images, limits.max_input_images)
        if len(sources) > most:
            raise RequestError(f"image: at most {most} image(s) for this model, got {len(sources)}", "image")
        images, sizes = [], []
        for i, source in enumerate(sources):
            name = f"image[{i}]" if len(sources) > 1 else "image"
            data, (width, height) = inspect_image(source, limits, name)
            ratio = spec.max_source_aspect_ratio
            if ratio is not None and max(width, height) > ratio * min(width, height):
                raise RequestError(
                    f"{name} is {width}x{height}: sides more than {ratio:g}:1 apart are not supported by "
                    f"{spec.diffusers_class}",
                    "image",
                )
            if spec.source_resize is not None:
                encoded = spec.source_size(width, height)
                if min(encoded) < spec.size_multiple:
                    raise RequestError(
                        f"{name} is {width}x{height}: {spec.diffusers_class} would encode it at "
                        f"{encoded[0]}x{encoded[1]}; it needs at least {spec.size_multiple} pixels a side",
                        "image",
                    )
            images.append(data)
            sizes.append((width, height))
        return images, sizes

    def _derived_size(
        self, width: int | None, height: int | None, source_sizes: list[tuple[int, int]]
    ) -> tuple[int | None, int | None]:
        """The size the pipeline would pick where the request gave none, checked like a requested one."""
        spec = self.spec
        picked = spec.output_size(source_sizes, self.target_size)
        if picked is None:
            return width, height
        why = "taken from the input image" if source_sizes else "the model's default"
        # A pipeline that takes no size (image-to-video) picks one of its checkpoint's buckets: only the
        # token limit applies to it.
        for name, given, value in (("width", width, picked[0]), ("height", height, picked[1])):
            if spec.takes(name) and given is None and not spec.size_multiple <= value <= self.limits.max_image_size:
                raise RequestError(
                    f"without a {name}, this request would run at {picked[0]}x{picked[1]} ({why}); "
                    f"{name} must be between {spec.size_multiple} and {self.limits.max_image_size}: "
                    "ask for a size",
                    name,
                )
        multiple = spec.size_multiple
        width = width if width is not None else picked[0] // multiple * multiple
        height = height if height is not None else picked[1] // multiple * multiple
        return width, height

    def _check_tokens(
        self, width: int | None, height: int | None, num_frames: int | None, source_sizes: list[tuple[int, int]]
    ) -> int:
        """The tokens one denoising step processes (0: not known here); RequestError when they are more than
        max_tokens_per_step.

        It names what to change: the input images where the output alone fits; else the size where
        it is too large even at the model's default length; else the frame count.
        """
        spec, limit = self.spec, self.limits.max_tokens_per_step
        if width is None or height is None:
            return 0  # a size the pipeline picks that is not restated here (none of the served pipelines)
        tokens = spec.tokens_per_step(width, height, num_frames, source_sizes)
        envelope = self.envelope()
        memory_binds = envelope is not None and envelope.max_tokens_per_step < limit
        limit = envelope.max_tokens_per_step if memory_binds else limit
        if tokens <= limit:
            return tokens
        output = spec.tokens_per_step(width, height, num_frames, [])
        step = spec.token_side
        what, grid = f"{width}x{height}", f"{width // step} x {height // step} tokens"
        if num_frames is not None:
            what += f" x {num_frames} frames"
            grid += f" x {(num_frames - 1) // spec.frame_multiple + 1} latent frames"
        if output < tokens:
            grid += f" + {tokens - output} of the {len(source_sizes)} input image(s)"
        if output <= limit:
            param, fix = "image", "send fewer or smaller input images"
        elif spec.takes("height") and spec.tokens_per_step(width, height, spec.default_frames, []) > limit:
            param, fix = "width", "ask for a smaller size"  # over HTTP: `size`
        else:
            param, fix = "num_frames", "ask for fewer frames"
        if memory_binds:  # the GPU memory, not the limit
            bound, wider = "this deploy's GPU memory holds", "or serve with FP8 or a higher --ulysses-degree"
        else:
            bound, wider = "the limit is", "or raise the limit (--max-tokens-per-step)"
        raise RequestError(f"this request is {tokens} tokens per denoising step ({what}: {grid}); {bound} {limit}: "
                           f"{fix}, {wider}", param)  # fmt: skip
