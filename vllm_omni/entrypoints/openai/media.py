"""Media encoders for what the engine returns: MP4 (H.264) for videos.

Encoding uses PyAV (FFmpeg's libraries, shipped in its wheels), a maintained encoder; nothing
here writes container or codec bytes by hand. Used by the videos API and `vllm-omni generate`.
"""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np


def encode_mp4(frames: np.ndarray, fps: int, crf: int = 18) -> bytes:
    """uint8 frames [F, H, W, 3] -> an MP4 file (H.264, yuv420p, plays everywhere).

    yuv420p needs even sides: an odd width or height is padded by one edge pixel.
    """
    import av

    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"expected uint8 frames [F, H, W, 3], got {frames.dtype} {tuple(frames.shape)}")
    pad_h, pad_w = frames.shape[1] % 2, frames.shape[2] % 2
    if pad_h or pad_w:
        frames = np.pad(frames, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    buffer = io.BytesIO()
    with av.open(buffer, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=Fraction(fps))
        stream.width, stream.height = frames.shape[2], frames.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf)}
        for frame in frames:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode())  # flush the encoder
    return buffer.getvalue()
