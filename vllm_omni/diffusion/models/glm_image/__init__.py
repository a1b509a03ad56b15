"""GLM-Image (text-to-image: an autoregressive stage, then the DiT): SP transformer, pipeline adapter, tiny model.

spec.py (torch-free: the registry imports it without the model code), pipeline.py, transformer.py, tiny.py.
"""
