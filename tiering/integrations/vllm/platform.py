"""Which kind of device vLLM's platform keeps the KV cache on (one question, asked in one place).

Separate so tests can answer it differently: the selection of the copy worker
depends on it, and these machines have no GPU.
"""

from __future__ import annotations


def has_gpu() -> bool:
    """Whether vLLM's current platform is CUDA-alike (CUDA, ROCm) or XPU."""
    from vllm.platforms import current_platform

    return bool(current_platform.is_cuda_alike() or current_platform.is_xpu())
