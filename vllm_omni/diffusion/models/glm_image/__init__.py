"""GLM-Image (text-to-image: an autoregressive stage, then the DiT): SP transformer, pipeline adapter, tiny model."""

from .transformer import GlmImageTransformer2DModel

__all__ = ["GlmImageTransformer2DModel"]
