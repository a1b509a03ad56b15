"""The one health vocabulary: `HealthState`, what the executor, the engine, the scheduler and /metrics say.

Declared in executor/protocol.py, the lowest layer that needs it (the executor's status), since
imports point downward; the engine, the scheduler and the HTTP server take it from here.
"""

from vllm_omni.diffusion.executor.protocol import HEALTH_STATES, HealthState

__all__ = ["HEALTH_STATES", "HealthState"]
