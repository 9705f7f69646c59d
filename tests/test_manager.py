"""TieringOffloadingManager behaviour on the real stack: CPU primary tier, async facades over
in-memory tiers (some gated or fault-injected). Cascade, promotion, failures, eviction with pins,
events, stats and metrics, shutdown without leftover threads."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterable, Iterator

import pytest

from tests.manager_helpers import (
    BLOCK_BYTES,
    GatedMemoryTier,
    RecordingTier,
    key,
    leftover_threads,
    load_and_verify,
    make_facade,
    make_primary,
    pattern,
    promote,
    read_row,
    rows_of,
    settle,
    step_until,
    store,
    write_row,
)
from tests.runtime_support import wait_until
from tiering.core.errors import ContractError, TierClosedError
from tiering.core.jobs import JobResult
from tiering.core.keys import NO_CONTEXT, ReqContext
from tiering.manager import TieringOffloadingManager
from tiering.primary import CPUPrimaryTier
from tiering.testing.faults import FaultPlan, FaultyTier
from tiers.memory import MemoryTier


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def threads_before() -> Iterator[set[threading.Thread]]:
    before = set(threading.enumerate())
    yield before
    assert leftover_threads(before) == []


def build(
    num_blocks: int = 8,
    tiers: tuple[object, ...] = ("memory", "memory"),
    **kwargs: object,
) -> tuple[TieringOffloadingManager, CPUPrimaryTier, list[RecordingTier]]:
    """A manager over a real primary tier and facades (``tiers``: AsyncTiers or 'memory')."""
    primary = make_primary(num_blocks)
    recorded = [
        RecordingTier(make_facade(MemoryTier() if t == "memory" else t, primary))  # type: ignore[arg-type]
        for t in tiers
    ]
    kwargs.setdefault("metrics_registry", False)
    manager = TieringOffloadingManager(primary, recorded, **kwargs)  # type: ignore[arg-type]
    return manager, primary, recorded


# -- cascade ------------------------------------------------------------------------------------


def test_store_cascades_to_every_tier_and_releases_pins(
    threads_before: set[threading.Thread],
) -> None:
    manager, primary, tiers = build()
    with manager:
        keys = [key(i) for i in range(4)]
        assert store(manager, keys) == keys
        assert all(manager.lookup(k, NO_CONTEXT) is True for k in keys)
        # one job per tier for the whole batch, each pinning the rows until its result
        assert [t.stores for t in tiers] == [1, 1]
        settle(manager)
        assert primary.num_pinned() == 0
        for tier in tiers:
            assert tier.get_num_blocks() == 4
            assert all(tier.lookup(k, NO_CONTEXT) is True for k in keys)
            tier.check_one_result_per_job()
        stats = manager.stats()
        assert stats.primary.cascades == 4
        assert [t.cascades for t in stats.secondary] == [4, 4]
        assert [t.bytes_moved for t in stats.secondary] == [4 * BLOCK_BYTES] * 2
        assert all(t.jobs_in_flight == 0 for t in stats.tiers)


def test_failed_store_is_not_cascaded() -> None:
    manager, primary, tiers = build()
    with manager:
        store(manager, [key(1)], success=False)
        assert manager.lookup(key(1), NO_CONTEXT) is False
        assert [t.stores for t in tiers] == [0, 0]
        assert primary.num_free() == primary.num_blocks
        assert manager.stats().primary.failures == 1


def test_cascade_pins_block_eviction_until_the_result_arrives() -> None:
    gated = GatedMemoryTier()
    manager, primary, _ = build(num_blocks=4, tiers=(gated,))
    with manager:
        first = [key(i) for i in range(4)]
        store(manager, first)
        assert all(primary.pin_count(k) == 1 for k in first)  # the cascade job's pin
        # the primary tier is full of pinned blocks: nothing can be evicted
        assert manager.prepare_store([key(10)], NO_CONTEXT) is None
        assert manager.stats().pinned_blocks == 4
        gated.gate.set()
        settle(manager)
        assert all(primary.pin_count(k) == 0 for k in first)
        # now eviction works. The primary tier keeps a prefix's first block most recently
        # used (later blocks are worthless without it), so the last one goes first.
        output = manager.prepare_store([key(10)], NO_CONTEXT)
        assert output is not None and output.evicted_keys == [first[-1]]
        manager.complete_store([key(10)])


def test_failed_cascade_releases_pins_and_is_counted() -> None:
    faulty = FaultyTier(MemoryTier(), FaultPlan(error_rate=1.0, ops={"write"}), seed=1)
    manager, primary, tiers = build(tiers=(faulty, "memory"))
    with manager:
        keys = [key(i) for i in range(3)]
        store(manager, keys)
        settle(manager)
        assert primary.num_pinned() == 0
        stats = manager.stats()
        assert stats.secondary[0].failures == 1
        assert stats.secondary[0].cascades == 0
        assert stats.secondary[1].cascades == 3  # the healthy tier is unaffected
        assert all(manager.lookup(k, NO_CONTEXT) is True for k in keys)  # still in the primary
        assert tiers[0].get_num_blocks() == 0


# -- promotion ----------------------------------------------------------------------------------


def evict_from_primary(
    manager: TieringOffloadingManager, keys: list, filler_start: int = 1000
) -> None:
    """Store fillers until ``keys`` are no longer in the primary tier."""
    primary = manager.primary
    i = filler_start
    while any(primary.is_stored_or_in_flight(k) for k in keys):
        settle(manager)
        store(manager, [key(i)])
        i += 1
    settle(manager)


def test_promotion_from_a_secondary_tier_brings_back_the_same_bytes() -> None:
    manager, primary, tiers = build(num_blocks=4, tiers=("memory",))
    with manager:
        keys = [key(i) for i in range(3)]
        store(manager, keys)
        settle(manager)
        evict_from_primary(manager, keys)
        assert all(not primary.is_ready(k) for k in keys)
        ctx = ReqContext(req_id="r1")
        assert [manager.lookup(k, ctx) for k in keys] == [None, None, None]
        assert manager.stats().staged_promotions == 3
        assert all(manager.is_promoting(k) for k in keys)
        manager.step()  # submits the request's batch as one job
        assert tiers[0].loads == 1
        step_until(manager, lambda: manager.lookup(keys[0], ctx) is True, "promotion")
        assert all(manager.lookup(k, ctx) is True for k in keys)
        load_and_verify(manager, keys, ctx)
        stats = manager.stats()
        assert stats.primary.promotions == 3
        assert stats.secondary[0].promotions == 3
        assert stats.secondary[0].hits == 3
        assert primary.num_pinned() == 0
        tiers[0].check_one_result_per_job()


def test_lookups_of_a_key_on_its_way_ask_only_a_tier_with_a_result_waiting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A key on its way is looked up again and again within a step; the tier is asked for
    results only once it has one (``has_finished``), and a landed promotion is still a hit
    in the very lookup that follows."""
    primary = make_primary(4)
    gated = GatedMemoryTier(gate_writes=False, gate_reads=True)
    facade = make_facade(gated, primary)
    manager = TieringOffloadingManager(primary, [facade], metrics_registry=False)
    with manager:
        keys = [key(i) for i in range(2)]
        store(manager, keys)
        settle(manager)
        evict_from_primary(manager, keys)
        asked = [0]
        real_get_finished = facade.get_finished

        def counting_get_finished() -> Iterable[JobResult]:
            asked[0] += 1
            return real_get_finished()

        monkeypatch.setattr(facade, "get_finished", counting_get_finished)
        ctx = ReqContext(req_id="r")
        assert manager.lookup(keys[0], ctx) is None
        manager.step()  # submits the promotion; its read waits at the gate
        before = asked[0]
        for _ in range(50):
            assert manager.lookup(keys[0], ctx) is None
        assert asked[0] == before  # nothing landed: the tier was not asked
        gated.gate.set()
        wait_until(facade.has_finished)
        assert manager.lookup(keys[0], ctx) is True
        assert asked[0] == before + 1
        load_and_verify(manager, keys[:1], ctx)


def test_lookups_of_different_requests_become_separate_jobs() -> None:
    manager, _, tiers = build(num_blocks=6, tiers=("memory",))
    with manager:
        keys = [key(i) for i in range(4)]
        store(manager, keys)
        settle(manager)
        evict_from_primary(manager, keys)
        a, b = ReqContext(req_id="a"), ReqContext(req_id="b")
        assert manager.lookup(keys[0], a) is None
        assert manager.lookup(keys[1], a) is None
        assert tiers[0].loads == 0  # still staged
        assert manager.lookup(keys[2], b) is None  # request a's batch is complete: sent
        assert tiers[0].loads == 1
        settle(manager)
        assert tiers[0].loads == 2
        assert [manager.lookup(k, a) for k in keys[:3]] == [True, True, True]


def test_promotion_without_a_free_primary_block_is_a_miss() -> None:
    manager, primary, _ = build(num_blocks=2, tiers=("memory",))
    with manager:
        old = key(1)
        store(manager, [old])
        settle(manager)
        evict_from_primary(manager, [old])
        held = [k for k in (key(1000), key(1001)) if primary.is_ready(k)]
        assert len(held) == 2
        spec = manager.prepare_load(held, NO_CONTEXT)  # the engine pins every block
        assert manager.lookup(old, NO_CONTEXT) is False
        assert manager.stats().promotion_no_room == 1
        manager.complete_load(held)
        assert rows_of(spec)  # (the pins were real rows)
        assert manager.lookup(old, NO_CONTEXT) is None  # room again: promoted


def test_promised_row_taken_before_the_batch_is_reserved_is_a_miss() -> None:
    manager, primary, _ = build(num_blocks=2, tiers=("memory",))
    with manager:
        wanted = key(1)
        store(manager, [wanted])
        settle(manager)
        evict_from_primary(manager, [wanted])
        held = [k for k in (key(1000), key(1001)) if primary.is_ready(k)]
        assert manager.lookup(wanted, NO_CONTEXT) is None  # an evictable block counts as room
        manager.prepare_load(held, NO_CONTEXT)  # ...until the engine pins every block
        manager.flush()
        assert not manager.is_promoting(wanted)
        assert manager.stats().promotion_no_room == 1
        assert primary.num_storing() == 0
        assert manager.lookup(wanted, NO_CONTEXT) is False
        manager.complete_load(held)


def test_failed_promotion_frees_the_row_and_backs_off() -> None:
    clock = FakeClock()
    faulty = FaultyTier(MemoryTier(), FaultPlan(), seed=3)
    manager, primary, tiers = build(
        num_blocks=4, tiers=(faulty,), clock=clock, failed_promotion_backoff_s=30.0
    )
    with manager:
        k = key(1)
        store(manager, [k])
        settle(manager)
        evict_from_primary(manager, [k])
        faulty.plan = FaultPlan(error_rate=1.0, ops={"read"})
        held_before = primary.num_free() + primary.num_ready()
        assert promote(manager, [k]) == [None]
        assert manager.lookup(k, NO_CONTEXT) is False
        # the reserved row (a block was evicted for it) went back to the free list
        assert primary.num_free() + primary.num_ready() == held_before
        assert primary.num_storing() == 0
        assert not primary.is_stored_or_in_flight(k)
        stats = manager.stats()
        assert stats.secondary[0].failures == 1
        assert stats.backoff_keys == 1
        # while backing off, lookups do not re-issue the doomed load
        for _ in range(5):
            assert manager.lookup(k, NO_CONTEXT) is False
            manager.step()
        assert tiers[0].loads == 1
        # after the back-off the key is tried again (and now succeeds)
        faulty.plan = FaultPlan()
        clock.now += 31.0
        manager.step()
        assert manager.stats().backoff_keys == 0
        assert promote(manager, [k]) == [None]
        assert manager.lookup(k, NO_CONTEXT) is True
        load_and_verify(manager, [k])
        assert tiers[0].loads == 2


def test_silently_corrupted_promotion_is_never_a_hit() -> None:
    faulty = FaultyTier(MemoryTier(), FaultPlan(), seed=5)
    manager, primary, _ = build(num_blocks=4, tiers=(faulty,))
    with manager:
        keys = [key(i) for i in range(2)]
        store(manager, keys)
        settle(manager)
        evict_from_primary(manager, keys)
        faulty.plan = FaultPlan(corrupt_rate=1.0, ops={"read"}, detect=False)
        promote(manager, keys)
        assert [manager.lookup(k, NO_CONTEXT) for k in keys] == [False, False]
        assert faulty.injected["corrupt:read"] >= 1
        assert primary.num_pinned() == 0


def test_promotion_from_a_later_tier_backfills_earlier_tiers() -> None:
    first = FaultyTier(MemoryTier(), FaultPlan(error_rate=1.0, ops={"write"}), seed=2)
    manager, _, tiers = build(num_blocks=4, tiers=(first, "memory"))
    with manager:
        k = key(7)
        store(manager, [k])
        settle(manager)
        assert tiers[0].get_num_blocks() == 0 and tiers[1].get_num_blocks() == 1
        evict_from_primary(manager, [k])
        first.plan = FaultPlan()
        promote(manager, [k])
        assert manager.lookup(k, NO_CONTEXT) is True
        settle(manager)
        assert tiers[0].lookup(k, NO_CONTEXT) is True  # backfilled from tier 1's promotion
        assert manager.stats().secondary[1].promotions == 1


def test_promotion_evicts_an_unpinned_block() -> None:
    manager, primary, _ = build(num_blocks=2, tiers=("memory",))
    with manager:
        old = key(1)
        store(manager, [old])
        settle(manager)
        evict_from_primary(manager, [old])
        evictions = manager.stats().primary.evictions
        assert manager.lookup(old, NO_CONTEXT) is None
        assert manager.stats().primary.evictions == evictions  # a row is only promised...
        manager.flush()
        assert manager.stats().primary.evictions == evictions + 1  # ...and reserved in batch
        promote(manager, [old])
        load_and_verify(manager, [old])
        assert primary.num_ready() <= primary.num_blocks


def test_a_promotion_never_evicts_a_block_answered_true_this_step() -> None:
    manager, primary, _ = build(num_blocks=2, tiers=("memory",))
    with manager:
        wanted, hit, filler = key(1), key(2), key(3)
        store(manager, [wanted])
        settle(manager)
        evict_from_primary(manager, [wanted], filler_start=2)  # stores key(2) then key(3)
        assert primary.is_ready(hit) and primary.is_ready(filler)
        assert manager.prepare_store([], NO_CONTEXT) is not None  # (a step boundary)
        # hit is the least recently used block: the natural victim of the next eviction
        assert manager.lookup(hit, NO_CONTEXT) is True
        assert manager.lookup(wanted, NO_CONTEXT) is None
        manager.flush()  # reserves the promotion's row: evicts the filler...
        assert primary.is_ready(hit) and not primary.is_ready(filler)
        load_and_verify(manager, [hit])  # ...so the engine can still load its hit
        # once every block is a hit of this step, a promotion finds no room: a miss
        promote(manager, [wanted])
        assert manager.lookup(hit, NO_CONTEXT) is True
        assert manager.lookup(wanted, NO_CONTEXT) is True
        assert manager.lookup(filler, NO_CONTEXT) is False
        manager.step()
        assert primary.num_pinned() == 0  # the step's protection ended


# -- contract errors ----------------------------------------------------------------------------


def test_engine_cannot_release_the_managers_pins() -> None:
    gated = GatedMemoryTier()
    manager, primary, _ = build(tiers=(gated,))
    with manager:
        k = key(1)
        store(manager, [k])
        with pytest.raises(ContractError, match="not pinned by a prepare_load"):
            manager.complete_load([k])
        assert primary.pin_count(k) == 1  # the cascade's pin is intact
        manager.prepare_load([k], NO_CONTEXT)
        with pytest.raises(ContractError):
            manager.complete_load([k, k])  # more releases than pins: nothing changes
        assert primary.pin_count(k) == 2
        manager.complete_load([k])
        gated.gate.set()
        settle(manager)
        assert primary.pin_count(k) == 0


def test_complete_store_of_a_key_being_promoted_is_rejected() -> None:
    manager, _, _ = build(num_blocks=4, tiers=("memory",))
    with manager:
        k = key(1)
        store(manager, [k])
        settle(manager)
        evict_from_primary(manager, [k])
        assert manager.lookup(k, NO_CONTEXT) is None
        with pytest.raises(ContractError, match="being promoted"):
            manager.complete_store([k])
        # the engine offering to store it again is told there is nothing to store
        output = manager.prepare_store([k], NO_CONTEXT)
        assert output is not None and output.keys_to_store == []
        promote(manager, [k])
        load_and_verify(manager, [k])


def test_prepare_load_of_a_missing_block_is_rejected() -> None:
    manager, primary, _ = build()
    with manager:
        with pytest.raises(ContractError):
            manager.prepare_load([key(5)], NO_CONTEXT)
        assert primary.num_pinned() == 0


# -- touch and events ---------------------------------------------------------------------------


def test_touch_reaches_every_tier() -> None:
    bounded = MemoryTier(capacity_blocks=2)
    manager, _, tiers = build(num_blocks=8, tiers=(bounded, "memory"))
    with manager:
        a, b, c = key(1), key(2), key(3)
        store(manager, [a])
        settle(manager)
        store(manager, [b])
        settle(manager)
        manager.touch([a], NO_CONTEXT)
        assert [t.touched for t in tiers] == [[[a]], [[a]]]
        store(manager, [c])  # the bounded tier must evict: b, since a was touched
        settle(manager)
        step_until(manager, lambda: tiers[0].lookup(b, NO_CONTEXT) is False, "eviction of b")
        assert tiers[0].lookup(a, NO_CONTEXT) is True
        assert tiers[0].lookup(c, NO_CONTEXT) is True


def test_events_carry_the_medium_of_each_tier() -> None:
    bounded = MemoryTier(capacity_blocks=1)
    manager, _, _ = build(num_blocks=2, tiers=(bounded,), event_block_size=16)
    with manager:
        a, b = key(1), key(2)
        store(manager, [a])
        settle(manager)
        store(manager, [b])  # evicts a from the bounded tier
        settle(manager)
        events = []
        step_until(
            manager,
            lambda: (
                bool(events.extend(manager.take_events()))
                or any(e.removed and e.medium == "memory" for e in events)
            ),
            "a removal event",
        )
        cpu_stored = [k for e in events if e.medium == "CPU" and not e.removed for k in e.keys]
        tier_stored = [k for e in events if e.medium == "memory" and not e.removed for k in e.keys]
        tier_removed = [k for e in events if e.medium == "memory" and e.removed for k in e.keys]
        assert cpu_stored == [a, b]
        assert tier_stored == [a, b]
        assert tier_removed == [a]
        assert all(e.block_size == 16 for e in events if e.medium == "memory")


def test_events_disabled_yields_nothing() -> None:
    primary = make_primary(4, enable_events=False)
    manager = TieringOffloadingManager(
        primary, [make_facade(MemoryTier(), primary)], enable_events=False, metrics_registry=False
    )
    with manager:
        store(manager, [key(1)])
        settle(manager)
        assert list(manager.take_events()) == []


# -- stats, metrics -----------------------------------------------------------------------------


def test_stats_are_immutable_snapshots() -> None:
    manager, _, _ = build(tiers=("memory",))
    with manager:
        before = manager.stats()
        store(manager, [key(1)])
        settle(manager)
        after = manager.stats()
        assert before.primary.cascades == 0 and after.primary.cascades == 1
        with pytest.raises(dataclasses.FrozenInstanceError):
            after.primary.hits = 5  # type: ignore[misc]
        assert after.tier("memory") is after.secondary[0]
        assert after.primary.capacity_blocks == 8
        assert after.primary.blocks_held == 1
        with pytest.raises(KeyError):
            after.tier("nope")


def test_prometheus_metrics_follow_the_stats() -> None:
    registry = pytest.importorskip("prometheus_client").CollectorRegistry()
    manager, _, _ = build(tiers=("memory",), metrics_registry=registry, name="t1")
    labels = {"manager": "t1", "tier": "memory", "medium": "memory"}
    with manager:
        store(manager, [key(1), key(2)])
        settle(manager)
        manager.publish_metrics()
        assert registry.get_sample_value("kv_tiering_tier_cascaded_blocks_total", labels) == 2
        assert registry.get_sample_value("kv_tiering_tier_blocks", labels) == 2
        assert registry.get_sample_value("kv_tiering_lookups_total", {"manager": "t1"}) == 0
    assert registry.get_sample_value("kv_tiering_tier_blocks", labels) is None  # unregistered


def test_metrics_go_to_the_default_registry_with_unique_names() -> None:
    registry = pytest.importorskip("prometheus_client").REGISTRY
    one, _, _ = build(tiers=("memory",), metrics_registry=None, name="default-reg")
    two, _, _ = build(tiers=("memory",), metrics_registry=None, name="default-reg")
    with one, two:
        assert (one.metrics_name, two.metrics_name) == ("default-reg", "default-reg-2")
        store(two, [key(1)])
        settle(two)
        one.publish_metrics()
        two.publish_metrics()
        labels = {"tier": "memory", "medium": "memory"}
        assert (
            registry.get_sample_value(
                "kv_tiering_tier_cascaded_blocks_total", {"manager": "default-reg-2", **labels}
            )
            == 1
        )
        assert (
            registry.get_sample_value(
                "kv_tiering_tier_cascaded_blocks_total", {"manager": "default-reg", **labels}
            )
            == 0
        )
    assert registry.get_sample_value("kv_tiering_lookups_total", {"manager": "default-reg"}) is None


def test_metrics_names_are_unique_per_registry() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    other = prometheus_client.CollectorRegistry()
    one, _, _ = build(tiers=(), metrics_registry=registry, name="same")
    two, _, _ = build(tiers=(), metrics_registry=registry, name="same")
    elsewhere, _, _ = build(tiers=(), metrics_registry=other, name="same")
    with one, two, elsewhere:
        assert (one.metrics_name, two.metrics_name) == ("same", "same-2")
        assert elsewhere.metrics_name == "same"  # another registry: no clash
        one.step()
        two.step()
        for name in ("same", "same-2"):  # one series each: no duplicate samples
            assert registry.get_sample_value("kv_tiering_lookups_total", {"manager": name}) == 0
    # Every manager gone: the registry no longer holds our collector.
    assert registry.get_sample_value("kv_tiering_lookups_total", {"manager": "same"}) is None


# -- shutdown -----------------------------------------------------------------------------------


def test_shutdown_is_idempotent_and_leaves_no_thread(threads_before: set[threading.Thread]) -> None:
    manager, _, tiers = build()
    store(manager, [key(1)])
    manager.shutdown()
    manager.shutdown()
    assert manager.closed
    for tier in tiers:
        tier.check_one_result_per_job()
    final = manager.stats()
    assert final.closed and final.primary.cascades == 1
    assert [t.cascades for t in final.secondary] == [1, 1]  # drained before shutting down
    with pytest.raises(TierClosedError):
        manager.lookup(key(1), NO_CONTEXT)
    with pytest.raises(TierClosedError):
        manager.step()


def test_shutdown_gives_up_on_hung_jobs_within_its_bound(
    threads_before: set[threading.Thread],
) -> None:
    gated = GatedMemoryTier()  # never opened: the cascade hangs
    manager, _, _ = build(tiers=(gated, "memory"), shutdown_timeout_s=0.2)
    store(manager, [key(1), key(2)])
    manager.shutdown()
    final = manager.stats()
    assert final.secondary[1].cascades == 2
    assert final.secondary[0].cascades == 0
    assert final.jobs_in_flight == 0
    assert final.pinned_blocks == 0  # the abandoned job's pins were released
    assert final.secondary[0].failures == 1


def test_shutdown_drops_staged_promotions(threads_before: set[threading.Thread]) -> None:
    manager, _, _ = build(num_blocks=4, tiers=("memory",))
    k = key(1)
    store(manager, [k])
    settle(manager)
    evict_from_primary(manager, [k])
    assert manager.lookup(k, NO_CONTEXT) is None
    manager.shutdown()
    assert not manager.is_promoting(k)


def test_rows_hold_what_the_gpu_wrote() -> None:
    # A sanity check of the helpers themselves: rows are the buffer the tiers read.
    primary = make_primary(2)
    write_row(primary, 1, pattern(key(9)))
    assert read_row(primary, 1) == pattern(key(9))
    primary.shutdown()


def test_a_block_gone_from_its_tier_is_a_routine_miss_not_a_warning(
    caplog: pytest.LogCaptureFixture,
) -> None:
    import logging

    from tiering.core.errors import BlockNotFound

    k = key(1)

    def gone(op: str, missing: bytes) -> BaseException:
        return BlockNotFound(missing)

    evicted_behind_our_back = FaultyTier(
        MemoryTier(), FaultPlan(error_rate=1.0, error=gone, ops={"read"}, keys={k})
    )
    manager, _, _ = build(num_blocks=4, tiers=(evicted_behind_our_back,))
    with manager:
        store(manager, [k])
        evict_from_primary(manager, [k])
        caplog.set_level(logging.INFO, logger="tiering")
        assert promote(manager, [k]) == [None]
        assert manager.lookup(k, NO_CONTEXT) is False  # a miss, then recomputed
        assert "promotion of 1 block(s) failed" in caplog.text
        assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text
