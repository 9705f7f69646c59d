"""Fault-injecting tiers a vLLM config can name (``"tier": "tests.vllm.faulty:..."``).

They wrap our real tiers in :class:`tiering.testing.faults.FaultyTier` with no
faults; a test reaches the instance through the vLLM tier
(``manager.secondary_tiers[i].runtime.tier``) and sets its ``plan``.
"""

from __future__ import annotations

from typing import Any

from tiering.testing.faults import FaultPlan, FaultyTier
from tiers.fs import FileSystemTier
from tiers.memory import MemoryTier


class FaultyMemoryTier(FaultyTier):
    """Our in-memory tier behind a fault injector (``MemoryTier`` options)."""

    def __init__(self, *, seed: int = 0, **memory_options: Any) -> None:
        super().__init__(MemoryTier(**memory_options), seed=seed)


class FaultyFileSystemTier(FaultyTier):
    """Our filesystem tier behind a fault injector (``FileSystemTier`` options)."""

    def __init__(self, *, seed: int = 0, **fs_options: Any) -> None:
        super().__init__(FileSystemTier(**fs_options), seed=seed)


class SlowMemoryTier(FaultyTier):
    """Our in-memory tier writing one block at a time, each ``write_delay_s`` late: a tier
    that cannot keep up with an engine's stores (``MemoryTier`` options otherwise)."""

    def __init__(self, *, write_delay_s: float = 0.05, **memory_options: Any) -> None:
        plan = FaultPlan(delay_rate=1.0, delay_s=write_delay_s, ops={"write"})
        super().__init__(MemoryTier(**memory_options), plan)
        self.max_concurrency = 1
