"""Media encoders for what the engine returns: PNG, JPEG and WebP for images, MP4 (H.264, with an AAC track where
the video has sound) for videos.

Images go through Pillow, videos through PyAV (FFmpeg's libraries, shipped in its wheels):
maintained encoders; nothing here writes container or codec bytes by hand. Used by the API
routes (routes/images.py, the videos API) and `vllm-omni generate`.
"""

from __future__ import annotations

import base64
import contextlib
import ctypes
import io
import threading
from collections.abc import Iterator
from fractions import Fraction
from typing import Any

import numpy as np

IMAGE_FORMATS = ("png", "jpeg", "webp")


def encode_image(image: Any, fmt: str = "png", quality: int | None = None) -> bytes:
    """A PIL image -> the bytes of a PNG, JPEG or WebP file (`quality` 0-100 for JPEG and WebP)."""
    if fmt not in IMAGE_FORMATS:
        raise ValueError(f"image format must be one of {', '.join(IMAGE_FORMATS)}, got {fmt!r}")
    if fmt == "jpeg" and image.mode == "RGBA":  # JPEG has no alpha (some VAEs decode RGBA): dropped
        image = image.convert("RGB")
    options = {} if fmt == "png" or quality is None else {"quality": quality}
    buffer = io.BytesIO()
    image.save(buffer, format=fmt.upper(), **options)
    return buffer.getvalue()


def encode_images_b64(images: list[Any], fmt: str = "png", quality: int | None = None) -> list[str]:
    """`encode_image` for each image, base64 text (the images API's `b64_json`)."""
    return [base64.b64encode(encode_image(image, fmt, quality)).decode("ascii") for image in images]


AUDIO_LAYOUTS = {1: "mono", 2: "stereo"}


def encode_video_output(output: Any, index: int = 0) -> bytes:
    """Video `index` of an engine result (`DiffusionOutput`: uint8 frames) as an MP4, at its fps, with its sound
    where the model makes some (`output.audio`): what both video routes answer with."""
    audio = output.audio[index] if output.audio else None
    return encode_mp4(output.images[index], output.fps, audio=audio, sample_rate=output.audio_sample_rate)


# libx264 (PyAV's, and FFmpeg's builds generally) reads heap memory it never wrote, with its macroblock tree and
# B-frames at most sizes (208x144, 848x480, 1296x720; not 1280x720): the same frames then encode to different
# bytes, from one call to the next, in a process whose heap has been used, as a server's has. Turning either off
# makes the file 2.4x larger on a smooth pan at the same quality. Instead, while an encode runs, glibc fills every
# block it hands out with one byte (mallopt M_PERTURB), so what is read is the same each time, and so is the file.
_M_PERTURB = -6  # glibc's malloc.h
_FILL_BYTE = 0x5A
_fill_lock = threading.Lock()
_fill_users = 0


def _mallopt() -> Any:
    try:
        return ctypes.CDLL(None).mallopt  # glibc's; elsewhere none, and encodes are what they are
    except (OSError, AttributeError):
        return None


_MALLOPT = _mallopt()


@contextlib.contextmanager
def filled_allocations() -> Iterator[None]:
    """New heap blocks are filled with one byte until the last of the encodes inside this ends."""
    global _fill_users
    with _fill_lock:
        if _fill_users == 0 and _MALLOPT is not None:
            _MALLOPT(_M_PERTURB, _FILL_BYTE)
        _fill_users += 1
    try:
        yield
    finally:
        with _fill_lock:
            _fill_users -= 1
            if _fill_users == 0 and _MALLOPT is not None:
                _MALLOPT(_M_PERTURB, 0)


def encode_mp4(
    frames: np.ndarray,
    fps: int,
    crf: int = 18,
    audio: np.ndarray | None = None,
    sample_rate: int | None = None,
) -> bytes:
    """uint8 frames [F, H, W, 3] -> an MP4 file (H.264, yuv420p, plays everywhere); with `audio` (a float waveform
    [channels, length] in [-1, 1], mono or stereo, at `sample_rate` Hz), an AAC track beside the video.

    yuv420p needs even sides: an odd width or height is padded by one edge pixel.
    """
    import av

    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames [F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    if audio is not None:
        audio = np.asarray(audio, dtype=np.float32)
        if audio.ndim != 2 or audio.shape[0] not in AUDIO_LAYOUTS or not sample_rate:
            raise ValueError(
                f"expected audio [channels, length] of 1 or 2 channels with its sample rate, got "
                f"{tuple(audio.shape)} at {sample_rate!r} Hz"
            )
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    buffer = io.BytesIO()
    with filled_allocations(), av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        sound = None
        if audio is not None:  # every stream is added before the first packet writes the header
            layout = AUDIO_LAYOUTS[audio.shape[0]]
            sound = container.add_stream("aac", rate=sample_rate)
            sound.layout = layout
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
        if sound is not None:
            # Planar float, as AAC takes it; the encoder cuts it into its own frames.
            samples = av.AudioFrame.from_ndarray(np.ascontiguousarray(audio.clip(-1, 1)), format="fltp", layout=layout)
            samples.sample_rate, samples.pts = sample_rate, 0
            container.mux(sound.encode(samples))
            container.mux(sound.encode())
    return buffer.getvalue()
