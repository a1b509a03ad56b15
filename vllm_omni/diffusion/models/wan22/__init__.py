"""Wan2.2 (T2V-A14B and I2V-A14B with two experts, TI2V-5B): SP transformer, pipeline adapter, tiny models."""

from .transformer import WanTransformer3DModel

__all__ = ["WanTransformer3DModel"]
