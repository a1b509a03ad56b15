"""vllm_omni: a diffusion serving engine with Ulysses sequence parallelism.

`from vllm_omni import Omni` gives the offline engine, `EngineArgs` its options. Heavy modules (torch,
diffusers) load only when a name is first used, so the CLI starts fast.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["Omni", "EngineArgs", "DiffusionParallelConfig", "__version__"]

if TYPE_CHECKING:
    from vllm_omni.diffusion.config import DiffusionParallelConfig
    from vllm_omni.diffusion.engine.args import EngineArgs
    from vllm_omni.entrypoints.omni import Omni


def __getattr__(name: str):
    if name == "Omni":
        from vllm_omni.entrypoints.omni import Omni

        return Omni
    if name == "EngineArgs":
        from vllm_omni.diffusion.engine.args import EngineArgs

        return EngineArgs
    if name == "DiffusionParallelConfig":
        from vllm_omni.diffusion.config import DiffusionParallelConfig

        return DiffusionParallelConfig
    raise AttributeError(f"module 'vllm_omni' has no attribute {name!r}")
