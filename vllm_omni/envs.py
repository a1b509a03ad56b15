"""Every `VLLM_OMNI_*` environment variable, declared once (as vLLM's envs.py declares its own): its name here,
what it does beside it. Modules read a variable through these names; no other module spells one in code
(tests/test_layout.py), and docs/serving.md lists those a user sets (tests/test_docs_lists.py).
"""

from __future__ import annotations

PREFIX = "VLLM_OMNI_"  # every variable's; the Ray executor forwards all of them to its actors

# What a user sets (docs/serving.md, "Environment variables").
ATTENTION_BACKEND = "VLLM_OMNI_ATTENTION_BACKEND"  # the attention kernel by name when no option names one
LOAD_TIMEOUT_S = "VLLM_OMNI_LOAD_TIMEOUT_S"  # --load-timeout's default
STALL_TIMEOUT_S = "VLLM_OMNI_STALL_TIMEOUT_S"  # --stall-timeout's default
CPU_THREADS = "VLLM_OMNI_CPU_THREADS"  # torch threads per CPU worker
CACHE = "VLLM_OMNI_CACHE"  # where tiny models are built (default ~/.cache/vllm_omni)
PREFETCH_WEIGHTS = "VLLM_OMNI_PREFETCH_WEIGHTS"  # 0: no read-ahead of the weights while the workers start
RAY_LOG_TO_DRIVER = "VLLM_OMNI_RAY_LOG_TO_DRIVER"  # 1: Ray's worker output forwarded to the driver too
# vLLM's own variable, with its meaning: how worker processes start (executor/multiproc.py): spawn (the default) or
# forkserver (one server process imports torch, diffusers and the families once; each worker is forked from it).
WORKER_MULTIPROC_METHOD = "VLLM_WORKER_MULTIPROC_METHOD"

USER_VARIABLES = (
    ATTENTION_BACKEND,
    LOAD_TIMEOUT_S,
    STALL_TIMEOUT_S,
    CPU_THREADS,
    CACHE,
    PREFETCH_WEIGHTS,
    RAY_LOG_TO_DRIVER,
)

# Test doubles (vllm_omni/testing/), off unless set: what each switches on is in the module that reads it.
TEST_CUDA_GRAPHS = "VLLM_OMNI_TEST_CUDA_GRAPHS"  # simulated CUDA graphs on CPU ranks (testing/graphs.py)
TEST_FAULT = "VLLM_OMNI_TEST_FAULT"  # an injected fault in a worker (testing/faults.py)
TEST_MEMORY_TRACE = "VLLM_OMNI_TEST_MEMORY_TRACE"  # what a rank holds between requests (testing/memory_trace.py)
TEST_GPU_MEMORY = "VLLM_OMNI_TEST_GPU_MEMORY"  # a simulated device memory for the memory plan (testing/memory.py)
TEST_MEASURED_STEP = "VLLM_OMNI_TEST_MEASURED_STEP"  # the warm-up's measured step, simulated (testing/memory.py)
# "module:function" building a rank's RankHooks (diffusion/worker/hooks.py): the tests name testing/hooks.py.
TEST_HOOKS = "VLLM_OMNI_TEST_HOOKS"
