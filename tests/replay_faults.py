"""Misbehaving in-memory tiers the replay tests name by ``"tests.replay_faults:Class"``.

They are built from plain keyword arguments, so a ``secondary_tiers`` entry (or the
``--tier`` flag) can create them through the tier registry, in-process or in a
subprocess started from the repository root.
"""

from __future__ import annotations

from tiering.testing.faults import FaultPlan, FaultyTier
from tiering.tier import TierContext
from tiers.memory import MemoryTier


class CorruptingMemoryTier(FaultyTier):
    """Flips one byte of a read block with probability ``corrupt_rate`` and says nothing."""

    def __init__(self, corrupt_rate: float = 1.0, seed: int = 0) -> None:
        super().__init__(
            MemoryTier(), FaultPlan(corrupt_rate=corrupt_rate, ops={"read"}), seed=seed
        )


class SlowMemoryTier(FaultyTier):
    """Delays every ``ops`` operation (comma-separated: "read", "write") by ``delay_s`` seconds."""

    def __init__(self, delay_s: float = 0.2, ops: str = "read") -> None:
        plan = FaultPlan(delay_rate=1.0, delay_s=delay_s, ops=set(ops.split(",")))
        super().__init__(MemoryTier(), plan)


class OpenFailsTier(MemoryTier):
    """A custom tier whose ``open`` raises, as one that needs an unreachable service would."""

    async def open(self, context: TierContext) -> None:
        raise RuntimeError("the license server said no")


class FailingReadsMemoryTier(FaultyTier):
    """Every read fails with EIO: each promotion from it is a failed tier job."""

    def __init__(self) -> None:
        super().__init__(MemoryTier(), FaultPlan(error_rate=1.0, ops={"read"}))
