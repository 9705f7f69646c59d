"""Prometheus series of our secondary tiers when another engine's manager drives them (vLLM).

Inside vLLM, vLLM's own manager runs the lookups and the CPU tier; each of our
tiers it drives is a :class:`~tiering.runtime.AsyncTierManager`. This module
owns the ``kv_tiering_secondary_*`` series of such tiers: a
:class:`SecondaryTierExport` per tier registers it with one process-wide
collector, which reads each live tier's ``stats()`` when Prometheus scrapes
(its counters are plain numbers owned by the tier's loop thread, readable from
any thread). Our own :class:`~tiering.manager.TieringOffloadingManager`
exports its tiers through :mod:`tiering.metrics` instead.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

from tiering.metrics import histogram_buckets, prometheus_client

if prometheus_client is not None:
    from prometheus_client.core import (
        CounterMetricFamily,
        GaugeMetricFamily,
        HistogramMetricFamily,
    )


_SECONDARY_LABELS = ["tier", "type"]

#: (metric name, help, runtime TierStats attribute, is_counter)
_SECONDARY_METRICS: tuple[tuple[str, str, str, bool], ...] = (
    ("kv_tiering_secondary_blocks", "Blocks the tier is known to hold.", "blocks_held", False),
    (
        "kv_tiering_secondary_capacity_blocks",
        "Most blocks the tier can hold (absent when unbounded).",
        "capacity_blocks",
        False,
    ),
    (
        "kv_tiering_secondary_jobs_in_flight",
        "Jobs submitted to the tier without a result yet.",
        "jobs_in_flight",
        False,
    ),
    (
        "kv_tiering_secondary_parts_out_of_service",
        "Parts of the tier (drives of a striped fs tier) out of service now.",
        "parts_out_of_service",
        False,
    ),
    ("kv_tiering_secondary_failed_jobs", "Failed jobs of the tier.", "jobs_failed", True),
    ("kv_tiering_secondary_timeouts", "Jobs that missed their deadline.", "timeouts", True),
    (
        "kv_tiering_secondary_corrupt_reads",
        "Blocks whose read failed verification (served as misses).",
        "corrupt_reads",
        True,
    ),
    (
        "kv_tiering_secondary_missing_reads",
        "Blocks gone when read (served as misses).",
        "missing_reads",
        True,
    ),
    (
        "kv_tiering_secondary_removed_blocks",
        "Blocks the tier reported gone (evictions) or found missing or corrupt.",
        "blocks_removed",
        True,
    ),
)


class _SecondaryCollector:
    """Series of secondary tiers run by the runtime for another engine's manager (vLLM).

    Each scrape asks every live tier's :meth:`~tiering.runtime.AsyncTierManager.stats`,
    whose counters are plain numbers owned by the tier's loop thread and readable anywhere.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()  # guards _tiers against a concurrent scrape
        self._tiers: dict[int, Any] = {}

    def add(self, runtime: Any) -> int:
        with self._lock:
            self._tiers[id(runtime)] = runtime
            return id(runtime)

    def discard(self, handle: int) -> None:
        with self._lock:
            self._tiers.pop(handle, None)

    def describe(self) -> list[Any]:
        return []

    def collect(self) -> Iterator[Any]:
        with self._lock:
            runtimes = list(self._tiers.values())
        snapshots = [runtime.stats() for runtime in runtimes]
        for metric, doc, attribute, is_counter in _SECONDARY_METRICS:
            family = (CounterMetricFamily if is_counter else GaugeMetricFamily)(
                metric, doc, labels=_SECONDARY_LABELS
            )
            for stats in snapshots:
                value = getattr(stats, attribute)
                if value is not None:
                    family.add_metric([stats.name, stats.tier_type], float(value))
            yield family
        for direction in ("stored", "loaded"):
            yield _direction_family(snapshots, direction)
        yield _secondary_job_seconds(snapshots)


def _direction_family(snapshots: list[Any], direction: str) -> Any:
    """Bytes moved in one direction: ``stored`` or ``loaded``."""
    family = CounterMetricFamily(
        f"kv_tiering_secondary_{direction}_bytes",
        f"Bytes {direction} by finished jobs.",
        labels=_SECONDARY_LABELS,
    )
    for stats in snapshots:
        moved = getattr(stats, f"bytes_{direction}")
        family.add_metric([stats.name, stats.tier_type], float(moved))
    return family


def _secondary_job_seconds(snapshots: list[Any]) -> Any:
    family = HistogramMetricFamily(
        "kv_tiering_secondary_job_seconds",
        "Transfer time of finished jobs, by direction (store or load).",
        labels=[*_SECONDARY_LABELS, "direction"],
    )
    for stats in snapshots:
        for direction in ("store", "load"):
            family.add_metric(
                [stats.name, stats.tier_type, direction],
                histogram_buckets(getattr(stats, f"{direction}_seconds_counts")),
                getattr(stats, f"{direction}_seconds"),
            )
    return family


_secondary_collector: _SecondaryCollector | None = None
_lock = threading.Lock()  # guards creating and registering _secondary_collector


class SecondaryTierExport:
    """Exports one runtime tier's series (``kv_tiering_secondary_*``) until :meth:`close`.

    For tiers that another engine's manager drives (vLLM's): our own
    :class:`~tiering.manager.TieringOffloadingManager` exports its tiers itself.
    A no-op without ``prometheus_client``.
    """

    def __init__(self, runtime: Any) -> None:
        global _secondary_collector
        self._handle: int | None = None
        if prometheus_client is None:
            return
        with _lock:
            if _secondary_collector is None:
                _secondary_collector = _SecondaryCollector()
                prometheus_client.REGISTRY.register(_secondary_collector)
            self._handle = _secondary_collector.add(runtime)

    def close(self) -> None:
        """Stop exporting this tier's series (idempotent)."""
        handle, self._handle = self._handle, None
        if handle is not None and _secondary_collector is not None:
            _secondary_collector.discard(handle)
