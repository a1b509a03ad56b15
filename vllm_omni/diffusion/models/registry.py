"""Which diffusers pipelines we serve: the family packages under models/, each declaring its `Family` in its
`spec.py` (torch-free: its specs, tiny models and adapters, refused pipelines), looked up here by class.

The engine reads `_class_name` from a model folder's model_index.json and looks its spec up here
(models/spec.py: the modality, task, size and token rules, defaults and accepted request fields)
without importing torch. Generic code reaches a family's code only through these entries:
`vllm_omni.diffusion.models.<family>.pipeline.FAMILY` (the contract of models/family.py) for the
runner, and `...<family>.tiny` (tiny_model_path) for the model source. Adding a family is one
package and one line in FAMILY_PACKAGES.
"""

from __future__ import annotations

import importlib

from vllm_omni.diffusion.models.spec import Family, PipelineSpec

FAMILY_PACKAGES = ("qwen_image", "qwen_image21", "flux2", "hunyuan_video_15", "wan22", "glm_image", "z_image", "ltx2")
FAMILIES: tuple[Family, ...] = tuple(
    importlib.import_module(f"vllm_omni.diffusion.models.{package}.spec").FAMILY for package in FAMILY_PACKAGES
)

SPECS: tuple[PipelineSpec, ...] = tuple(spec for family in FAMILIES for spec in family.specs)
# Each served class's first spec: what a checkpoint of that class gets unless its model_index selects another.
REGISTRY: dict[str, PipelineSpec] = {}
for _spec in SPECS:
    REGISTRY.setdefault(_spec.diffusers_class, _spec)
TINY_MODELS: dict[str, PipelineSpec] = {
    name: REGISTRY[pipeline] for family in FAMILIES for name, pipeline in family.tiny_models.items()
}


# An untiled VAE decode's measured peak per output pixel, by VAE class (Family.decode_bytes_per_pixel).
UNTILED_DECODE_BYTES_PER_PIXEL: dict[str, int] = {
    vae: per_pixel for family in FAMILIES for vae, per_pixel in family.decode_bytes_per_pixel.items()
}
# Pipelines of a served family that are refused at start, and why (the engine's error names them).
REFUSED: dict[str, str] = {name: why for family in FAMILIES for name, why in family.refused.items()}


def spec_for(diffusers_class: str, model_index: dict | None = None) -> PipelineSpec:
    """The spec of a checkpoint of `diffusers_class` whose model_index.json holds `model_index`."""
    if diffusers_class in REFUSED:
        raise ValueError(f"pipeline {diffusers_class!r} is not served: it {REFUSED[diffusers_class]}")
    if diffusers_class not in REGISTRY:
        raise ValueError(f"pipeline {diffusers_class!r} is not supported; supported pipelines: {', '.join(REGISTRY)}")
    for spec in SPECS:
        if spec.diffusers_class == diffusers_class and spec.model_index:
            if all((model_index or {}).get(key) == value for key, value in spec.model_index):
                return spec
    return REGISTRY[diffusers_class]
