"""Qwen-Image 2.1 (block-causal single-stream transformer, Qwen3-VL text encoder)."""

from vllm_omni.diffusion.models.qwen_image21.transformer import QwenImage21Transformer2DModel

__all__ = ["QwenImage21Transformer2DModel"]
