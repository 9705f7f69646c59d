"""Garbage collections handed off the scheduler thread: when they are due, where they run, the
option (a tier's loop thread; an isolated tier's collector thread)."""

from __future__ import annotations

import functools
import gc
import logging
import os
import threading
from collections.abc import Iterator

import pytest

from tests.runtime_support import key, one_result, primary, store, wait_until
from tiering.core.errors import ConfigError
from tiering.isolation import IsolatedTierManager
from tiering.primary.host_buffer import HostBuffer, make_shared_name
from tiering.registry import create_secondary_tier
from tiering.runtime import AsyncTierManager
from tiering.runtime.facade import check_runtime_options
from tiering.runtime.young_gc import (
    DUE_FRACTION,
    CollectorThread,
    collect_young_generation,
    young_collection_due,
)
from tiers.memory import MemoryTier

#: A threshold far above what anything but the test's own allocations reaches, so the
#: youngest generation's count is the test's to set.
THRESHOLD = 40_000
BELOW = int(THRESHOLD * DUE_FRACTION * 0.6)
PAST = int(THRESHOLD * DUE_FRACTION * 1.4)


@pytest.fixture
def collections() -> Iterator[list[tuple[str, int]]]:
    """(thread name, generation) of each collection that starts; a known threshold, count 0."""
    saved, was_enabled = gc.get_threshold(), gc.isenabled()
    seen: list[tuple[str, int]] = []

    def record(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            seen.append((threading.current_thread().name, info["generation"]))

    gc.enable()
    gc.set_threshold(THRESHOLD, *saved[1:])
    gc.collect()  # every count back to 0
    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)
        gc.set_threshold(*saved)
        if not was_enabled:
            gc.disable()


def allocate(n: int) -> list[list[int]]:
    return [[] for _ in range(n)]


def test_a_collection_is_due_past_the_fraction_of_the_threshold(
    collections: list[tuple[str, int]],
) -> None:
    kept = allocate(BELOW)
    assert not young_collection_due()
    kept += allocate(PAST - BELOW)
    assert young_collection_due()
    assert collections == []  # checking collects nothing


def test_a_due_collection_runs_on_the_calling_thread_as_cpython_picks_it(
    collections: list[tuple[str, int]],
) -> None:
    kept = allocate(PAST)
    collect_young_generation()
    assert collections == [(threading.current_thread().name, 0)]
    assert gc.get_count()[0] < BELOW
    assert len(kept) == PAST  # what was alive stays alive
    assert gc.get_threshold()[0] == THRESHOLD  # lowered for the hand-off only


def test_a_hand_off_collects_the_older_generation_when_cpython_would(
    collections: list[tuple[str, int]],
) -> None:
    """The generation is CPython's choice: past the middle generation's threshold (its
    count is the youngest's collections since its own), the hand-off collects both."""
    thresholds = gc.get_threshold()
    for _ in range(thresholds[1] + 1):
        gc.collect(0)
    collections.clear()
    kept = allocate(PAST)
    collect_young_generation()
    assert collections == [(threading.current_thread().name, 1)]
    count = gc.get_count()
    assert count[1] == 0 and count[0] < BELOW
    assert gc.get_threshold() == thresholds
    del kept


def test_nothing_is_collected_before_it_is_due(collections: list[tuple[str, int]]) -> None:
    kept = allocate(BELOW)
    collect_young_generation()
    assert collections == []
    assert gc.get_count()[0] >= BELOW
    del kept


@pytest.mark.parametrize("switch_off", ["disable", "threshold 0"])
def test_an_embedder_that_turned_collection_off_gets_none(
    collections: list[tuple[str, int]], switch_off: str
) -> None:
    kept = allocate(PAST)
    if switch_off == "disable":
        gc.disable()
    else:
        gc.set_threshold(0)
    assert not young_collection_due()
    collect_young_generation()
    assert collections == []
    del kept


@pytest.mark.parametrize("on", [True, False])
def test_get_finished_hands_a_due_collection_to_the_loop_thread(
    collections: list[tuple[str, int]], on: bool
) -> None:
    buffer = primary(4)
    with AsyncTierManager(
        MemoryTier(), buffer.data, "memory", name="young-gc", gc_handoff=on
    ) as manager:
        kept = allocate(PAST)
        assert list(manager.get_finished()) == []
        manager.submit_store(store(1, [key(1)], [0]))  # behind the collection on the loop
        assert one_result(manager).success
        loop_collections = [c for c in collections if c[0] == "tier-young-gc"]
        if on:
            assert loop_collections == [("tier-young-gc", 0)]
            assert gc.get_count()[0] < BELOW
        else:
            assert loop_collections == []
            assert gc.get_count()[0] > BELOW  # a collection would have reset it
        assert not [c for c in collections if c[0] == threading.current_thread().name]
        del kept


@pytest.mark.parametrize("bad", [None, 1, "yes"])
def test_a_bad_gc_handoff_is_a_config_error_naming_it(bad: object) -> None:
    with pytest.raises(ConfigError, match="gc_handoff"):
        check_runtime_options(gc_handoff=bad)
    if bad is None:
        return  # in a config entry JSON null means the default (docs/configuration.md)
    buffer = memoryview(bytearray(8 * 64)).cast("B", (8, 64))
    with pytest.raises(ConfigError, match="gc_handoff"):
        create_secondary_tier({"type": "memory", "gc_handoff": bad}, buffer, position=0)


def test_the_config_key_reaches_the_manager_and_is_refused_for_a_child_process() -> None:
    buffer = memoryview(bytearray(8 * 64)).cast("B", (8, 64))
    with create_secondary_tier(
        {"type": "memory", "gc_handoff": False}, buffer, position=0
    ) as manager:
        assert manager._offer_collection is None
    with create_secondary_tier({"type": "memory"}, buffer, position=0) as manager:
        assert manager._offer_collection is not None


def test_the_collector_thread_collects_when_offered_and_stops_when_closed(
    collections: list[tuple[str, int]],
) -> None:
    collector = CollectorThread("young-gc-collector")
    try:
        kept = allocate(PAST)
        collector.offer()
        wait_until(lambda: collections)  # the thread takes the request at its own pace
        assert collections == [("young-gc-collector", 0)]
        collector.offer()  # nothing due any more: it runs nothing
    finally:
        collector.close()
    assert not collector.thread.is_alive()
    assert collections == [("young-gc-collector", 0)]
    collector.close()  # again: nothing to do
    del kept


def test_the_collector_thread_runs_on_the_cpus_it_is_given() -> None:
    one_cpu = frozenset({max(os.sched_getaffinity(0))})
    collector = CollectorThread("young-gc-pinned", one_cpu)
    try:
        native_id = collector.thread.native_id
        assert native_id is not None
        wait_until(lambda: os.sched_getaffinity(native_id) == one_cpu)
    finally:
        collector.close()


def test_a_collector_thread_that_cannot_be_pinned_warns_and_still_collects(
    collections: list[tuple[str, int]], caplog: pytest.LogCaptureFixture
) -> None:
    no_such_cpu = frozenset({1 << 20})
    with caplog.at_level(logging.WARNING, logger="tiering.runtime.young_gc"):
        collector = CollectorThread("young-gc-unpinned", no_such_cpu)
        try:
            kept = allocate(PAST)
            collector.offer()
            wait_until(lambda: collections)
        finally:
            collector.close()
    assert collections == [("young-gc-unpinned", 0)]
    (record,) = [r for r in caplog.records if r.name == "tiering.runtime.young_gc"]
    assert "young-gc-unpinned runs unpinned" in record.getMessage()
    assert "cpus" in record.getMessage()
    del kept


@pytest.mark.parametrize("on", [True, False])
def test_an_isolated_tier_hands_a_due_collection_to_its_collector_thread(
    collections: list[tuple[str, int]], on: bool
) -> None:
    host = HostBuffer.create(4, 4096, shared_name=make_shared_name("young_gc"))
    try:
        factory = functools.partial(MemoryTier, capacity_blocks=8)
        one_cpu = frozenset({max(os.sched_getaffinity(0))})
        with IsolatedTierManager(
            factory, host, "memory", name="young-gc-iso", gc_handoff=on, cpus=one_cpu
        ) as manager:
            collector = manager._collector
            assert (collector is not None) is on
            if collector is not None:
                # The scheduler's CPUs (its creator's), not the tier's: there the tier's
                # busy process would preempt it mid-collection, GIL held.
                native_id = collector.thread.native_id
                assert native_id is not None
                assert os.sched_getaffinity(native_id) == os.sched_getaffinity(0)
            kept = allocate(PAST)
            assert list(manager.get_finished()) == []
            if collector is not None:
                collector.close()  # joins once the queued request has run
                assert ("tier-young-gc-iso-gc", 0) in collections
                assert gc.get_count()[0] < BELOW
            else:
                assert gc.get_count()[0] > BELOW  # a collection would have reset it
            assert not [c for c in collections if c[0] == threading.current_thread().name]
            del kept
        if collector is not None:
            assert not collector.thread.is_alive()
    finally:
        host.close()
        host.unlink()


def test_hand_offs_on_two_threads_at_once_leave_the_thresholds_as_they_were() -> None:
    """Two tiers' loop threads collecting at once, with a GIL switch every microsecond:
    neither may save the other's lowered threshold and restore it for good."""
    import sys
    import time

    class Allocation:
        pass

    before = gc.get_threshold()
    interval = sys.getswitchinterval()
    stop = time.monotonic() + 2.0

    def collector() -> None:
        while time.monotonic() < stop:
            kept = [Allocation() for _ in range(400)]  # past a quarter of the threshold
            collect_young_generation()
            del kept

    threads = [threading.Thread(target=collector) for _ in range(2)]
    sys.setswitchinterval(1e-6)
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
    finally:
        sys.setswitchinterval(interval)
    assert gc.get_threshold() == before
