"""A request and its result as they travel between the engine and its workers (pickled), and the errors
a request can end in. Imports nothing of the package.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

OutputType = Literal["pil", "np", "uint8"]


@dataclass(frozen=True)
class LoraRequest:
    """The LoRA adapter a request runs with, as the engine resolved it (engine/adapters.py): its name, its file or
    folder, and the scale its update is multiplied by."""

    name: str
    path: str  # every denoiser's file; with `path_2`, the first denoiser's only (of two experts: the high-noise one)
    scale: float = 1.0
    version: int = 0  # the registry's load count for this name: a reload under the same name and path is read anew
    path_2: str | None = None  # the second denoiser's own file (transformer_2, the low-noise expert); None: `path`

    @property
    def paths(self) -> tuple[str, ...]:
        """Its files: one for every denoiser, or one per expert (high noise, low noise)."""
        return (self.path,) if self.path_2 is None else (self.path, self.path_2)

    def path_for(self, denoiser: str) -> str:
        """The file `denoiser` ('transformer', 'transformer_2') reads."""
        return self.path_2 if denoiser == "transformer_2" and self.path_2 is not None else self.path


@dataclass
class GenerationParams:
    """A request as the user gave it; `DiffusionEngine.preprocess` validates it into a `DiffusionRequest`.

    The sampling fields are those of request_fields.SAMPLING_FIELDS (a test keeps them equal).
    """

    prompt: str
    negative_prompt: str | None = None
    image: Any = None  # PIL image, path, bytes, or a list of them (edit models, reference images)
    height: int | None = None
    width: int | None = None
    num_inference_steps: int | None = None
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None
    true_cfg_scale: float | None = None
    n: int | None = None
    seed: int | None = None
    cache_threshold: float | None = None
    num_frames: int | None = None
    fps: int | None = None
    # A LoRA adapter: a served one's name, or {"name": ..., "scale": ...} (scale default 1.0); offline also
    # {"name", "path", "scale"} for an adapter not served yet. None: the base model.
    lora: str | dict[str, Any] | None = None
    priority: int | None = None  # the queue's order under --scheduling-policy priority (lower first); None: 0
    # pil: PIL images (a video: a list of PIL frames); np: float32 arrays in [0, 1]; uint8: uint8 arrays
    output_type: OutputType = "pil"
    request_id: str | None = None


@dataclass
class DiffusionRequest:
    """One generation or edit, as the engine validated it (sizes already rounded, seed drawn)."""

    request_id: str
    prompt: str
    negative_prompt: str | None = None
    # Source images (edits, references, image-to-video) as the engine checked them: the
    # compressed file bytes (the worker decodes them; queued requests stay small), or PIL images
    # handed to `Omni.generate`.
    images: list[Any] | None = None
    height: int | None = None  # None: the pipeline's default (edits: from the source aspect ratio)
    width: int | None = None
    num_inference_steps: int = 50
    guidance_scale: float | None = None
    guidance_scale_2: float | None = None  # a two-expert model's low-noise expert; None: guidance_scale
    true_cfg_scale: float | None = None  # None: the pipeline takes no true CFG
    num_images: int = 1
    seed: int = 0
    cache_threshold: float | None = None  # the step cache's, on a server with one (else None)
    num_frames: int | None = None  # video only; None: the pipeline's default
    fps: int | None = None  # video only
    lora: LoraRequest | None = None  # merged into the denoisers for this request (worker/lora.py); None: base
    priority: int = 0  # the queue's order under the priority policy (engine/policy.py), lower first
    # Its estimated work, denoising steps x tokens per step x images (the fair policy's order); 0: not estimated.
    work: int = 0
    tokens: int = 0  # image (video) tokens of one row's denoising step (PipelineSpec.tokens_per_step); 0: not known
    # Rows one pipeline call may hold (the deploy's envelope, config.Envelope): more images run as consecutive
    # calls inside this request, each image from its own generator; 0: all in one call.
    rows_per_forward: int = 0
    # A CFG step's two branches run as the rows of one forward (worker/cfg_batch.py): the engine's decision
    # (admission.fit), so every rank of the group takes the same.
    cfg_one_pass: bool = False
    profile: bool = False  # the warm-up's measured step: the denoising alone (no decode), its peak memory reported
    cancel_token: int = 0  # the executor's number for this request; cancelling flags it
    output_type: OutputType = "pil"
    preprocess_ms: float = 0.0  # time validation took (the server validates before queueing)
    # Request batching: the requests whose rows follow this one's in every pipeline call (they share
    # its forwards; `batch_key` says which may). This request carries the run's id and cancel token.
    batch: list[DiffusionRequest] = field(default_factory=list)

    @property
    def rows(self) -> list[DiffusionRequest]:
        """This request and those batched with it, in row order."""
        return [self, *self.batch]

    @property
    def image_seeds(self) -> list[int]:
        """Each image's seed: a request's n images are drawn from seed, seed + 1, ... (each one reproduced alone
        by a request of n=1 at its seed)."""
        return [self.seed + i for i in range(self.num_images)]

    @property
    def forward_chunks(self) -> list[int]:
        """The images of each consecutive pipeline call (`rows_per_forward`; one call for a batch)."""
        rows = self.rows_per_forward
        if not rows or self.batch or self.num_images <= rows:
            return [self.num_images]
        return [min(rows, self.num_images - start) for start in range(0, self.num_images, rows)]


@dataclass(frozen=True)
class Audio:
    """The sound of a pipeline call's videos, where its model makes some: `samples` [n, channels, length], float32
    in [-1, 1], one waveform per video in the order of the frames, at `sample_rate` Hz."""

    samples: Any  # a numpy array (this module imports nothing)
    sample_rate: int


@dataclass
class DiffusionOutput:
    """What the engine returns and how it was made.

    `images` holds one entry per image or video: a PIL image (a video: a list of PIL frames), or an
    array ([H, W, 3], a video [F, H, W, 3]; float32 in [0, 1] for "np", uint8 for "uint8"). A model that
    makes sound with its videos gives `audio`, one float32 [channels, length] waveform per video, at
    `audio_sample_rate` Hz (None: silent videos).
    """

    request_id: str
    images: list[Any]
    seed: int
    height: int
    width: int
    num_frames: int | None = None  # videos only
    fps: int | None = None
    timings_ms: dict[str, float] = field(default_factory=dict)
    batch_size: int = 1  # requests that shared its pipeline call (request batching), itself included
    step_cache: dict[str, Any] | None = None  # step_cache_report: forwards computed and skipped; None: no cache
    cfg_one_pass_steps: int = 0  # denoising steps whose CFG branches ran as one forward (worker/cfg_batch.py)
    seeds: list[int] = field(default_factory=list)  # each image's own seed (DiffusionRequest.image_seeds)
    audio: list[Any] | None = None  # videos with sound: each one's waveform, float32 [channels, length]
    audio_sample_rate: int | None = None


class RequestError(ValueError):
    """Bad input, found by the engine's checks; `param` names the request field at fault.

    The HTTP server answers it with a 400 carrying `param` (height and width travel in `size`).
    """

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestCancelled(Exception):
    """The request was cancelled (its client went away) and stopped at a denoising step."""


class RequestFailed(RuntimeError):
    """The workers could not complete the request; the engine stays usable."""


class RequestOutOfMemory(RequestFailed):
    """The request ran out of device memory on a rank; the message names its size and what helps.

    The ranks freed what it held; the HTTP server answers 507.
    """
