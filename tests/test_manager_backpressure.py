"""Back-pressure in our manager: a tier that falls behind drops cascades and counts them.

A scripted tier answers only when the test says so and the clock is the
test's, so every decision is deterministic: a cascade is dropped exactly
when the tier's cascades in flight would pin more than its share of the
primary tier and the oldest has waited longer than a tier that keeps up
takes. ``prepare_store`` never refuses silently: a refusal is counted too.
Counts are exact and the same in ``stats()``, Prometheus and the replay
report's figures.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from tests.manager_helpers import key, make_primary, store
from tiering.core.jobs import JobMetadata, JobResult, SecondaryTierManager
from tiering.core.keys import NO_CONTEXT, OffloadKey, ReqContext
from tiering.manager import TieringOffloadingManager
from tiering.manager.backpressure import BEHIND_AFTER_S


class ScriptedTier(SecondaryTierManager):
    """Holds every job until :meth:`answer` is called; then reports it done."""

    def __init__(self, primary: Any) -> None:
        super().__init__(primary.kv_view, "scripted")
        self.pending: list[JobMetadata] = []
        self.done: list[JobResult] = []
        self.held: set[OffloadKey] = set()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return key in self.held

    def submit_store(self, job_metadata: JobMetadata) -> None:
        self.pending.append(job_metadata)

    def submit_load(self, job_metadata: JobMetadata) -> None:
        self.pending.append(job_metadata)

    def answer(self, count: int | None = None) -> None:
        """Finish the ``count`` oldest jobs (all by default)."""
        finished, self.pending = self.pending[:count], self.pending[len(self.pending[:count]) :]
        for job in finished:
            self.held.update(job.keys)
            self.done.append(JobResult(job.job_id, True))

    def get_finished(self) -> Iterable[JobResult]:
        done, self.done = self.done, []
        return done

    def get_num_blocks(self) -> int:
        return len(self.held)

    def take_events(self) -> Iterable[tuple[list[OffloadKey], bool]]:
        return []

    def drain(self, timeout_s: float) -> None:
        """The manager's shutdown waits here: everything finishes."""
        self.answer()

    def shutdown(self) -> None:
        self.answer()


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def build(num_blocks: int = 16, **options: Any) -> tuple[TieringOffloadingManager, Any, Clock]:
    primary = make_primary(num_blocks)
    tier = ScriptedTier(primary)
    clock = Clock()
    options.setdefault("metrics_registry", False)
    manager = TieringOffloadingManager(primary, [tier], clock=clock, **options)
    return manager, tier, clock


def keys(start: int, count: int) -> list[OffloadKey]:
    return [key(i) for i in range(start, start + count)]


def test_a_tier_behind_its_share_gets_no_cascade_and_the_blocks_are_counted() -> None:
    manager, tier, clock = build(16, cascade_max_pinned_fraction=0.25)  # 4 blocks
    store(manager, keys(0, 3))
    assert len(tier.pending) == 1
    clock.now += BEHIND_AFTER_S * 2  # the tier has not answered: it is behind
    store(manager, keys(3, 2))  # 3 + 2 > 4: dropped for this tier
    assert len(tier.pending) == 1
    stats = manager.stats()
    assert stats.secondary[0].dropped == 2 and stats.primary.dropped == 0
    assert stats.pinned_blocks == 3  # only the admitted job pins primary rows
    store(manager, keys(5, 1))  # 3 + 1 fits the share
    assert len(tier.pending) == 2
    tier.answer()
    manager.step()
    store(manager, keys(6, 3))  # caught up: admitted again
    assert len(tier.pending) == 1
    assert manager.stats().secondary[0].dropped == 2
    manager.shutdown()


def test_a_tier_that_keeps_up_is_never_behind_whatever_it_has_in_flight() -> None:
    manager, tier, _clock = build(16, cascade_max_pinned_fraction=0.25)
    for start in range(0, 12, 3):
        store(manager, keys(start, 3))  # 12 blocks in flight, no time has passed
    assert len(tier.pending) == 4 and manager.stats().secondary[0].dropped == 0
    manager.shutdown()


def test_one_job_always_goes_through_however_small_the_share() -> None:
    manager, tier, _clock = build(16, cascade_max_pinned_fraction=1 / 16)  # 1 block
    store(manager, keys(0, 5))  # larger than the share, but nothing is in flight
    assert len(tier.pending) == 1 and manager.stats().secondary[0].dropped == 0
    manager.shutdown()


def test_results_that_arrived_are_collected_before_dropping() -> None:
    manager, tier, clock = build(16, cascade_max_pinned_fraction=0.25)
    store(manager, keys(0, 4))
    clock.now += 1.0
    tier.answer()  # answered, not yet collected by the manager
    store(manager, keys(4, 4))
    assert len(tier.pending) == 1 and manager.stats().secondary[0].dropped == 0
    manager.shutdown()


def test_a_refused_prepare_store_is_counted_never_silent(
    caplog: pytest.LogCaptureFixture,
) -> None:
    manager, tier, _clock = build(8, cascade_max_pinned_fraction=1.0)
    store(manager, keys(0, 8))  # the tier never answers: every row stays pinned
    with caplog.at_level("WARNING", logger="tiering.manager"):
        assert manager.prepare_store(keys(8, 3), NO_CONTEXT) is None
        assert manager.prepare_store(keys(11, 2), NO_CONTEXT) is None
    assert manager.stats().primary.dropped == 5
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and "no primary block could be freed (8 of 8 pinned)" in warnings[0]
    tier.answer()
    manager.step()
    assert manager.prepare_store(keys(8, 3), NO_CONTEXT) is not None
    manager.shutdown()


def test_dropped_blocks_are_the_same_in_stats_and_prometheus() -> None:
    prometheus = pytest.importorskip("prometheus_client")
    registry = prometheus.CollectorRegistry()
    manager, _tier, clock = build(16, cascade_max_pinned_fraction=0.25, metrics_registry=registry)
    store(manager, keys(0, 4))
    clock.now += 1.0
    store(manager, keys(4, 2))
    store(manager, keys(6, 3))
    manager.publish_metrics()
    stats = manager.stats()
    assert stats.secondary[0].dropped == 5
    for tier_name, expected in (("scripted", 5.0), ("cpu", 0.0)):
        value = registry.get_sample_value(
            "kv_tiering_tier_dropped_blocks_total",
            {
                "manager": manager.metrics_name,
                "tier": tier_name,
                "medium": stats.tier(tier_name).medium,
            },
        )
        assert value == expected
    manager.shutdown()


def test_the_share_must_be_a_fraction() -> None:
    for bad in (0, -0.5, 1.5):
        with pytest.raises(ValueError, match="cascade_max_pinned_fraction must be in"):
            build(cascade_max_pinned_fraction=bad)
