"""Qwen-Image 2.1 (block-causal single-stream transformer, Qwen3-VL text encoder).

spec.py (torch-free: the registry imports it without the model code), pipeline.py, transformer.py, tiny.py.
"""
