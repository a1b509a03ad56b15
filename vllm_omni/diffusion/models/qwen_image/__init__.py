"""Qwen-Image and Qwen-Image-Edit: the SP transformer, the pipeline adapter and the tiny models."""
