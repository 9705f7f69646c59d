"""Prometheus metrics of tiering managers, through ``prometheus_client`` when it is installed.

Without ``prometheus_client`` every call here is a cheap no-op. With it, each
manager gets a :class:`MetricsExport`: the manager *publishes* an immutable
:class:`~tiering.core.stats.ManagerStats` snapshot from the scheduler thread (a
reference swap), and a collector turns the latest snapshot of every live
manager into metric families when Prometheus scrapes, on whatever thread the
HTTP server uses. The scrape thread therefore never reads the manager's
mutable state.

Metric names start with ``kv_tiering_``; per-tier series carry the labels
``manager``, ``tier`` and ``medium``. Counters are exposed with a ``_total``
suffix; ``kv_tiering_tier_job_seconds`` is a histogram of finished jobs'
durations (``_bucket``, ``_sum``, ``_count``). Serve them with the
``metrics_port`` option, ``tiering replay --metrics-port`` or
:func:`tiering.metrics.server.serve_metrics` (see ``docs/metrics.md``).
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

from tiering.core.stats import JOB_SECONDS_BUCKETS, ManagerStats, TierStats

prometheus_client: Any
try:  # optional dependency: metrics are a no-op without it
    import prometheus_client
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )
except ImportError:  # pragma: no cover - exercised only where the extra is absent
    prometheus_client = None

_TIER_LABELS = ["manager", "tier", "medium"]

#: (metric name, help, TierStats attribute, is_counter)
_TIER_METRICS: tuple[tuple[str, str, Callable[[TierStats], float | None], bool], ...] = (
    ("kv_tiering_tier_blocks", "Blocks held by the tier.", lambda t: t.blocks_held, False),
    (
        "kv_tiering_tier_capacity_blocks",
        "Most blocks the tier can hold (absent when unbounded).",
        lambda t: t.capacity_blocks,
        False,
    ),
    ("kv_tiering_tier_hits", "Lookups this tier answered present.", lambda t: t.hits, True),
    ("kv_tiering_tier_misses", "Lookups this tier answered absent.", lambda t: t.misses, True),
    (
        "kv_tiering_tier_promoted_blocks",
        "Blocks promoted into (primary) or out of (secondary) the tier.",
        lambda t: t.promotions,
        True,
    ),
    (
        "kv_tiering_tier_cascaded_blocks",
        "Blocks stored into the tier (from the GPU for the primary tier).",
        lambda t: t.cascades,
        True,
    ),
    ("kv_tiering_tier_evicted_blocks", "Blocks evicted by the tier.", lambda t: t.evictions, True),
    ("kv_tiering_tier_failed_jobs", "Failed jobs of the tier.", lambda t: t.failures, True),
    (
        "kv_tiering_tier_dropped_blocks",
        "Blocks not stored into the tier: cascades dropped by back-pressure (secondary), "
        "offloads prepare_store refused (primary).",
        lambda t: t.dropped,
        True,
    ),
    ("kv_tiering_tier_moved_bytes", "Bytes moved by finished jobs.", lambda t: t.bytes_moved, True),
    (
        "kv_tiering_tier_moved_seconds",
        "Seconds spent by finished jobs.",
        lambda t: t.seconds_moved,
        True,
    ),
    (
        "kv_tiering_tier_parts_out_of_service",
        "Parts of the tier (drives of a striped fs tier) out of service now.",
        lambda t: t.parts_out_of_service,
        False,
    ),
    (
        "kv_tiering_tier_jobs_in_flight",
        "Jobs submitted to the tier without a result yet.",
        lambda t: t.jobs_in_flight,
        False,
    ),
)

#: (metric name, help, ManagerStats attribute, is_counter)
_MANAGER_METRICS: tuple[tuple[str, str, Callable[[ManagerStats], float], bool], ...] = (
    ("kv_tiering_lookups", "Lookups answered by the manager.", lambda s: s.lookups, True),
    ("kv_tiering_lookup_retries", "Lookups answered 'retry later'.", lambda s: s.retries, True),
    (
        "kv_tiering_promotion_no_room",
        "Secondary hits answered as misses for lack of a free primary block.",
        lambda s: s.promotion_no_room,
        True,
    ),
    (
        "kv_tiering_backoff_keys",
        "Keys answered as misses after a failed promotion.",
        lambda s: s.backoff_keys,
        False,
    ),
    ("kv_tiering_pinned_blocks", "Primary blocks pinned now.", lambda s: s.pinned_blocks, False),
    (
        "kv_tiering_oldest_job_age_seconds",
        "Age of the oldest job in flight.",
        lambda s: s.oldest_job_age_s,
        False,
    ),
    (
        "kv_tiering_unexpected_results",
        "Job results with an unknown job id or from the wrong tier.",
        lambda s: s.unexpected_results,
        True,
    ),
    (
        "kv_tiering_internal_errors",
        "Errors caught while handling job results or calling a tier.",
        lambda s: s.internal_errors,
        True,
    ),
)


def metrics_available() -> bool:
    """Whether ``prometheus_client`` is installed (metrics are exported)."""
    return prometheus_client is not None


class _Collector:
    """A Prometheus collector over the latest snapshots of a set of managers."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _exports against a concurrent scrape
        self._exports: dict[str, MetricsExport] = {}

    def add(self, export: MetricsExport, wanted_name: str) -> str:
        with self._lock:
            name, suffix = wanted_name, 1
            while name in self._exports:
                suffix += 1
                name = f"{wanted_name}-{suffix}"
            self._exports[name] = export
            return name

    def discard(self, name: str) -> None:
        with self._lock:
            self._exports.pop(name, None)

    def __len__(self) -> int:
        with self._lock:
            return len(self._exports)

    def describe(self) -> list[Any]:
        # Dynamic series: tell the registry nothing up front (no duplicate checks on names).
        return []

    def collect(self) -> Iterator[Any]:
        with self._lock:
            snapshots = [
                (name, latest)
                for name, export in self._exports.items()
                if (latest := export.latest) is not None
            ]
        yield from _families(snapshots)


def _families(snapshots: list[tuple[str, ManagerStats]]) -> Iterator[Any]:
    yield _job_seconds(snapshots)
    for metric, doc, value_of, is_counter in _TIER_METRICS:
        family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
            metric, doc, labels=_TIER_LABELS
        )
        for manager, stats in snapshots:
            for tier in stats.tiers:
                value = value_of(tier)
                if value is not None:
                    family.add_metric([manager, tier.name, tier.medium], float(value))
        yield family
    for metric, doc, manager_value, is_counter in _MANAGER_METRICS:
        family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
            metric, doc, labels=["manager"]
        )
        for manager, stats in snapshots:
            family.add_metric([manager], float(manager_value(stats)))
        yield family


def _job_seconds(snapshots: list[tuple[str, ManagerStats]]) -> Any:
    """The histogram of finished jobs' durations, per tier (the primary: all tiers' jobs)."""
    family = HistogramMetricFamily(
        "kv_tiering_tier_job_seconds",
        "Duration of finished jobs that moved blocks (for the primary tier: every tier's).",
        labels=_TIER_LABELS,
    )
    for manager, stats in snapshots:
        for tier in stats.tiers:
            family.add_metric(
                [manager, tier.name, tier.medium],
                histogram_buckets(tier.job_seconds_counts),
                tier.seconds_moved,
            )
    return family


def histogram_buckets(counts: tuple[int, ...]) -> list[tuple[str, float]]:
    """Per-bucket job counts over :data:`JOB_SECONDS_BUCKETS` as Prometheus' cumulative buckets."""
    bounds = [*(repr(float(b)) for b in JOB_SECONDS_BUCKETS), "+Inf"]
    cumulative, running = [], 0
    for bound, count in zip(bounds, counts, strict=True):
        running += count
        cumulative.append((bound, float(running)))
    return cumulative


_default_collector: _Collector | None = None
_default_lock = threading.Lock()


#: One collector per custom registry, so manager names are unique within each registry.
_per_registry: weakref.WeakKeyDictionary[Any, _Collector] = weakref.WeakKeyDictionary()


def _collector_for(registry: Any) -> _Collector:
    """The collector of ``registry`` (registered with it on first use)."""
    with _default_lock:
        collector = _per_registry.get(registry)
        if collector is None:
            collector = _Collector()
            registry.register(collector)
            _per_registry[registry] = collector
        return collector


def _release_collector(registry: Any, collector: _Collector, name: str) -> None:
    """Drop ``name``; unregister the collector once no manager uses it."""
    with _default_lock:
        collector.discard(name)
        if not len(collector) and _per_registry.get(registry) is collector:
            del _per_registry[registry]
            registry.unregister(collector)


def _default() -> _Collector:
    """The process-wide collector, registered once with ``prometheus_client.REGISTRY``."""
    global _default_collector
    with _default_lock:
        if _default_collector is None:
            _default_collector = _Collector()
            assert prometheus_client is not None
            prometheus_client.REGISTRY.register(_default_collector)
        return _default_collector


class MetricsExport:
    """One manager's metrics: publish snapshots, close when the manager shuts down.

    ``registry`` is a ``prometheus_client.CollectorRegistry`` to export to
    (default: the process-wide ``REGISTRY``), or ``False`` to export nothing.
    ``name`` becomes the ``manager`` label; a name already in use in the same
    registry gets a ``-2``, ``-3``... suffix (see :attr:`name`).
    """

    def __init__(self, name: str, registry: Any = None) -> None:
        self.latest: ManagerStats | None = None
        self._collector: _Collector | None = None
        self._own_registry: Any = None
        self.name = name
        if prometheus_client is None or registry is False:
            return
        if registry is None:
            self._collector = _default()
        else:
            self._collector = _collector_for(registry)
            self._own_registry = registry
        self.name = self._collector.add(self, name)

    @property
    def enabled(self) -> bool:
        """Whether snapshots reach a Prometheus registry."""
        return self._collector is not None

    def publish(self, stats: ManagerStats) -> None:
        """Make ``stats`` the snapshot the next scrape reports (any thread, never blocks long)."""
        self.latest = stats  # a single reference swap: scrapes see the old or the new one

    def close(self) -> None:
        """Stop exporting this manager's series (idempotent)."""
        collector, self._collector = self._collector, None
        if collector is None:
            return
        if self._own_registry is not None:
            _release_collector(self._own_registry, collector, self.name)
            self._own_registry = None
        else:
            collector.discard(self.name)
