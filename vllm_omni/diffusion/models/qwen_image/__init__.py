"""Qwen-Image, Qwen-Image-Edit and Qwen-Image-Edit-Plus (one transformer).

spec.py (torch-free: the registry imports it without the model code), pipeline.py, transformer.py, tiny.py.
"""
