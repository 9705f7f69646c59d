"""The fault-injecting wrapper tier, and the conformance kit catching broken tiers."""

from __future__ import annotations

import asyncio
import errno
import time
from collections.abc import Iterable

import pytest

from tests.runtime_support import key
from tiering.core.errors import BlockNotFound, CorruptBlock
from tiering.core.keys import OffloadKey
from tiering.testing.conformance import check_tier, run_check
from tiering.testing.faults import FaultPlan, FaultyTier
from tiering.tier import AsyncTier, TierContext
from tiers.memory import MemoryTier

BLOCK = 256


async def faulty(plan: FaultPlan, seed: int = 0, **memory: object) -> FaultyTier:
    tier = FaultyTier(MemoryTier(**memory), plan, seed=seed)  # type: ignore[arg-type]
    await tier.open(TierContext(block_bytes=BLOCK))
    return tier


def data(i: int) -> memoryview:
    return memoryview(bytes([i]) * BLOCK)


async def test_errors_hit_only_the_planned_operations_and_keys() -> None:
    tier = await faulty(FaultPlan(error_rate=1.0, ops={"read"}, keys={key(1)}))
    await tier.write(key(1), data(1))
    await tier.write(key(2), data(2))
    into = memoryview(bytearray(BLOCK))
    with pytest.raises(OSError) as raised:
        await tier.read(key(1), into)
    assert raised.value.errno == errno.EIO and key(1).hex() in str(raised.value)
    await tier.read(key(2), into)
    assert await tier.contains(key(1))
    assert tier.injected == {"error:read": 1}


async def test_the_same_seed_replays_the_same_faults() -> None:
    async def failures(seed: int) -> list[int]:
        tier = await faulty(FaultPlan(error_rate=0.5, ops={"write"}), seed=seed)
        failed = []
        for i in range(40):
            try:
                await tier.write(key(i), data(i))
            except OSError:
                failed.append(i)
        return failed

    first = await failures(7)
    assert first == await failures(7)
    assert 0 < len(first) < 40
    assert first != await failures(8)


async def test_delays_are_injected_and_cancellable() -> None:
    tier = await faulty(FaultPlan(delay_rate=1.0, delay_s=(5.0, 6.0), ops={"write"}))
    task = asyncio.ensure_future(tier.write(key(1), data(1)))
    await asyncio.sleep(0.01)
    assert not task.done() and tier.injected["delay:write"] == 1
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert not await tier.contains(key(1))


async def test_hangs_end_only_by_cancellation_and_stubborn_hangs_outlive_it() -> None:
    tier = await faulty(FaultPlan(hang_rate=1.0, ops={"read"}))
    await tier.write(key(1), data(1))
    task = asyncio.ensure_future(tier.read(key(1), memoryview(bytearray(BLOCK))))
    await asyncio.sleep(0.02)
    assert not task.done()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task

    # Shielded for 1 s: the check below comes a few ms after the cancel, with a wide margin
    # for a loaded machine (0.2 s once left too little).
    tier.plan = FaultPlan(hang_rate=1.0, hang_ignores_cancel_s=1.0, ops={"read"})
    task = asyncio.ensure_future(tier.read(key(1), memoryview(bytearray(BLOCK))))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # still "working" after being cancelled
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_silent_short_reads_and_corruption_damage_the_bytes() -> None:
    tier = await faulty(FaultPlan(short_read_rate=1.0))
    await tier.write(key(1), data(7))
    into = bytearray(b"\xff" * BLOCK)  # the row's previous bytes
    await tier.read(key(1), memoryview(into))
    assert into != bytes(data(7))
    # A prefix of the block, then the row as it was (stale bytes, as after a real short read).
    kept = len(into.rstrip(b"\xff"))
    assert into[:kept] == bytes(data(7))[:kept] and into[kept:] == b"\xff" * (BLOCK - kept)

    tier.plan = FaultPlan(corrupt_rate=1.0)
    into = bytearray(BLOCK)
    await tier.read(key(1), memoryview(into))
    assert sum(a != b for a, b in zip(into, bytes(data(7)), strict=True)) == 1
    assert tier.injected == {"short_read:read": 1, "corrupt:read": 1}


async def test_detected_corruption_raises_corrupt_block() -> None:
    tier = await faulty(FaultPlan(corrupt_rate=1.0, detect=True))
    await tier.write(key(1), data(1))
    with pytest.raises(CorruptBlock, match="corrupt"):
        await tier.read(key(1), memoryview(bytearray(BLOCK)))
    tier.plan = FaultPlan(short_read_rate=1.0, detect=True)
    with pytest.raises(CorruptBlock, match="short read"):
        await tier.read(key(1), memoryview(bytearray(BLOCK)))


async def test_removals_of_the_inner_tier_are_reported_through_the_wrapper() -> None:
    removed: list[OffloadKey] = []
    tier = FaultyTier(MemoryTier(capacity_blocks=1))
    tier._bind_removed_sink(removed.extend)
    await tier.open(TierContext(block_bytes=BLOCK))
    await tier.write(key(1), data(1))
    await tier.write(key(2), data(2))
    assert removed == [key(1)]
    assert tier.capacity_blocks == 1


def test_plans_are_validated() -> None:
    with pytest.raises(ValueError, match="error_rate"):
        FaultPlan(error_rate=1.5)
    with pytest.raises(ValueError, match="unknown operations"):
        FaultPlan(ops={"scribble"})
    with pytest.raises(ValueError, match="delay_s"):
        FaultPlan(delay_s=(2.0, 1.0))


# -- the kit catches broken tiers -----------------------------------------------------------


class TornWrites(AsyncTier):
    """Broken: a block is visible half-written while its write is still running."""

    def __init__(self) -> None:
        self.blocks: dict[OffloadKey, bytes] = {}

    async def contains(self, key: OffloadKey) -> bool:
        return key in self.blocks

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        if key not in self.blocks:
            raise BlockNotFound(key)
        into[:] = self.blocks[key]

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        half = len(data) // 2
        self.blocks[key] = bytes(data[:half]) + bytes(len(data) - half)
        await asyncio.sleep(0)
        self.blocks[key] = bytes(data)


class ZerosForMissing(MemoryTier):
    """Broken: reading an absent key fills zeros instead of raising BlockNotFound."""

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        try:
            await super().read(key, into)
        except BlockNotFound:
            into[:] = bytes(len(into))


class ThreadedWithoutWaiting(AsyncTier):
    """Broken: hands buffers to threads and lets a cancellation (or return) outrun them."""

    def __init__(self) -> None:
        self.blocks: dict[OffloadKey, bytes] = {}

    async def contains(self, key: OffloadKey) -> bool:
        return key in self.blocks

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        block = self.blocks.get(key)
        if block is None:
            raise BlockNotFound(key)

        def late_copy() -> None:
            time.sleep(0.005)
            into[:] = block

        await asyncio.to_thread(late_copy)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        self.blocks[key] = bytes(data)

        def late_look() -> None:  # e.g. a copy finished in the background
            time.sleep(0.005)
            self.blocks[key] = bytes(data)

        asyncio.get_running_loop().run_in_executor(None, late_look)


class NoList(MemoryTier):
    async def list_keys(self) -> Iterable[OffloadKey]:
        return ["not bytes"]  # type: ignore[list-item]


async def test_the_kit_catches_torn_writes() -> None:
    outcome = await run_check("cancelled_write", TornWrites)
    assert not outcome.passed and "partial" in outcome.detail


async def test_the_kit_catches_a_missing_key_served_as_zeros() -> None:
    outcome = await run_check("missing_key", ZerosForMissing)
    assert not outcome.passed and "BlockNotFound" in outcome.detail


async def test_the_kit_catches_buffers_used_after_their_operation_ended() -> None:
    outcome = await run_check("cancelled_read", ThreadedWithoutWaiting)
    assert not outcome.passed and "wrote into its buffer after it ended" in outcome.detail
    outcome = await run_check("buffers_released_after_write", ThreadedWithoutWaiting)
    assert not outcome.passed and "read a write's buffer after the write ended" in outcome.detail


async def test_the_kit_catches_a_tier_blocking_the_loop() -> None:
    stalling = lambda: FaultyTier(  # noqa: E731
        MemoryTier(), FaultPlan(stall_rate=1.0, stall_s=0.3, ops={"write"})
    )
    outcome = await run_check("loop_not_blocked", stalling, max_loop_lag_s=0.1, concurrency=2)
    assert not outcome.passed and "stalled" in outcome.detail


async def test_check_tier_reports_each_check_and_raises_listing_failures() -> None:
    report = await check_tier(NoList, only=["touch_and_list", "round_trip"], raise_on_failure=False)
    assert [o.passed for o in report.outcomes] == [False, True]
    with pytest.raises(AssertionError, match="touch_and_list"):
        report.raise_for_failures()
