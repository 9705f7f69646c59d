"""Fault-injecting wrapper tiers for tests.

:class:`FaultyTier` wraps any :class:`~tiering.tier.AsyncTier` and injects
faults into its operations with configurable probabilities and a seeded random
generator, so a failing test replays exactly::

    from tiering.testing.faults import FaultPlan, FaultyTier
    from tiers.memory import MemoryTier

    tier = FaultyTier(MemoryTier(), FaultPlan(error_rate=0.2, ops={"read"}), seed=7)
    manager = AsyncTierManager(tier, primary_view, "memory")

Fault kinds, checked in this order for each operation the plan covers:

``hang``
    The operation never completes (it still honours cancellation, so job
    deadlines and shutdown end it). With ``hang_ignores_cancel_s > 0`` the hang
    shields itself from cancellation for that long: a contract-violating tier,
    for testing the framework's last-resort handling.
``error``
    The operation raises ``plan.error(op, key)`` (default ``OSError(EIO)``)
    instead of running.
``delay``
    The operation is delayed by a random duration in ``delay_s`` (cancellable
    ``asyncio.sleep``) and then runs.
``stall``
    The event loop is *blocked* with ``time.sleep(stall_s)`` before the
    operation: a contract violation, for testing loop-lag detectors.
``short_read`` / ``corrupt`` (``read`` only)
    After the inner read, only a prefix of ``into`` keeps the block's bytes
    (the rest is left as it was) or one byte is flipped. With
    ``detect=False`` (default) the read returns normally: *silent* damage, the
    case end-to-end verification above the tier must catch. With
    ``detect=True`` it raises :class:`~tiering.core.errors.CorruptBlock`, like a
    checksumming tier would.

Batch forms (``read_many``...) are the :class:`AsyncTier` defaults, which call
the single-key operations, so faults are decided per key. Every injected fault
is counted in :attr:`FaultyTier.injected` (a ``Counter`` keyed ``"kind:op"``)
so tests can assert that faults really happened. Swap the plan at any time
with :attr:`FaultyTier.plan` (e.g. store cleanly, then fail the loads).
"""

from __future__ import annotations

import asyncio
import errno
import random
import time
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field

from tiering.core.errors import CorruptBlock
from tiering.core.keys import OffloadKey
from tiering.tier import AsyncTier, TierContext

#: Operation names a :class:`FaultPlan` can target.
OPERATIONS = frozenset({"contains", "read", "write", "delete"})


def io_error(op: str, key: OffloadKey) -> BaseException:
    """The default injected error: ``OSError(EIO)`` naming the operation and key."""
    return OSError(errno.EIO, f"injected fault: {op} of block {key.hex()}")


@dataclass(frozen=True)
class FaultPlan:
    """Which faults to inject, how often, and into which operations and keys.

    Rates are probabilities in ``[0, 1]`` drawn independently per operation.
    ``ops`` limits faults to these operation names (default: all of
    :data:`OPERATIONS`); ``keys`` limits them to these keys (default: every key).
    ``delay_s`` is a fixed delay or a ``(low, high)`` range in seconds.
    """

    error_rate: float = 0.0
    error: Callable[[str, OffloadKey], BaseException] = io_error
    delay_rate: float = 0.0
    delay_s: float | tuple[float, float] = 0.01
    hang_rate: float = 0.0
    hang_ignores_cancel_s: float = 0.0
    stall_rate: float = 0.0
    stall_s: float = 0.5
    short_read_rate: float = 0.0
    corrupt_rate: float = 0.0
    detect: bool = False
    ops: Collection[str] = field(default=OPERATIONS)
    keys: Collection[OffloadKey] | None = None

    def __post_init__(self) -> None:
        for name in (
            "error_rate",
            "delay_rate",
            "hang_rate",
            "stall_rate",
            "short_read_rate",
            "corrupt_rate",
        ):
            rate = getattr(self, name)
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"FaultPlan.{name} must be in [0, 1], got {rate!r}")
        unknown = set(self.ops) - OPERATIONS
        if unknown:
            raise ValueError(
                f"FaultPlan.ops has unknown operations {sorted(unknown)}; "
                f"accepted: {sorted(OPERATIONS)}"
            )
        low, high = self._delay_range()
        if low < 0 or high < low:
            raise ValueError(f"FaultPlan.delay_s must be >= 0 (or low <= high), got {self.delay_s}")
        object.__setattr__(self, "ops", frozenset(self.ops))
        if self.keys is not None:
            object.__setattr__(self, "keys", frozenset(self.keys))

    def _delay_range(self) -> tuple[float, float]:
        if isinstance(self.delay_s, tuple):
            return float(self.delay_s[0]), float(self.delay_s[1])
        return float(self.delay_s), float(self.delay_s)

    def covers(self, op: str, key: OffloadKey) -> bool:
        """Whether this plan may inject a fault into ``op`` of ``key``."""
        return op in self.ops and (self.keys is None or key in self.keys)


#: A plan that injects nothing.
NO_FAULTS = FaultPlan()


class FaultyTier(AsyncTier):
    """Wraps ``inner`` and injects the faults of ``plan`` (see the module docstring).

    ``max_concurrency``, ``shared`` and ``capacity_blocks`` are the inner
    tier's; blocks the inner tier reports removed are reported through this
    wrapper. ``verifies_reads`` stays False whatever the inner tier's: silent
    damage is injected after the inner tier's own checks, so the runtime must
    verify (set it on the instance to test a verifying tier's own detection).
    Batch calls run through the single-key operations (faults are decided per
    key), not the inner tier's batch forms. ``seed`` makes the fault sequence
    reproducible.
    """

    def __init__(
        self,
        inner: AsyncTier,
        plan: FaultPlan = NO_FAULTS,
        *,
        seed: int = 0,
    ) -> None:
        self.inner = inner
        self.plan = plan
        self.max_concurrency = inner.max_concurrency
        self.shared = inner.shared
        self.injected: Counter[str] = Counter()
        self._random = random.Random(seed)

    @property
    def capacity_blocks(self) -> int | None:
        """The inner tier's ``capacity_blocks`` (None when it has none)."""
        value = getattr(self.inner, "capacity_blocks", None)
        return value if isinstance(value, int) else None

    # -- fault decisions ---------------------------------------------------------------------

    def _hit(self, rate: float) -> bool:
        return rate > 0.0 and self._random.random() < rate

    async def _before(self, op: str, key: OffloadKey) -> None:
        """Inject the faults that happen before ``op`` runs (hang, error, delay, stall)."""
        plan = self.plan
        if not plan.covers(op, key):
            return
        if self._hit(plan.hang_rate):
            self.injected[f"hang:{op}"] += 1
            await self._hang(plan.hang_ignores_cancel_s)
        if self._hit(plan.error_rate):
            self.injected[f"error:{op}"] += 1
            raise plan.error(op, key)
        if self._hit(plan.delay_rate):
            self.injected[f"delay:{op}"] += 1
            low, high = plan._delay_range()
            await asyncio.sleep(self._random.uniform(low, high))
        if self._hit(plan.stall_rate):
            self.injected[f"stall:{op}"] += 1
            time.sleep(plan.stall_s)  # noqa: ASYNC251 - deliberately blocks the loop (a violation)

    @staticmethod
    async def _hang(ignore_cancel_s: float) -> None:
        if ignore_cancel_s > 0:
            # A tier that keeps working after being cancelled (e.g. a blocking
            # call in a thread): the shielded sleep outlives the cancellation.
            sleeper = asyncio.ensure_future(asyncio.sleep(ignore_cancel_s))
            try:
                await asyncio.shield(sleeper)
            except asyncio.CancelledError:
                await sleeper
                raise
        await asyncio.Event().wait()

    # -- the AsyncTier contract --------------------------------------------------------------

    async def open(self, context: TierContext) -> None:
        """Open the inner tier; its removals are reported through this wrapper.

        Cancellation: as the inner tier's ``open``.
        """
        await super().open(context)
        self.inner._bind_removed_sink(self.report_removed)
        await self.inner.open(context)

    async def contains(self, key: OffloadKey) -> bool:
        """The inner ``contains`` after any injected fault. Cancellation: as the inner tier's."""
        await self._before("contains", key)
        return await self.inner.contains(key)

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        """The inner ``read`` with injected faults, then any short read or corruption.

        Cancellation: as the inner tier's (``into`` may be partly written).
        """
        await self._before("read", key)
        plan = self.plan
        covered = plan.covers("read", key) and len(into) > 0
        # Drawn before the read (the same draws, in the same order, as after it): a short
        # read leaves the tail as it was, the row's previous bytes, not zeros.
        short = covered and self._hit(plan.short_read_rate)
        kept = self._random.randrange(len(into)) if short else 0
        stale = bytes(into[kept:]) if short else b""
        await self.inner.read(key, into)
        if not covered:
            return
        if short:
            self.injected["short_read:read"] += 1
            into[kept:] = stale
            if plan.detect:
                raise CorruptBlock(key, f"short read: {kept} of {len(into)} bytes")
        elif self._hit(plan.corrupt_rate):
            self.injected["corrupt:read"] += 1
            position = self._random.randrange(len(into))
            into[position] ^= 0xFF
            if plan.detect:
                raise CorruptBlock(key, f"checksum mismatch (byte {position} flipped)")

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """The inner ``write`` after any injected fault. Cancellation: as the inner tier's."""
        await self._before("write", key)
        await self.inner.write(key, data)

    async def delete(self, key: OffloadKey) -> None:
        """The inner ``delete`` after any injected fault. Cancellation: as the inner tier's."""
        await self._before("delete", key)
        await self.inner.delete(key)

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """The inner ``touch`` (never faulted). Cancellation: as the inner tier's."""
        await self.inner.touch(keys)

    async def list_keys(self) -> Iterable[OffloadKey]:
        """The inner ``list_keys`` (never faulted). Cancellation: as the inner tier's."""
        return await self.inner.list_keys()

    async def aclose(self) -> None:
        """Close the inner tier. Cancellation: as the inner tier's ``aclose``."""
        await self.inner.aclose()


__all__ = ["NO_FAULTS", "OPERATIONS", "FaultPlan", "FaultyTier", "io_error"]
