"""IsolatedTierManager with real child processes: the in-process facade's contract, one hop away.

Each test starts the tier in a spawned child over a named shared-memory
primary buffer (about 0.2 s). What the child publishes reaches the scheduler
side when it next calls the facade; the tests rely only on the ordering the
facade promises (a result never arrives before the presence change and the
events it implies) and otherwise poll with a bound (``wait_until``).
"""

from __future__ import annotations

import asyncio
import functools
import os
import pickle
import signal
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from tests.runtime_support import (
    LooseJob,
    assert_every_call_refused_after_shutdown,
    assert_store_load_lookup,
    fill,
    key,
    load,
    one_result,
    results,
    store,
    wait_until,
)
from tiering.core.errors import ConfigError, ContractError
from tiering.core.keys import NO_CONTEXT, OffloadKey
from tiering.isolation import IsolatedTierManager
from tiering.primary.host_buffer import HostBuffer, make_shared_name
from tiering.runtime import Presence
from tiering.tier import AsyncTier, TierContext
from tiers.fs import FileSystemTier
from tiers.memory import MemoryTier

BLOCK = 16384
ROWS = 16
WAIT_S = 10.0  # a hang guard, never a performance assertion


# -- tiers the child builds (module level: the factory is pickled into the child) ------------


class FailingOpenTier(MemoryTier):
    """A tier whose open fails; it writes its process id to ``pid_file`` first."""

    def __init__(self, pid_file: str) -> None:
        super().__init__()
        self.pid_file = pid_file

    async def open(self, context: TierContext) -> None:
        await asyncio.to_thread(Path(self.pid_file).write_text, str(os.getpid()))
        raise PermissionError(f"no access to the medium (process {os.getpid()})")


class HangingOpenTier(MemoryTier):
    """A tier whose open never finishes (until cancelled at the open deadline)."""

    async def open(self, context: TierContext) -> None:
        await asyncio.sleep(3600)


class StallingTier(MemoryTier):
    """A memory tier whose writes of ``stall_keys`` never finish (a job stays in flight)."""

    def __init__(self, stall_keys: frozenset[OffloadKey]) -> None:
        super().__init__()
        self.stall_keys = stall_keys

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        if self.stall_keys.intersection(keys):
            await asyncio.sleep(3600)
        await super().write_many(keys, data)


def not_a_tier() -> object:
    return object()


# -- fixtures ---------------------------------------------------------------------------------


@pytest.fixture
def host() -> Iterator[HostBuffer]:
    """The primary buffer, in named shared memory (the child attaches to it)."""
    buffer = HostBuffer.create(ROWS, BLOCK, shared_name=make_shared_name("isotest"))
    try:
        yield buffer
    finally:
        buffer.unlink()
        buffer.close()


@pytest.fixture
def rows(host: HostBuffer) -> np.ndarray:
    return host.as_numpy()


def memory_factory(capacity_blocks: int = 64) -> Callable[[], AsyncTier]:
    return functools.partial(MemoryTier, capacity_blocks=capacity_blocks)


def fs_factory(root: Path, capacity_blocks: int = 64) -> Callable[[], AsyncTier]:
    return functools.partial(FileSystemTier, root_dir=root, capacity_bytes=capacity_blocks * BLOCK)


@pytest.fixture(params=["memory", "fs"])
def factory(
    request: pytest.FixtureRequest, tmp_path: Path
) -> Callable[..., Callable[[], AsyncTier]]:
    """Builds the tier factory of the parametrised kind for a given capacity (in blocks)."""
    if request.param == "memory":
        return memory_factory
    return functools.partial(fs_factory, tmp_path)


def isolated(
    factory: Callable[[], AsyncTier], host: HostBuffer, **options: object
) -> IsolatedTierManager:
    options.setdefault("job_timeout_s", WAIT_S)
    options.setdefault("shutdown_timeout_s", 5.0)
    return IsolatedTierManager(
        factory,
        host,
        "iso",
        layout_fingerprint="isolation-test",
        **options,  # type: ignore[arg-type]
    )


@pytest.fixture
def manager(host: HostBuffer) -> Iterator[IsolatedTierManager]:
    m = isolated(memory_factory(), host)
    try:
        yield m
    finally:
        m.shutdown()


def process_is_gone(pid: int) -> bool:
    """Whether ``pid`` no longer exists (exited and reaped: not even a zombie)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def our_rings() -> set[str]:
    """This process's ring names in shared memory (``make_shared_name("kvring")``)."""
    return {n for n in os.listdir("/dev/shm") if n.startswith(f"kvring-{os.getpid()}-")}


# -- the contract, as in one process ----------------------------------------------------------


def test_store_then_load_is_byte_exact_into_other_rows(
    factory: Callable[..., Callable[[], AsyncTier]], host: HostBuffer, rows: np.ndarray
) -> None:
    data = {i: fill(rows, i) for i in range(8)}
    with isolated(factory(), host) as m:
        m.submit_store(store(1, [key(i) for i in range(8)], list(range(8))))
        stored = one_result(m)
        assert stored.success and stored.successful_keys == {key(i) for i in range(8)}
        assert all(m.lookup(key(i), NO_CONTEXT) is True for i in range(8))
        assert m.lookup(key(99), NO_CONTEXT) is False
        rows[8:16] = 0
        m.submit_load(load(2, [key(7 - i) for i in range(8)], list(range(8, 16))))
        loaded = one_result(m)
        assert loaded.success and loaded.transfer_bytes == 8 * BLOCK
        for i in range(8):
            assert rows[8 + i].tobytes() == data[7 - i]
        assert m.get_num_blocks() == 8


def test_blocks_a_persistent_tier_recovers_at_open_are_seen_from_this_process(
    tmp_path: Path, host: HostBuffer, rows: np.ndarray
) -> None:
    """The child learns them in bulk at open: that learning must reach the mirror too."""
    make = functools.partial(fs_factory, tmp_path)
    for i in range(4):
        fill(rows, i)
    with isolated(make(), host) as m:
        m.submit_store(store(1, [key(i) for i in range(4)], list(range(4))))
        assert one_result(m).success
    with isolated(make(), host) as m:  # reopened: its blocks recovered from disk
        assert all(m.lookup(key(i), NO_CONTEXT) is True for i in range(4))
        assert m.get_num_blocks() == 4


def test_has_finished_says_whether_a_result_came_back_from_the_tiers_process(
    factory: Callable[..., Callable[[], AsyncTier]], host: HostBuffer, rows: np.ndarray
) -> None:
    fill(rows, 0)
    with isolated(factory(), host) as m:
        assert not m.has_finished()
        m.submit_store(store(3, [key(1)], [0]))
        wait_until(m.has_finished)
        assert [r.job_id for r in m.get_finished()] == [3]
        assert not m.has_finished()


def test_stats_and_events_come_from_the_tiers_process(
    factory: Callable[..., Callable[[], AsyncTier]], host: HostBuffer, rows: np.ndarray
) -> None:
    for i in range(4):
        fill(rows, i)
    with isolated(factory(), host) as m:
        m.submit_store(store(1, [key(i) for i in range(4)], list(range(4))))
        m.submit_load(load(2, [key(99)], [5]))  # not there: fails
        outcome = results(m, WAIT_S)
        assert outcome[1].success and not outcome[2].success
        m.submit_load(load(3, [key(0), key(1)], [8, 9]))
        assert one_result(m).success
        assert list(m.take_events()) == [([key(i) for i in range(4)], False)]
        assert list(m.take_events()) == []
        stats = m.stats()
        assert stats.tier_type == "iso"
        assert stats.capacity_blocks == 64
        assert stats.blocks_held == 4
        assert (stats.jobs_submitted, stats.store_jobs_submitted, stats.load_jobs_submitted) == (
            3,
            1,
            2,
        )
        assert (stats.jobs_succeeded, stats.jobs_failed, stats.jobs_in_flight) == (2, 1, 0)
        assert (stats.blocks_stored, stats.bytes_stored) == (4, 4 * BLOCK)
        assert (stats.blocks_loaded, stats.bytes_loaded) == (2, 2 * BLOCK)
        assert stats.missing_reads == 1
        assert not stats.closed
        assert "IsolatedTierManager 'iso'" in repr(m)
    final = m.stats()
    assert final.closed and final.jobs_succeeded == 2 and final.blocks_stored == 4


def test_lookup_is_none_while_a_store_is_in_flight(host: HostBuffer, rows: np.ndarray) -> None:
    fill(rows, 0)
    stalled = frozenset({key(1)})
    with isolated(functools.partial(StallingTier, stalled), host, shutdown_timeout_s=1.0) as m:
        m.submit_store(store(1, [key(1)], [0]))
        assert m.lookup(key(1), NO_CONTEXT) is None
        assert m.lookup_state(key(1)) is Presence.STORING
        assert m.lookup_state(key(2)) is Presence.ABSENT
        assert m.has_pending_work()


def test_evictions_reach_lookup_and_events(
    factory: Callable[..., Callable[[], AsyncTier]], host: HostBuffer, rows: np.ndarray
) -> None:
    for i in range(8):
        fill(rows, i)
    with isolated(factory(4), host) as m:
        m.submit_store(store(1, [key(i) for i in range(4)], list(range(4))))
        assert one_result(m).success
        m.submit_store(store(2, [key(i) for i in range(4, 8)], list(range(4, 8))))
        assert one_result(m).success
        events = list(m.take_events())
        removed = {k for keys, gone in events if gone for k in keys}
        added = {k for keys, gone in events if not gone for k in keys}
        assert removed == {key(i) for i in range(4)}
        assert added == {key(i) for i in range(8)}
        assert [m.lookup(key(i), NO_CONTEXT) for i in range(8)] == [False] * 4 + [True] * 4
        assert m.get_num_blocks() == 4
        assert m.stats().blocks_removed == 4


def test_touch_reaches_the_tiers_eviction_policy(host: HostBuffer, rows: np.ndarray) -> None:
    for i in range(5):
        fill(rows, i)
    with isolated(memory_factory(4), host) as m:
        for i in range(4):
            m.submit_store(store(i, [key(i)], [i]))
            assert one_result(m).success
        # Ring order: the child hands the touch to the tier before the next store evicts.
        m.touch([key(0)], NO_CONTEXT)  # key(1) becomes the least recently used
        m.submit_store(store(9, [key(4)], [4]))
        assert one_result(m).success
        assert [m.lookup(key(i), NO_CONTEXT) for i in range(5)] == [True, False, True, True, True]


# -- submission errors: raised here, nothing sent ---------------------------------------------


def test_contract_errors_raise_and_send_nothing(
    manager: IsolatedTierManager, rows: np.ndarray
) -> None:
    fill(rows, 0)
    with pytest.raises(ContractError, match=f"block id {ROWS}, outside the primary view"):
        manager.submit_store(store(1, [key(1), key(2)], [0, ROWS]))
    with pytest.raises(ContractError, match="block id -1"):
        manager.submit_load(LooseJob(2, (key(1),), [-1], True))  # type: ignore[arg-type]
    with pytest.raises(ContractError, match="lists a key twice"):
        manager.submit_store(store(3, [key(1), key(1)], [0, 1]))
    assert not manager.has_pending_work()
    assert manager.lookup(key(1), NO_CONTEXT) is False  # not even marked in flight
    assert manager.stats().jobs_submitted == 0
    manager.submit_store(store(4, [key(5)], [0]))
    assert one_result(manager).success
    manager.shutdown()
    # The child's own count: it ran the one valid job and nothing else.
    final = manager.stats()
    assert (final.jobs_succeeded, final.jobs_failed, final.blocks_stored) == (1, 0, 1)


def test_a_job_id_outstanding_or_undelivered_is_rejected(
    host: HostBuffer, rows: np.ndarray
) -> None:
    fill(rows, 0)
    stalled = frozenset({key(1)})
    with isolated(functools.partial(StallingTier, stalled), host, shutdown_timeout_s=1.0) as m:
        m.submit_store(store(1, [key(1)], [0]))  # stays in flight
        with pytest.raises(ContractError, match="job 1 was already submitted"):
            m.submit_load(load(1, [key(2)], [1]))
        m.submit_store(store(2, [key(2)], [0]))
        wait_until(lambda: m.stats().jobs_succeeded == 1, WAIT_S)  # job 2's result is here
        with pytest.raises(ContractError, match="job 2 was already submitted"):
            m.submit_store(store(2, [key(3)], [1]))  # finished, not yet delivered
        assert [r.job_id for r in m.get_finished()] == [2]
        m.submit_load(load(2, [key(2)], [1]))  # delivered: the id may be reused
        assert m.stats().jobs_submitted == 3
        wait_until(lambda: [r.job_id for r in m.get_finished()] == [2], WAIT_S)
        assert m.stats().jobs_succeeded == 2
    final = m.stats()  # the child's count: job 1 failed at shutdown, the rejected ones never ran
    assert (final.jobs_succeeded, final.jobs_failed) == (2, 1)


def test_an_anonymous_or_closed_primary_buffer_is_refused() -> None:
    with (
        HostBuffer.create(ROWS, BLOCK) as anonymous,
        pytest.raises(ConfigError, match="named shared memory"),
    ):
        IsolatedTierManager(memory_factory(), anonymous, "iso")
    closed = HostBuffer.create(ROWS, BLOCK, shared_name=make_shared_name("isotest"))
    closed.unlink()
    closed.close()
    with pytest.raises(ConfigError, match="open HostBuffer"):
        IsolatedTierManager(memory_factory(), closed, "iso")


def test_a_factory_that_is_not_callable_is_refused(host: HostBuffer) -> None:
    with pytest.raises(TypeError, match="callable"):
        IsolatedTierManager(MemoryTier(), host, "iso")  # type: ignore[arg-type]


def test_bad_runtime_options_are_refused_before_a_process_starts(host: HostBuffer) -> None:
    with pytest.raises(ConfigError, match="job_timeout_s"):
        IsolatedTierManager(memory_factory(), host, "iso", job_timeout_s=0)
    with pytest.raises(ConfigError, match="max_gil_hold_ms"):
        IsolatedTierManager(memory_factory(), host, "iso", max_gil_hold_ms=0)


@pytest.mark.parametrize("max_gil_hold_ms", [None, 0.25])
def test_the_tiers_process_runs_with_gil_hand_offs_off_or_tight(
    host: HostBuffer, rows: np.ndarray, max_gil_hold_ms: float | None
) -> None:
    with isolated(memory_factory(), host, max_gil_hold_ms=max_gil_hold_ms) as manager:
        assert_store_load_lookup(manager, rows)


# -- start-up failures ------------------------------------------------------------------------


def test_a_tier_that_fails_to_open_raises_its_own_exception_and_leaves_no_process(
    host: HostBuffer, tmp_path: Path
) -> None:
    pid_file = tmp_path / "pid"
    with pytest.raises(PermissionError, match="no access to the medium"):
        isolated(functools.partial(FailingOpenTier, str(pid_file)), host)
    pid = int(pid_file.read_text())
    assert pid != os.getpid()
    assert process_is_gone(pid)


class OddError(Exception):
    """Pickles, but cannot be rebuilt from its args (two required, one given)."""

    def __init__(self, what: str, code: int) -> None:
        super().__init__(what)
        self.code = code


class OddOpenTier(MemoryTier):
    async def open(self, context: TierContext) -> None:
        raise OddError("the medium said no", 7)


def test_an_error_that_cannot_be_rebuilt_arrives_described_not_as_a_type_error(
    host: HostBuffer,
) -> None:
    with pytest.raises(RuntimeError, match="OddError: the medium said no"):
        isolated(OddOpenTier, host)


def test_a_failed_start_lets_the_primary_buffer_be_unmapped(
    host: HostBuffer, tmp_path: Path
) -> None:
    name = host.name
    assert name is not None
    with pytest.raises(PermissionError) as failure:
        isolated(functools.partial(FailingOpenTier, str(tmp_path / "pid")), host)
    host.close()  # while the exception (and so the half-built manager) is still held
    assert failure.value is not None
    with open("/proc/self/maps") as maps:
        assert name not in maps.read()


def test_a_factory_that_does_not_pickle_raises_the_pickling_error(host: HostBuffer) -> None:
    rings_before = our_rings()
    with pytest.raises((pickle.PicklingError, AttributeError), match="pickle"):
        isolated(lambda: MemoryTier(), host)
    assert our_rings() == rings_before  # the rings it made are unlinked


def test_a_factory_that_builds_no_tier_raises_type_error(host: HostBuffer) -> None:
    with pytest.raises(TypeError, match="must return an AsyncTier"):
        isolated(not_a_tier, host)  # type: ignore[arg-type]


def test_a_tier_that_does_not_open_in_time_raises_timeout(host: HostBuffer) -> None:
    with pytest.raises(TimeoutError):
        isolated(HangingOpenTier, host, open_timeout_s=0.2)


# -- the tier's process dies ------------------------------------------------------------------


def test_a_killed_tier_process_fails_its_jobs_and_forgets_its_blocks(
    host: HostBuffer, rows: np.ndarray
) -> None:
    for i in range(8):
        fill(rows, i)
    stalled = frozenset({key(i) for i in range(4, 8)})
    m = isolated(functools.partial(StallingTier, stalled), host)
    try:
        m.submit_store(store(1, [key(i) for i in range(4)], list(range(4))))
        assert one_result(m).success
        for job in range(2, 6):  # each stalls in the child
            m.submit_store(store(job, [key(job + 2)], [job + 2]))
        pid = m.pid
        assert pid is not None
        os.kill(pid, signal.SIGKILL)
        m.drain(WAIT_S)
        failed = {r.job_id: r for r in m.get_finished()}
        assert sorted(failed) == [2, 3, 4, 5]
        assert not any(r.success for r in failed.values())
        assert all("died" in (r.error or "") for r in failed.values())
        assert not m.has_pending_work()
        assert [m.lookup(key(i), NO_CONTEXT) for i in range(8)] == [False] * 8
        assert m.get_num_blocks() == 0
        m.submit_load(load(6, [key(0)], [9]))  # fails at once: nothing can serve it
        later = one_result(m, WAIT_S)
        assert later.job_id == 6 and not later.success
        stats = m.stats()  # the failures made here count as the child's would
        assert (stats.jobs_succeeded, stats.jobs_failed, stats.jobs_in_flight) == (1, 5, 0)
    finally:
        m.shutdown()
    assert m.closed and process_is_gone(pid)
    assert m.stats().closed


# -- shutdown ---------------------------------------------------------------------------------


def test_shutdown_is_idempotent_and_later_calls_raise(host: HostBuffer) -> None:
    m = isolated(memory_factory(), host)
    pid = m.pid
    assert pid is not None and not process_is_gone(pid)
    m.shutdown()
    m.shutdown()
    assert process_is_gone(pid)
    assert_every_call_refused_after_shutdown(m)


def test_shutdown_with_a_job_in_flight_returns_within_its_bound(
    host: HostBuffer, rows: np.ndarray
) -> None:
    fill(rows, 0)
    stalled = frozenset({key(1)})
    m = isolated(functools.partial(StallingTier, stalled), host, shutdown_timeout_s=1.0)
    pid = m.pid
    assert pid is not None
    m.submit_store(store(1, [key(1)], [0]))
    m.shutdown()
    assert process_is_gone(pid)
    assert m.stats().closed


def test_every_way_to_change_the_presence_view_is_mirrored() -> None:
    """A mutation of KnownPresent that RecordingPresent does not override is one the
    scheduler's mirror never hears of (add_many was, for every block recovered at open)."""
    from tiering.isolation.mirror import RecordingPresent
    from tiering.runtime.presence import KnownPresent

    read_only = {"ages", "issuperset", "check_invariants", "max_keys", "ttl_s"}  # settings
    mutations = {name for name in vars(KnownPresent) if not name.startswith("_")} - read_only
    assert mutations == {"add", "add_many", "discard", "expire"}
    assert mutations <= set(vars(RecordingPresent))
