"""Source images: checked from their header in the engine, decoded in the workers.

`inspect_image` (engine.preprocess) reads a file's header only: format, width, height, the
pixel limit, and for PNG the chunk checksums (truncation and corruption, without inflating
anything). A queued request then carries the compressed bytes, not RGB pixels, and each
worker decodes them once with `decode_image` (runner.py). PIL images handed to
`Omni.generate` are already decoded and pass through both. Torch-free.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

from vllm_omni.diffusion.config import EngineLimits
from vllm_omni.diffusion.request import RequestError

# Pillow opens many more formats (EPS even runs Ghostscript): only these are tried.
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
_READABLE = "a readable image (PNG, JPEG, WebP, GIF or BMP)"


def _open(data: bytes, name: str, limits: EngineLimits) -> Any:
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
    except Image.DecompressionBombError:
        raise RequestError(f"{name} has too many pixels; the limit is {limits.max_input_pixels}", "image") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError):
        # Pillow's own messages print the file object ("<_io.BytesIO object at 0x...>"): not for users.
        raise RequestError(f"{name} is not {_READABLE}", "image") from None


def inspect_image(source: Any, limits: EngineLimits, name: str = "image") -> tuple[Any, tuple[int, int]]:
    """(what the request will carry, (width, height)) for a PIL image, a file path or image bytes.

    Reads the header only. Raises RequestError (param "image") for anything unreadable,
    oversized (bytes or pixels) or of another type.
    """
    from PIL import Image

    if isinstance(source, Image.Image):
        size = source.size
    else:
        if isinstance(source, (str, Path)):
            try:
                if Path(source).stat().st_size > limits.max_upload_bytes:
                    raise RequestError(
                        f"{name} ({source}) is larger than the limit of {limits.max_upload_bytes} bytes", "image"
                    )
                source = Path(source).read_bytes()
            except OSError as exc:
                raise RequestError(f"{name}: cannot read {source}: {exc.strerror}", "image") from None
        if isinstance(source, (bytearray, memoryview)):
            source = bytes(source)
        if not isinstance(source, bytes):
            raise RequestError(
                f"{name} must be a PIL image, a file path or image bytes, got {type(source).__name__}", "image"
            )
        if len(source) > limits.max_upload_bytes:
            raise RequestError(f"{name} is {len(source)} bytes; the limit is {limits.max_upload_bytes}", "image")
        image = _open(source, name, limits)
        size = image.size
        if image.format == "PNG":
            try:
                image.verify()  # every chunk's CRC up to IEND: a cut or damaged file fails here, not in a worker
            except Exception:  # noqa: BLE001 - Pillow raises SyntaxError, OSError, struct.error...
                raise RequestError(
                    f"{name} is not {_READABLE}: the PNG data is damaged or cut short", "image"
                ) from None
    width, height = size
    if width < 1 or height < 1:
        raise RequestError(f"{name} is {width}x{height}: it has no pixels", "image")
    if width * height > limits.max_input_pixels:
        raise RequestError(
            f"{name} is {width}x{height} = {width * height} pixels; the limit is {limits.max_input_pixels}", "image"
        )
    return source, (width, height)


def decode_image(source: Any, name: str = "image") -> Any:
    """The RGB PIL image of what `inspect_image` accepted (bytes are decoded here, once)."""
    from PIL import Image

    if isinstance(source, Image.Image):
        return source.convert("RGB")
    try:
        with Image.open(io.BytesIO(source), formats=IMAGE_FORMATS) as image:
            return image.convert("RGB")
    except (OSError, SyntaxError, ValueError) as exc:
        # A header that read well over data that does not (a cut JPEG, say).
        raise RequestError(f"{name} cannot be decoded: {exc}", "image") from None
