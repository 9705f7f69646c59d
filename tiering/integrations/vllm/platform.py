"""Which kind of device vLLM's platform keeps the KV cache on (one question, asked in one place).

Separate so tests can answer it differently: the selection of the copy worker
depends on it, and these machines have no GPU.
"""

from __future__ import annotations

from typing import Literal

DeviceKind = Literal["cuda", "rocm", "xpu", "cpu"]


def device_kind() -> DeviceKind:
    """``"cuda"`` (NVIDIA), ``"rocm"``, ``"xpu"`` or ``"cpu"`` (anything else): vLLM's platform."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_rocm():
        return "rocm"
    if current_platform.is_xpu():
        return "xpu"
    return "cpu"
