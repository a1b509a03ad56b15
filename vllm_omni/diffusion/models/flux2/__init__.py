"""FLUX.2: the SP transformer, the pipeline adapter and the tiny model."""

from .transformer import Flux2Transformer2DModel

__all__ = ["Flux2Transformer2DModel"]
