"""Wan2.2 (T2V-A14B and I2V-A14B with two experts, TI2V-5B): SP transformer, pipeline adapter, tiny models.

spec.py (torch-free: the registry imports it without the model code), pipeline.py, transformer.py, tiny.py.
"""
