"""The diffusion engine: configs, engine, executor and workers, models, attention, distributed."""
