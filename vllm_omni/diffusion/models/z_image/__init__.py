"""Z-Image (and its 8-step Turbo): the SP transformer, the pipeline adapter and the tiny model."""

from .transformer import ZImageTransformer2DModel

__all__ = ["ZImageTransformer2DModel"]
