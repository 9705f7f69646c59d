"""Fault-injecting tiers a vLLM config can name (``"tier": "tests.vllm.faulty:..."``).

They wrap our real tiers in :class:`tiering.testing.faults.FaultyTier` with no
faults; a test reaches the instance through the vLLM tier
(``manager.secondary_tiers[i].runtime.tier``) and sets its ``plan``.
"""

from __future__ import annotations

from typing import Any

from tiering.testing.faults import FaultyTier
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
