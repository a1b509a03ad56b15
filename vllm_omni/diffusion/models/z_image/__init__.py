"""Z-Image (and its 8-step Turbo): the SP transformer, the pipeline adapter and the tiny model.

spec.py (torch-free: the registry imports it without the model code), pipeline.py, transformer.py, tiny.py.
"""
