"""LTX-2 (text-to-video and image-to-video, with sound): the SP transformer, the pipeline adapter and the tiny models.

spec.py (torch-free: the registry imports it without the model code), pipeline.py, transformer.py, tiny.py.
"""
