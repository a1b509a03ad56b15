"""HunyuanVideo 1.5 (text-to-video, image-to-video): the SP transformer, the pipeline adapter and the tiny models.

spec.py (torch-free: the registry imports it without the model code), pipeline.py, transformer.py, tiny.py.
"""
