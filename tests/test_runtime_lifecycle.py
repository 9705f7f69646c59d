"""Deadlines, cancellation, opening and shutdown of AsyncTierManager (no leaks)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import threading
from collections.abc import Iterable, Sequence

import numpy as np
import pytest

from tests.runtime_support import (
    BLOCK,
    SlowTier,
    fill,
    key,
    load,
    one_result,
    primary,
    results,
    store,
    wait_until,
)
from tiering.core.errors import BlockNotFound, ContractError, TierClosedError
from tiering.core.jobs import JobResult
from tiering.core.keys import NO_CONTEXT, OffloadKey
from tiering.runtime import AsyncTierManager
from tiering.runtime import service as service_module
from tiering.testing.faults import FaultPlan, FaultyTier
from tiering.tier import AsyncTier, TierContext
from tiers.memory import MemoryTier


def test_an_expired_job_fails_cleanly_and_the_tier_keeps_working() -> None:
    buf = primary()
    hung = key(1)
    tier = FaultyTier(MemoryTier(), FaultPlan(hang_rate=1.0, keys={hung}, ops={"write"}))
    with AsyncTierManager(tier, buf.data, "hang", job_timeout_s=0.2) as manager:
        fill(buf, 0)
        data = fill(buf, 1)
        manager.submit_store(store(1, [hung], [0]))
        manager.submit_store(store(2, [key(2)], [1]))
        got = results(manager)
        assert not got[1].success
        assert "missed its deadline of 0.2 s" in (got[1].error or "")
        assert got[1].successful_keys == frozenset()
        assert got[2].success
        assert manager.stats().timeouts == 1
        # The interrupted write is checked (contains: not faulted), then answers False.
        wait_until(lambda: manager.lookup(hung, NO_CONTEXT) is False)
        manager.submit_load(load(3, [key(2)], [5]))
        assert one_result(manager).success and bytes(buf[5]) == data


def test_a_load_deadline_covers_waiting_for_a_slow_store_of_the_same_key() -> None:
    buf = primary()
    # The store holds its key until released, past both deadlines: with a store that
    # gave up at its own deadline (a few microseconds before the load's), the load
    # would find the key free and fail as "not in tier" instead, by a race.
    tier = GatedTier(shield_writes=True)
    with AsyncTierManager(
        tier, buf.data, "slow", job_timeout_s=0.25, cancel_grace_s=10, shutdown_timeout_s=5
    ) as manager:
        fill(buf, 0)
        manager.submit_store(store(1, [key(1)], [0]))
        manager.submit_load(load(2, [key(1)], [3]))
        got: dict[int, JobResult] = {}

        def load_reported() -> bool:
            got.update((r.job_id, r) for r in manager.get_finished())
            return 2 in got

        try:
            wait_until(load_reported)  # while the store still holds the key
        finally:
            tier.release.set()
        got.update(results(manager))
        assert not got[1].success and not got[2].success
        assert "deadline" in (got[2].error or "")


class GatedTier(AsyncTier):
    """Blocks that are always present; reads and writes wait for ``release`` (test-driven).

    ``shield_writes``: a write ignores cancellation until released (breaks the
    contract). ``threaded_reads``: a read writes ``into`` from a thread that
    outlives the read's cancellation (a naive ``asyncio.to_thread`` tier).
    """

    def __init__(self, *, shield_writes: bool = False, threaded_reads: bool = False) -> None:
        self.shield_writes = shield_writes
        self.threaded_reads = threaded_reads
        self.release = threading.Event()
        self.started = threading.Event()
        self.pipe = os.pipe()  # threaded reads read their bytes from it

    async def contains(self, key: OffloadKey) -> bool:
        return True

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        self.started.set()
        if self.threaded_reads:  # the thread holds ``into`` until bytes arrive
            await asyncio.to_thread(os.readv, self.pipe[0], [into])

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        self.started.set()
        if self.shield_writes:
            waiting = asyncio.ensure_future(asyncio.to_thread(self.release.wait, 20))
            try:
                await asyncio.shield(waiting)
            except asyncio.CancelledError:
                await waiting
                raise

    async def aclose(self) -> None:
        for fd in self.pipe:
            with contextlib.suppress(OSError):
                os.close(fd)


def test_a_tier_ignoring_cancellation_holds_its_job_until_it_lets_go() -> None:
    buf = primary()
    tier = GatedTier(shield_writes=True)
    with AsyncTierManager(
        tier, buf.data, "stubborn", job_timeout_s=0.1, cancel_grace_s=0.1, shutdown_timeout_s=1
    ) as manager:
        manager.submit_store(store(1, [key(1)], [0]))
        wait_until(lambda: manager.stats().abandoned_jobs == 1)
        # Counted and logged at the grace, but not reported: the write may still read
        # row 0, which a reported job would hand back to the scheduler for reuse.
        try:
            assert not manager.get_finished() and manager.stats().jobs_in_flight == 1
        finally:
            tier.release.set()
        result = one_result(manager)
        assert not result.success and "ignored cancellation" in (result.error or "")
        assert manager.stats().timeouts == 1


def test_a_load_ends_only_when_no_thread_holds_its_rows(caplog: pytest.LogCaptureFixture) -> None:
    buf = primary()
    tier = GatedTier(threaded_reads=True)
    with AsyncTierManager(tier, buf.data, "threads", job_timeout_s=0.1) as manager:
        manager.submit_store(store(1, [key(1)], [0]))
        assert one_result(manager).success
        manager.submit_load(load(2, [key(1)], [3]))
        try:
            wait_until(lambda: "still in use after the tier's call ended" in caplog.text)
            # The read was cancelled at its deadline, but its thread still holds row 3.
            assert not manager.get_finished()
        finally:
            os.write(tier.pipe[1], b"\x07" * BLOCK)
        result = one_result(manager)
        assert not result.success and "missed its deadline" in (result.error or "")
        # The late write landed while the row was still the job's, before the result.
        assert bytes(buf[3]) == b"\x07" * BLOCK


def test_shutdown_cancels_hung_jobs() -> None:
    buf = primary()
    tier = FaultyTier(MemoryTier(), FaultPlan(hang_rate=1.0, ops={"write"}))
    manager = AsyncTierManager(tier, buf.data, "hang", job_timeout_s=600, shutdown_timeout_s=0.5)
    manager.submit_store(store(1, [key(1)], [0]))
    wait_until(lambda: tier.injected["hang:write"] == 1)
    manager.shutdown()  # returns although the job would hang for ten minutes
    assert not manager._thread.thread.is_alive()


class FileTier(AsyncTier):
    """A tiny file-backed tier using ``asyncio.to_thread`` (so executor threads exist)."""

    max_concurrency = 4

    def __init__(self, path: str) -> None:
        self.path = path
        self.fd = -1
        self.slots: dict[OffloadKey, int] = {}
        self.next_slot = 0
        self.background: asyncio.Task[None] | None = None

    async def open(self, context: TierContext) -> None:
        await super().open(context)
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        self.background = asyncio.get_running_loop().create_task(asyncio.sleep(3600))

    async def contains(self, key: OffloadKey) -> bool:
        return key in self.slots

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        slot = self.slots.get(key)
        if slot is None:
            raise BlockNotFound(key)
        await asyncio.to_thread(os.preadv, self.fd, [into], slot * self.block_bytes)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        slot = self.slots.get(key)
        if slot is None:
            slot, self.next_slot = self.next_slot, self.next_slot + 1
        await asyncio.to_thread(os.pwritev, self.fd, [data], slot * self.block_bytes)
        self.slots[key] = slot  # readable only once written

    async def list_keys(self) -> Iterable[OffloadKey]:
        return ()

    async def aclose(self) -> None:
        if self.background is not None:
            self.background.cancel()
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def test_shutdown_leaves_no_thread_task_or_file_handle(tmp_path: object) -> None:
    threads_before = set(threading.enumerate())
    fds_before = _open_fds()
    buf = primary()
    tier = FaultyTier(FileTier(os.path.join(str(tmp_path), "blocks")))
    manager = AsyncTierManager(tier, buf.data, "file", job_timeout_s=30, shutdown_timeout_s=1)
    data = [fill(buf, row) for row in range(4)]
    manager.submit_store(store(1, [key(i) for i in range(4)], range(4)))
    assert one_result(manager).success
    manager.submit_load(load(2, [key(i) for i in range(4)], range(10, 14)))
    assert one_result(manager).success
    assert [bytes(buf[10 + i]) for i in range(4)] == data
    # Work in flight at shutdown: one hung job.
    tier.plan = FaultPlan(hang_rate=1.0, ops={"write"})
    fill(buf, 5)
    manager.submit_store(store(3, [key(9)], [5]))
    wait_until(lambda: tier.injected["hang:write"] == 1)
    loop = manager._thread.loop
    tasks = manager._thread.call(_all_tasks)
    assert len(threading.enumerate()) > len(threads_before)  # loop + executor threads
    manager.shutdown()
    assert set(threading.enumerate()) == threads_before
    assert _open_fds() - fds_before == set()
    assert loop.is_closed()
    assert all(task.done() for task in tasks)
    assert tier.inner.fd == -1  # type: ignore[attr-defined]


async def _all_tasks() -> set[asyncio.Task[object]]:
    return asyncio.all_tasks()


def test_shutdown_discards_uncollected_results_and_closes_the_tier() -> None:
    closed: list[bool] = []

    class Closing(MemoryTier):
        async def aclose(self) -> None:
            closed.append(True)
            await super().aclose()

    buf = primary()
    manager = AsyncTierManager(Closing(), buf.data, "closing")
    manager.submit_store(store(1, [key(1)], [0]))
    manager.shutdown()
    assert closed == [True]
    with pytest.raises(TierClosedError):
        manager.get_finished()


class FailingOpen(MemoryTier):
    def __init__(self, error: BaseException | None = None, hang: bool = False) -> None:
        super().__init__()
        self.error = error
        self.hang = hang
        self.closed = 0

    async def open(self, context: TierContext) -> None:
        await super().open(context)
        if self.hang:
            await asyncio.Event().wait()
        if self.error is not None:
            raise self.error

    async def aclose(self) -> None:
        self.closed += 1


def test_a_failing_open_raises_its_own_exception_and_leaves_nothing_behind() -> None:
    threads_before = set(threading.enumerate())
    tier = FailingOpen(PermissionError(13, "no access to /nowhere"))
    with pytest.raises(PermissionError, match="no access"):
        AsyncTierManager(tier, primary().data, "broken")
    assert tier.closed == 1
    assert set(threading.enumerate()) == threads_before


def test_a_hung_open_times_out() -> None:
    threads_before = set(threading.enumerate())
    tier = FailingOpen(hang=True)
    with pytest.raises(TimeoutError, match=r"0\.2 s"):
        AsyncTierManager(tier, primary().data, "hung", open_timeout_s=0.2, shutdown_timeout_s=1)
    assert tier.closed == 1
    assert set(threading.enumerate()) == threads_before


class SlowOpen(MemoryTier):
    async def open(self, context: TierContext) -> None:
        await super().open(context)
        await asyncio.sleep(0.2)


def test_an_open_past_half_its_deadline_is_one_warning(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A tier's open grows with its blocks: one that took most of ``open_timeout_s`` says so
    while it still fits. (The share is lowered here so that a generous deadline keeps the
    test from racing it.)"""
    with AsyncTierManager(SlowOpen(), primary().data, "fast-enough"):
        pass
    assert not [r for r in caplog.records if "to open" in r.getMessage()]
    monkeypatch.setattr(service_module, "SLOW_OPEN_SHARE", 0.01)
    with AsyncTierManager(SlowOpen(), primary().data, "growing", open_timeout_s=10.0):
        pass
    (warning,) = [r for r in caplog.records if "to open" in r.getMessage()]
    assert warning.levelname == "WARNING"
    message = r"tier growing took \d+\.\d s to open, \d+% of open_timeout_s \(10 s\)"
    assert re.search(message, warning.getMessage())
    assert "raise open_timeout_s" in warning.getMessage()


class Recovered(MemoryTier):
    """A tier that finds blocks in its medium at open (like a persistent tier)."""

    async def list_keys(self) -> Sequence[OffloadKey]:  # type: ignore[override]
        return [key(100), key(101)]

    async def open(self, context: TierContext) -> None:
        await super().open(context)
        for k in (key(100), key(101)):
            await self.write(k, memoryview(bytes([k[7]]) * context.block_bytes))


def test_presence_is_seeded_from_list_keys() -> None:
    buf = primary()
    with AsyncTierManager(Recovered(), buf.data, "recovered") as manager:
        assert manager.lookup(key(100), NO_CONTEXT) is True
        assert manager.get_num_blocks() == 2
        manager.submit_load(load(1, [key(101)], [0]))
        assert one_result(manager).success
        assert bytes(buf[0]) == bytes([101]) * BLOCK


def test_report_removed_from_a_wrong_thread_is_moved_to_the_loop() -> None:
    buf = primary()
    tier = MemoryTier()
    with AsyncTierManager(tier, buf.data, "memory") as manager:
        fill(buf, 0)
        manager.submit_store(store(1, [key(1)], [0]))
        assert one_result(manager).success
        tier.report_removed([key(1)])  # from the test thread: a tier bug, handled
        wait_until(lambda: manager.lookup(key(1), NO_CONTEXT) is False)
        assert ([key(1)], True) in list(manager.take_events())


def test_view_rows_are_released_so_the_primary_buffer_can_be_freed() -> None:
    backing = bytearray(4 * BLOCK)
    view = memoryview(backing).cast("B", (4, BLOCK))
    with AsyncTierManager(MemoryTier(), view, "memory") as manager:
        manager.submit_store(store(1, [key(1)], [0]))
        assert one_result(manager).success
        manager.submit_load(load(2, [key(1)], [1]))
        assert one_result(manager).success
    view.release()
    backing.extend(b"x")  # raises BufferError if any view of it were still alive
    assert np.frombuffer(bytes(backing[:BLOCK]), dtype=np.uint8).sum() == 0


def test_results_of_the_jobs_shutdown_cancelled_are_kept_for_the_owner() -> None:
    rows = primary(8)
    fill(rows, 0)
    manager = AsyncTierManager(SlowTier(delay_s=5), rows.data, "slow", shutdown_timeout_s=1)
    with pytest.raises(ContractError, match="before shutdown"):
        manager.results_after_shutdown()
    manager.submit_store(store(1, [key(1)], [0]))
    manager.shutdown()  # cancels the store still running
    (result,) = manager.results_after_shutdown()
    assert result.job_id == 1 and not result.success and "shut down" in (result.error or "")
    assert manager.results_after_shutdown() == []  # each result once
