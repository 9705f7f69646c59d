"""The conformance kit catches each planted bug of issue 19, by name and key, whatever the seed.

Every broken tier below plants one bug the kit used to miss (or catch by
luck). Each test runs the kit under several fixed seeds and asserts the check
that owns the bug fails with a message naming the check, the key and the seed;
the same correct tiers pass. Detection never depends on the seed: the bugs are
caught with a miss chance below 1e-7 per run (see ``KitOptions.distinct_keys``).
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import Iterable

import pytest

from tiering.core.errors import BlockNotFound
from tiering.core.keys import OffloadKey
from tiering.testing.conformance import (
    CHECKS,
    SEED_ENV,
    CheckOutcome,
    ConformanceReport,
    KitOptions,
    check_tier,
    run_check,
)
from tiering.tier import AsyncTier
from tiers.memory import MemoryTier

SEEDS = [1, 2, 20261124]
BLOCK = 4096  # small blocks keep 4,096-key checks quick; the bugs do not depend on size


def _key_byte(key: bytes) -> int:
    """A byte of the key's hash: how the broken tiers pick 'some' keys deterministically."""
    return hashlib.sha256(key).digest()[0]


# -- broken tiers -----------------------------------------------------------------------------


class HangingLoad(MemoryTier):
    """Broken: a read never completes."""

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        await asyncio.Event().wait()


class CorruptOneKeyIn256(MemoryTier):
    """Broken: one key in 256 (by its hash) is stored with one byte flipped."""

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        if _key_byte(key) == 0:
            damaged = bytearray(data)
            damaged[len(damaged) // 2] ^= 0x01
            data = memoryview(damaged)
        await super().write(key, data)


class CorruptEvery256thWrite(MemoryTier):
    """Broken: every 256th write stores one flipped byte."""

    writes = 0

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        self.writes += 1
        if self.writes % 256 == 0:
            damaged = bytearray(data)
            damaged[-1] ^= 0x80
            data = memoryview(damaged)
        await super().write(key, data)


class CorruptHalfTheKeys(MemoryTier):
    """Broken: half the keys (by their hash) are stored with their first byte flipped."""

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        if _key_byte(key) % 2:
            damaged = bytearray(data)
            damaged[0] ^= 0xFF
            data = memoryview(damaged)
        await super().write(key, data)


class SlotTable(AsyncTier):
    """Broken: a 4,096-slot table indexed by a hash of the key that stores no key."""

    max_concurrency = 64

    def __init__(self) -> None:
        self.slots: dict[int, bytes] = {}

    @staticmethod
    def slot(key: OffloadKey) -> int:
        return int.from_bytes(hashlib.sha256(key).digest()[:4]) % 4096

    async def contains(self, key: OffloadKey) -> bool:
        return self.slot(key) in self.slots

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        block = self.slots.get(self.slot(key))
        if block is None:
            raise BlockNotFound(key)
        into[:] = block

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        self.slots[self.slot(key)] = bytes(data)

    async def delete(self, key: OffloadKey) -> None:
        self.slots.pop(self.slot(key), None)


class NeverReportsRemoved(MemoryTier):
    """Broken: a bounded tier that evicts without calling report_removed."""

    def report_removed(self, keys: object) -> None:
        pass


class BlocksTheLoop(MemoryTier):
    """Broken: every write holds the event loop for 50 ms."""

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        time.sleep(0.05)  # noqa: ASYNC251 - the planted bug
        await super().write(key, data)


class SlowButAsync(MemoryTier):
    """Correct: every write waits 50 ms without holding the loop."""

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        await asyncio.sleep(0.05)
        await super().write(key, data)


class LateThreadCopy(MemoryTier):
    """Broken: a read copies into its buffer from a thread 50 ms later, even once cancelled."""

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        block = bytearray(BLOCK)
        await super().read(key, memoryview(block))

        def late_copy() -> None:
            time.sleep(0.05)
            into[:] = block

        await asyncio.to_thread(late_copy)


class BoundedDict(AsyncTier):
    """Correct: a bounded LRU with no ``capacity_blocks`` attribute (declared to the kit)."""

    def __init__(self, capacity: int) -> None:
        self._capacity = capacity
        self.blocks: OrderedDict[OffloadKey, bytes] = OrderedDict()

    async def contains(self, key: OffloadKey) -> bool:
        return key in self.blocks

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        if key not in self.blocks:
            raise BlockNotFound(key)
        self.blocks.move_to_end(key)
        into[:] = self.blocks[key]

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        self.blocks[key] = bytes(data)
        self.blocks.move_to_end(key)
        evicted = []
        while len(self.blocks) > self._capacity:
            evicted.append(self.blocks.popitem(last=False)[0])
        self.report_removed(evicted)

    async def delete(self, key: OffloadKey) -> None:
        self.blocks.pop(key, None)

    async def list_keys(self) -> Iterable[OffloadKey]:
        return list(self.blocks)


# -- helpers ------------------------------------------------------------------------------------


def _assert_caught(outcome: CheckOutcome, seed: int, *phrases: str) -> None:
    """The check failed, and its reason names the check, the seed, and says what is wrong."""
    assert not outcome.passed and not outcome.skipped, f"{outcome.name} missed the bug"
    reason = outcome.reason
    assert f"conformance check {outcome.name!r} failed (seed {seed}" in reason, reason
    for phrase in phrases:
        assert phrase in reason, f"{phrase!r} not in: {reason}"


async def _run(name: str, factory: object, seed: int, **options: object) -> CheckOutcome:
    return await run_check(name, factory, seed=seed, block_bytes=BLOCK, **options)  # type: ignore[arg-type]


# -- the planted bugs ---------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_load_that_never_completes_fails_at_the_call_deadline_naming_it(seed: int) -> None:
    report = await check_tier(
        HangingLoad,
        only=["round_trip", "overwrite", "cancelled_read"],
        seed=seed,
        block_bytes=BLOCK,
        op_timeout_s=0.2,
        raise_on_failure=False,
    )
    assert [o.passed for o in report.outcomes] == [False, False, False]
    for outcome in report.outcomes:
        _assert_caught(outcome, seed, "read(key ", "did not finish within 0.2 s (op_timeout_s)")


async def test_a_check_over_its_time_limit_fails_listing_the_calls_still_running() -> None:
    outcome = await _run("round_trip", HangingLoad, 7, op_timeout_s=60.0, check_timeout_s=0.3)
    _assert_caught(outcome, 7, "did not finish within 0.3 s (check_timeout_s)", "read(key ")


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("tier", [CorruptOneKeyIn256, CorruptEvery256thWrite])
async def test_rare_corruption_is_caught_naming_the_key(tier: type[AsyncTier], seed: int) -> None:
    outcome = await _run("many_distinct_keys", tier, seed)
    _assert_caught(outcome, seed, "key ", "returned other bytes than written: 1 of 4096 bytes")


@pytest.mark.parametrize("seed", SEEDS)
async def test_keys_colliding_in_a_4096_slot_table_are_caught(seed: int) -> None:
    outcome = await _run("many_distinct_keys", SlotTable, seed)
    _assert_caught(outcome, seed, "key ")
    assert "two keys collide" in outcome.reason or "share slots" in outcome.reason, outcome.reason


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_bounded_tier_that_never_reports_evictions_is_caught(seed: int) -> None:
    outcome = await _run("eviction_reported", lambda: NeverReportsRemoved(capacity_blocks=64), seed)
    _assert_caught(outcome, seed, "key ", "never reported with report_removed()")


@pytest.mark.parametrize("seed", SEEDS)
async def test_50ms_blocking_writes_are_caught_by_the_loop_sampler(seed: int) -> None:
    outcome = await _run("loop_not_blocked", BlocksTheLoop, seed)
    _assert_caught(outcome, seed, "write() stalled the event loop past 25 ms (max_loop_lag_s)")


async def test_slow_but_asynchronous_writes_do_not_count_as_loop_stalls() -> None:
    outcome = await _run("loop_not_blocked", SlowButAsync, 3)
    assert outcome.passed and not outcome.skipped, outcome.detail


@pytest.mark.parametrize("seed", SEEDS)
async def test_a_thread_writing_a_read_buffer_50ms_after_cancellation_is_caught(seed: int) -> None:
    outcome = await _run("cancelled_read", LateThreadCopy, seed)
    _assert_caught(outcome, seed, "key ", "a cancelled read wrote into its buffer after it ended")


# Checks that verify at least 32 keys' bytes: a tier corrupting half its keys fails all of them
# whatever the seed (the others verify fewer keys and may pass for some seeds).
_MANY_KEY_CHECKS = ["round_trip", "overwrite", "concurrent_distinct_keys", "many_distinct_keys"]


@pytest.mark.parametrize("seed", SEEDS)
async def test_half_the_keys_corrupt_fails_the_same_checks_with_key_naming_messages(
    seed: int,
) -> None:
    report = await check_tier(
        CorruptHalfTheKeys,
        only=_MANY_KEY_CHECKS,
        seed=seed,
        block_bytes=BLOCK,
        raise_on_failure=False,
    )
    assert report.seed == seed
    assert [o.name for o in report.failures] == _MANY_KEY_CHECKS, str(report)
    for outcome in report.failures:
        _assert_caught(outcome, seed, "key ", "returned other bytes than written", "first at")
    assert f"seed={seed}" in str(report)


async def test_the_same_seed_reproduces_the_same_keys_and_verdicts() -> None:
    def run() -> object:
        return check_tier(
            CorruptHalfTheKeys,
            only=["round_trip", "cancelled_write", "buffers_released_after_write"],
            seed=99,
            block_bytes=BLOCK,
            raise_on_failure=False,
        )

    first: ConformanceReport = await run()  # type: ignore[misc]
    second: ConformanceReport = await run()  # type: ignore[misc]
    assert [(o.passed, o.reason) for o in first.outcomes] == [
        (o.passed, o.reason) for o in second.outcomes
    ]


async def test_the_seed_comes_from_the_environment_when_not_given(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(SEED_ENV, "4242")
    report = await check_tier(CorruptHalfTheKeys, only=["round_trip"], raise_on_failure=False)
    assert report.seed == 4242 and report.outcomes[0].seed == 4242
    with pytest.raises(AssertionError, match=f"{SEED_ENV}=4242"):
        report.raise_for_failures()


# -- correct tiers pass -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "factory",
    [
        lambda: MemoryTier(capacity_blocks=16),
        lambda: MemoryTier(capacity_blocks=300, eviction_policy="arc"),
        MemoryTier,
    ],
    ids=["lru-16-blocks", "arc-300-blocks", "unbounded"],
)
async def test_correct_memory_tiers_pass_every_check(factory: object) -> None:
    report = await check_tier(factory, block_bytes=BLOCK, raise_on_failure=False)  # type: ignore[arg-type]
    assert report.ok, str(report)
    skipped = {o.name for o in report.outcomes if o.skipped}
    bounded = getattr(factory(), "capacity_blocks", None) is not None  # type: ignore[operator]
    not_persistent = {"persistence", "layouts_kept_apart"}
    assert skipped == (not_persistent if bounded else {*not_persistent, "eviction_reported"})


async def test_a_bounded_tier_can_be_declared_to_the_kit() -> None:
    report = await check_tier(
        lambda: BoundedDict(32), capacity_blocks=32, block_bytes=BLOCK, raise_on_failure=False
    )
    assert report.ok, str(report)
    assert not next(o for o in report.outcomes if o.name == "eviction_reported").skipped


def test_options_are_checked_where_given() -> None:
    with pytest.raises(ValueError, match=r"KitOptions\.capacity_blocks"):
        KitOptions(capacity_blocks=0)
    with pytest.raises(ValueError, match=r"KitOptions\.op_timeout_s"):
        KitOptions(op_timeout_s=-1)
    with pytest.raises(KeyError, match="no conformance check 'nope'"):
        asyncio.run(run_check("nope", MemoryTier))
    assert "eviction_reported" in CHECKS and "many_distinct_keys" in CHECKS
