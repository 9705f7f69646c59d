"""AsyncTierManager: the seed's sync contract over an AsyncTier on its own loop thread."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

from tests.runtime_support import (
    BLOCK,
    LooseJob,
    SlowTier,
    assert_every_call_refused_after_shutdown,
    fill,
    key,
    load,
    one_result,
    primary,
    results,
    store,
    wait_until,
)
from tiering.core.errors import ConfigError, ContractError
from tiering.core.keys import NO_CONTEXT, OffloadKey
from tiering.runtime import AsyncTierManager, Presence, TierStats
from tiering.testing.faults import FaultPlan, FaultyTier
from tiers.memory import MemoryTier


@pytest.fixture
def buf() -> np.ndarray:
    return primary()


@pytest.fixture
def manager(buf: np.ndarray):
    with AsyncTierManager(MemoryTier(), buf.data, "memory", job_timeout_s=5.0) as m:
        yield m


def test_store_then_load_round_trips_bytes(manager: AsyncTierManager, buf: np.ndarray) -> None:
    data = [fill(buf, row) for row in range(4)]
    keys = [key(i) for i in range(4)]
    manager.submit_store(store(1, keys, [0, 1, 2, 3]))
    stored = one_result(manager)
    assert stored.success and stored.error is None
    assert stored.successful_keys == frozenset(keys)
    assert stored.transfer_bytes == 4 * BLOCK
    assert stored.transfer_time >= 0
    assert all(manager.lookup(k, NO_CONTEXT) is True for k in keys)
    assert manager.get_num_blocks() == 4
    manager.submit_load(load(2, keys[::-1], [10, 11, 12, 13]))
    loaded = one_result(manager)
    assert loaded.success and loaded.successful_keys == frozenset(keys)
    assert loaded.transfer_bytes == 4 * BLOCK
    for i, row in enumerate([13, 12, 11, 10]):
        assert bytes(buf[row]) == data[i]


def test_store_skips_keys_already_present(manager: AsyncTierManager, buf: np.ndarray) -> None:
    first = fill(buf, 0)
    manager.submit_store(store(1, [key(1)], [0]))
    assert one_result(manager).success
    fill(buf, 0)  # other bytes in the row: the block already stored must not be rewritten
    fill(buf, 1)
    manager.submit_store(store(2, [key(1), key(2)], [0, 1]))
    again = one_result(manager)
    assert again.success and again.successful_keys == frozenset({key(1), key(2)})
    assert again.transfer_bytes == BLOCK  # only the new key moved
    manager.submit_load(load(3, [key(1)], [5]))
    assert one_result(manager).success
    assert bytes(buf[5]) == first


def test_lookup_answers_absent_present_and_in_flight(buf: np.ndarray) -> None:
    tier = SlowTier(delay_s=0.2)
    with AsyncTierManager(tier, buf.data, "slow") as manager:
        assert manager.lookup(key(1), NO_CONTEXT) is False
        fill(buf, 0)
        manager.submit_store(store(1, [key(1)], [0]))
        assert manager.lookup(key(1), NO_CONTEXT) is None  # in flight from submit on
        results(manager)
        assert manager.lookup(key(1), NO_CONTEXT) is True


class _WriteFailsContainsGated(SlowTier):
    """Every write fails; contains() waits for ``gate`` (so the check of a failed write shows)."""

    def __init__(self) -> None:
        super().__init__()
        self.gate = threading.Event()

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        raise OSError("disk on fire")

    async def contains(self, key: OffloadKey) -> bool:
        await asyncio.to_thread(self.gate.wait, 30)
        return await super().contains(key)


def test_lookup_state_tells_storing_from_checking(buf: np.ndarray) -> None:
    with AsyncTierManager(SlowTier(delay_s=0.2), buf.data, "slow") as manager:
        assert manager.lookup_state(key(1)) is Presence.ABSENT
        fill(buf, 0)
        manager.submit_store(store(1, [key(1)], [0]))
        assert manager.lookup_state(key(1)) is Presence.STORING
        results(manager)
        assert manager.lookup_state(key(1)) is Presence.PRESENT
    tier = _WriteFailsContainsGated()
    with AsyncTierManager(tier, buf.data, "failing") as manager:
        manager.submit_store(store(2, [key(2)], [0]))
        assert not one_result(manager).success
        # The failed write is being checked with contains(): CHECKING, then ABSENT.
        assert manager.lookup_state(key(2)) is Presence.CHECKING
        assert manager.lookup(key(2), NO_CONTEXT) is None
        tier.gate.set()
        wait_until(lambda: manager.lookup_state(key(2)) is Presence.ABSENT)


def test_get_finished_is_empty_without_jobs_and_returns_each_result_once(
    manager: AsyncTierManager, buf: np.ndarray
) -> None:
    assert list(manager.get_finished()) == []
    fill(buf, 0)
    manager.submit_store(store(7, [key(1)], [0]))
    wait_until(lambda: manager.stats().jobs_succeeded == 1)
    assert [r.job_id for r in manager.get_finished()] == [7]
    assert list(manager.get_finished()) == []
    assert not manager.has_pending_work()


def test_has_finished_says_whether_get_finished_has_a_result(
    manager: AsyncTierManager, buf: np.ndarray
) -> None:
    assert not manager.has_finished()  # nothing submitted
    fill(buf, 0)
    manager.submit_store(store(8, [key(1)], [0]))
    wait_until(manager.has_finished)  # published: the next get_finished returns it
    assert manager.has_finished()  # asking takes nothing
    assert [r.job_id for r in manager.get_finished()] == [8]
    assert not manager.has_finished()
    manager.shutdown()
    assert manager.has_finished()  # so a caller's get_finished reports the shutdown


def test_load_of_a_missing_key_fails_the_job_and_loads_the_rest(
    manager: AsyncTierManager, buf: np.ndarray
) -> None:
    data = fill(buf, 0)
    manager.submit_store(store(1, [key(1)], [0]))
    assert one_result(manager).success
    buf[5] = 0
    manager.submit_load(load(2, [key(1), key(2)], [5, 6]))
    failed = one_result(manager)
    assert not failed.success
    assert failed.error and "BlockNotFound" in failed.error and key(2).hex() in failed.error
    # The key that is there still loads: a partial result, as vLLM 0.33 takes it.
    assert failed.successful_keys == frozenset({key(1)}) and bytes(buf[5]) == data
    assert manager.stats().missing_reads == 1
    # Nothing there at all: failed without touching the tier.
    manager.submit_load(load(3, [key(2), key(3)], [6, 7]))
    none_there = one_result(manager)
    assert not none_there.success and "2 of 2 blocks are not in tier" in (none_there.error or "")
    assert none_there.successful_keys == frozenset()


def test_any_failed_read_fails_the_load_and_names_successful_keys(buf: np.ndarray) -> None:
    tier = FaultyTier(MemoryTier())
    with AsyncTierManager(tier, buf.data, "faulty") as manager:
        for row in range(3):
            fill(buf, row)
        manager.submit_store(store(1, [key(0), key(1), key(2)], [0, 1, 2]))
        assert one_result(manager).success
        tier.plan = FaultPlan(error_rate=1.0, keys={key(1)}, ops={"read"})
        manager.submit_load(load(2, [key(0), key(1), key(2)], [10, 11, 12]))
        failed = one_result(manager)
        assert not failed.success
        assert failed.successful_keys == frozenset({key(0), key(2)})
        assert failed.error and "OSError" in failed.error and key(1).hex() in failed.error
        assert failed.transfer_bytes == 2 * BLOCK
        # An I/O error is not proof the block is gone: it stays a hit.
        assert manager.lookup(key(1), NO_CONTEXT) is True


def test_partial_store_failure_reports_successful_keys_and_settles_lookup(
    buf: np.ndarray,
) -> None:
    tier = FaultyTier(MemoryTier(), FaultPlan(error_rate=1.0, keys={key(2)}, ops={"write"}))
    with AsyncTierManager(tier, buf.data, "faulty") as manager:
        for row in range(3):
            fill(buf, row)
        manager.submit_store(store(1, [key(1), key(2), key(3)], [0, 1, 2]))
        result = one_result(manager)
        assert not result.success
        assert result.successful_keys == frozenset({key(1), key(3)})
        assert result.transfer_bytes == 2 * BLOCK
        assert manager.lookup(key(1), NO_CONTEXT) is True
        # The failed key is checked with contains(), then answers False.
        wait_until(lambda: manager.lookup(key(2), NO_CONTEXT) is False)
        assert manager.stats().jobs_failed == 1


def test_corrupt_read_is_a_miss_and_forgets_the_block(buf: np.ndarray) -> None:
    tier = FaultyTier(MemoryTier())
    with AsyncTierManager(tier, buf.data, "faulty") as manager:
        fill(buf, 0)
        manager.submit_store(store(1, [key(1)], [0]))
        assert one_result(manager).success
        manager.take_events()
        tier.plan = FaultPlan(corrupt_rate=1.0, detect=True)
        manager.submit_load(load(2, [key(1)], [3]))
        failed = one_result(manager)
        assert not failed.success and "CorruptBlock" in (failed.error or "")
        assert manager.lookup(key(1), NO_CONTEXT) is False
        assert manager.stats().corrupt_reads == 1
        assert list(manager.take_events()) == [([key(1)], True)]


@pytest.mark.parametrize("fault", ["corrupt_rate", "short_read_rate"])
def test_silently_damaged_reads_are_caught_by_the_checksum(buf: np.ndarray, fault: str) -> None:
    tier = FaultyTier(MemoryTier())
    with AsyncTierManager(tier, buf.data, "faulty") as manager:
        fill(buf, 0)
        fill(buf, 1)
        manager.submit_store(store(1, [key(1), key(2)], [0, 1]))
        assert one_result(manager).success
        manager.take_events()
        tier.plan = FaultPlan(**{fault: 1.0}, keys={key(2)}, detect=False)
        manager.submit_load(load(2, [key(1), key(2)], [5, 6]))
        failed = one_result(manager)
        assert not failed.success and "checksum mismatch" in (failed.error or "")
        assert failed.successful_keys == frozenset({key(1)})
        assert manager.lookup(key(2), NO_CONTEXT) is False  # a miss, never a wrong hit
        assert manager.stats().corrupt_reads == 1
        assert list(manager.take_events()) == [([key(2)], True)]


def test_verification_can_be_left_to_a_tier_that_checks_its_own_reads(buf: np.ndarray) -> None:
    class SelfChecking(MemoryTier):
        verifies_reads = True

    for tier, verify in ((SelfChecking(), None), (MemoryTier(), False)):
        faulty = FaultyTier(tier)
        faulty.verifies_reads = tier.verifies_reads
        with AsyncTierManager(faulty, buf.data, "trusting", verify=verify) as manager:
            fill(buf, 0)
            manager.submit_store(store(1, [key(1)], [0]))
            assert one_result(manager).success
            faulty.plan = FaultPlan(corrupt_rate=1.0, detect=False)
            manager.submit_load(load(2, [key(1)], [5]))
            assert one_result(manager).success  # not verified: the damage goes through
            assert bytes(buf[5]) != bytes(buf[0])


def test_load_of_a_key_whose_store_is_in_flight_waits_for_the_store(buf: np.ndarray) -> None:
    tier = SlowTier(delay_s=0.05)
    with AsyncTierManager(tier, buf.data, "slow") as manager:
        data = fill(buf, 0)
        manager.submit_store(store(1, [key(1)], [0]))
        manager.submit_load(load(2, [key(1)], [9]))
        got = results(manager)
        assert got[1].success and got[2].success
        assert bytes(buf[9]) == data
        assert tier.same_key_overlaps == 0


def test_a_load_waits_for_a_store_that_is_itself_waiting_for_another_key(
    buf: np.ndarray,
) -> None:
    """Store [A, B] waits for a slow store of A, so it has not claimed B yet: a load of B
    submitted after it must still wait for it, not fail as missing."""
    tier = SlowTier(delay_s=0.1)
    with AsyncTierManager(tier, buf.data, "slow") as manager:
        fill(buf, 0)
        data_b = fill(buf, 1)
        manager.submit_store(store(1, [key(1)], [0]))
        manager.submit_store(store(2, [key(1), key(2)], [0, 1]))
        manager.submit_load(load(3, [key(2)], [9]))
        got = results(manager)
        assert all(got[j].success for j in (1, 2, 3)), {j: r.error for j, r in got.items()}
        assert bytes(buf[9]) == data_b


def test_concurrency_is_bounded_by_max_concurrency_and_keys_never_overlap(
    buf: np.ndarray,
) -> None:
    tier = SlowTier(delay_s=0.003)  # max_concurrency = 4
    with AsyncTierManager(tier, buf.data, "slow") as manager:
        for row in range(16):
            fill(buf, row)
        for job_id, start in enumerate(range(0, 15, 3), 1):
            manager.submit_store(
                store(job_id, [key(i) for i in range(start, start + 3)], range(start, start + 3))
            )
        manager.submit_store(store(99, [key(i) for i in range(16)], range(16)))  # overlaps all
        manager.submit_load(load(100, [key(0), key(1)], [20, 21]))
        got = results(manager)
        assert all(r.success for r in got.values()), got
        assert 1 < tier.peak <= 4
        assert tier.same_key_overlaps == 0


def test_big_jobs_are_split_into_batches_of_max_concurrency(buf: np.ndarray) -> None:
    tier = SlowTier(delay_s=0.0)
    with AsyncTierManager(tier, buf.data, "slow") as manager:
        keys = [key(i) for i in range(10)]
        manager.submit_store(store(1, keys, range(10)))
        assert one_result(manager).success
        assert tier.peak <= 4 and tier.calls["write"] == 10


def test_touch_reaches_the_tier_eviction_policy(buf: np.ndarray) -> None:
    with AsyncTierManager(MemoryTier(capacity_blocks=2), buf.data, "memory") as manager:
        fill(buf, 0)
        fill(buf, 1)
        fill(buf, 2)
        manager.submit_store(store(1, [key(1), key(2)], [0, 1]))
        assert one_result(manager).success
        # Mailbox order: the touch reaches the tier before the next store evicts.
        manager.touch([key(1)], NO_CONTEXT)  # key 2 becomes the least recently used
        manager.submit_store(store(2, [key(3)], [2]))
        assert one_result(manager).success
        assert manager.lookup(key(1), NO_CONTEXT) is True
        assert manager.lookup(key(2), NO_CONTEXT) is False
        assert manager.get_num_blocks() == 2


def test_events_report_stores_and_evictions(buf: np.ndarray) -> None:
    with AsyncTierManager(MemoryTier(capacity_blocks=2), buf.data, "memory") as manager:
        for row in range(3):
            fill(buf, row)
        manager.submit_store(store(1, [key(1), key(2)], [0, 1]))
        results(manager)
        manager.submit_store(store(2, [key(3)], [2]))
        results(manager)
        events = list(manager.take_events())
        assert events == [([key(1), key(2)], False), ([key(1)], True), ([key(3)], False)]
        assert list(manager.take_events()) == []
        assert manager.lookup(key(1), NO_CONTEXT) is False
        stats = manager.stats()
        assert stats.blocks_removed == 1 and stats.capacity_blocks == 2 and stats.blocks_held == 2


def test_stats_snapshot_counts_jobs_blocks_and_bytes(
    manager: AsyncTierManager, buf: np.ndarray
) -> None:
    for row in range(2):
        fill(buf, row)
    manager.submit_store(store(1, [key(1), key(2)], [0, 1]))
    results(manager)
    manager.submit_load(load(2, [key(1)], [4]))
    manager.submit_load(load(3, [key(9)], [5]))
    results(manager)
    stats = manager.stats()
    assert isinstance(stats, TierStats)
    assert (stats.jobs_submitted, stats.jobs_succeeded, stats.jobs_failed) == (3, 2, 1)
    assert (stats.store_jobs_submitted, stats.load_jobs_submitted) == (1, 2)
    assert stats.jobs_in_flight == 0
    assert (stats.blocks_stored, stats.blocks_loaded) == (2, 1)
    assert (stats.bytes_stored, stats.bytes_loaded) == (2 * BLOCK, BLOCK)
    assert stats.blocks_held == 2 and stats.capacity_blocks is None
    assert stats.store_seconds >= 0 and stats.load_seconds >= 0
    with pytest.raises(AttributeError):
        stats.jobs_failed = 0  # type: ignore[misc]


# -- bad input ------------------------------------------------------------------------------


def _nothing_enqueued(manager: AsyncTierManager, before: TierStats) -> None:
    after = manager.stats()
    assert after.jobs_submitted == before.jobs_submitted
    assert not manager.has_pending_work()


def test_keys_and_block_ids_of_different_lengths_are_rejected(manager: AsyncTierManager) -> None:
    before = manager.stats()
    with pytest.raises(ContractError, match="2 keys but 1 block_ids"):
        manager.submit_store(LooseJob(1, (key(1), key(2)), [0]))  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="1 keys but 2 block_ids"):
        manager.submit_load(LooseJob(1, (key(1),), [0, 1], True))  # type: ignore[arg-type]
    _nothing_enqueued(manager, before)


def test_block_id_outside_the_primary_view_is_rejected(manager: AsyncTierManager) -> None:
    before = manager.stats()
    with pytest.raises(ContractError, match="block id 32, outside the primary view's 32 rows"):
        manager.submit_store(store(1, [key(1), key(2)], [0, 32]))
    with pytest.raises(ContractError, match="block id -1"):
        manager.submit_load(LooseJob(2, (key(1),), [-1], True))  # type: ignore[arg-type]
    _nothing_enqueued(manager, before)
    assert manager.lookup(key(1), NO_CONTEXT) is False  # not even marked in flight


def test_a_job_id_in_flight_or_undelivered_is_rejected(buf: np.ndarray) -> None:
    with AsyncTierManager(SlowTier(delay_s=0.1), buf.data, "slow") as manager:
        fill(buf, 0)
        manager.submit_store(store(1, [key(1)], [0]))
        with pytest.raises(ContractError, match="job 1 was already submitted"):
            manager.submit_load(load(1, [key(1)], [1]))
        manager.drain(10)  # finished but not yet delivered: still rejected
        with pytest.raises(ContractError, match="job 1 was already submitted"):
            manager.submit_store(store(1, [key(2)], [1]))
        assert [r.job_id for r in manager.get_finished()] == [1]
        manager.submit_load(load(1, [key(1)], [1]))  # delivered: the id may be reused
        assert one_result(manager).success


def test_a_key_listed_twice_is_rejected(manager: AsyncTierManager) -> None:
    with pytest.raises(ContractError, match="lists a key twice"):
        manager.submit_store(store(1, [key(1), key(1)], [0, 1]))
    assert not manager.has_pending_work()


def test_constructor_rejects_bad_views_and_options() -> None:
    with pytest.raises(ConfigError, match="writable"):
        AsyncTierManager(MemoryTier(), memoryview(bytes(8192)), "m", block_bytes=4096)
    with pytest.raises(ConfigError, match="2-D"):
        AsyncTierManager(MemoryTier(), memoryview(bytearray(8192)), "m")
    with pytest.raises(ConfigError, match="does not divide"):
        AsyncTierManager(MemoryTier(), memoryview(bytearray(8192)), "m", block_bytes=3000)
    with pytest.raises(ConfigError, match="job_timeout_s"):
        AsyncTierManager(MemoryTier(), primary().data, "m", job_timeout_s=0)
    # Deadlines are loop times: infinity never returns, 1e10 s overflows the selector.
    for endless in (float("inf"), 1e10):
        with pytest.raises(ConfigError, match="shutdown_timeout_s must be a positive number"):
            AsyncTierManager(MemoryTier(), primary().data, "m", shutdown_timeout_s=endless)
    with pytest.raises(ConfigError, match="verify must be true, false or null, got 'false'"):
        AsyncTierManager(MemoryTier(), primary().data, "m", verify="false")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="AsyncTier"):
        AsyncTierManager(object(), primary().data, "m")  # type: ignore[arg-type]


def test_a_flat_view_with_block_bytes_works() -> None:
    raw = bytearray(4 * BLOCK)
    with AsyncTierManager(MemoryTier(), memoryview(raw), "m", block_bytes=BLOCK) as manager:
        raw[BLOCK : 2 * BLOCK] = b"\x07" * BLOCK
        manager.submit_store(store(1, [key(1)], [1]))
        assert one_result(manager).success
        manager.submit_load(load(2, [key(1)], [3]))
        assert one_result(manager).success
        assert raw[3 * BLOCK :] == b"\x07" * BLOCK


# -- drain ----------------------------------------------------------------------------------


def test_drain_blocks_until_every_job_has_a_result(buf: np.ndarray) -> None:
    with AsyncTierManager(SlowTier(delay_s=0.02), buf.data, "slow") as manager:
        for i in range(6):
            fill(buf, i)
            manager.submit_store(store(i, [key(i)], [i]))
        manager.drain(10)
        assert manager.stats().jobs_in_flight == 0
        assert sorted(r.job_id for r in manager.get_finished()) == list(range(6))
        manager.drain(0)  # nothing outstanding: returns at once


def test_drain_timeout_names_the_running_jobs(buf: np.ndarray) -> None:
    tier = FaultyTier(MemoryTier(), FaultPlan(hang_rate=1.0, ops={"write"}))
    with AsyncTierManager(
        tier, buf.data, "hang", job_timeout_s=30, shutdown_timeout_s=0.5
    ) as manager:
        manager.submit_store(store(1, [key(1)], [0]))
        with pytest.raises(TimeoutError, match="1 job"):
            manager.drain(0.05)


def test_calls_after_shutdown_raise_and_shutdown_is_idempotent(buf: np.ndarray) -> None:
    manager = AsyncTierManager(MemoryTier(), buf.data, "memory")
    manager.shutdown()
    manager.shutdown()
    assert_every_call_refused_after_shutdown(manager)
