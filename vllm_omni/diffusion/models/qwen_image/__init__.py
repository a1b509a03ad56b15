"""Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-Plus (one transformer)."""

from vllm_omni.diffusion.models.qwen_image.transformer import QwenImageTransformer2DModel

__all__ = ["QwenImageTransformer2DModel"]
