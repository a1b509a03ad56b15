"""HunyuanVideo 1.5 (text-to-video, image-to-video): the SP transformer, the pipeline adapter and the tiny models."""

from .transformer import HunyuanVideo15Transformer3DModel

__all__ = ["HunyuanVideo15Transformer3DModel"]
