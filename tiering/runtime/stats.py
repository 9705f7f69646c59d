"""Statistics of one secondary tier: loop-owned counters and the immutable snapshot users see."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from tiering.core.stats import JOB_SECONDS_BUCKETS


def _no_jobs() -> list[int]:
    return [0] * (len(JOB_SECONDS_BUCKETS) + 1)


def count_job_seconds(counts: list[int], seconds: float) -> None:
    """Count one job of ``seconds`` in a histogram over :data:`JOB_SECONDS_BUCKETS`."""
    counts[bisect.bisect_left(JOB_SECONDS_BUCKETS, seconds)] += 1


@dataclass(slots=True)
class TierCounters:
    """Running totals, mutated only on the tier's loop thread (read anywhere)."""

    jobs_succeeded: int = 0
    jobs_failed: int = 0
    blocks_stored: int = 0
    blocks_loaded: int = 0
    bytes_stored: int = 0
    bytes_loaded: int = 0
    store_seconds: float = 0.0
    load_seconds: float = 0.0
    timeouts: int = 0
    corrupt_reads: int = 0
    missing_reads: int = 0
    abandoned_jobs: int = 0
    blocks_removed: int = 0
    events_dropped: int = 0
    #: The tier's ``parts_out_of_service`` after its latest job (a gauge, not a total).
    parts_out_of_service: int = 0
    store_seconds_counts: list[int] = field(default_factory=_no_jobs)
    load_seconds_counts: list[int] = field(default_factory=_no_jobs)


@dataclass(frozen=True, slots=True)
class TierStats:
    """A snapshot of one secondary tier, taken by ``AsyncTierManager.stats()``.

    ``blocks_held`` is what the runtime knows to be in the tier (for a shared
    tier: the blocks known present from this process). ``capacity_blocks`` is
    the tier's own ``capacity_blocks`` attribute when it is an int, else None.
    ``store_seconds``/``load_seconds`` add up each job's transfer time (jobs
    overlap, so they are not wall time). ``timeouts`` counts jobs that missed
    their deadline, ``abandoned_jobs`` those whose tier operation then also
    ignored cancellation for ``cancel_grace_s`` (they end when it does),
    ``corrupt_reads``/``missing_reads`` blocks whose read raised
    ``CorruptBlock``/``BlockNotFound``, ``blocks_removed`` blocks the tier
    reported gone (evictions) or found missing or corrupt.
    ``parts_out_of_service`` is the tier's own gauge of that name (drives of a
    striped fs tier out of service), as of its latest job.
    ``store_seconds_counts``/``load_seconds_counts`` count jobs by transfer
    time, one count per bucket of :data:`tiering.core.stats.JOB_SECONDS_BUCKETS`
    plus one for longer jobs.
    """

    name: str
    tier_type: str
    blocks_held: int
    capacity_blocks: int | None
    jobs_submitted: int
    store_jobs_submitted: int
    load_jobs_submitted: int
    jobs_succeeded: int
    jobs_failed: int
    jobs_in_flight: int
    blocks_stored: int
    blocks_loaded: int
    bytes_stored: int
    bytes_loaded: int
    store_seconds: float
    load_seconds: float
    timeouts: int
    corrupt_reads: int
    missing_reads: int
    abandoned_jobs: int
    blocks_removed: int
    events_dropped: int
    closed: bool
    store_seconds_counts: tuple[int, ...] = (0,) * (len(JOB_SECONDS_BUCKETS) + 1)
    load_seconds_counts: tuple[int, ...] = (0,) * (len(JOB_SECONDS_BUCKETS) + 1)
    parts_out_of_service: int = 0

    @property
    def store_bytes_per_s(self) -> float:
        """Bytes stored per second of store transfer time (0 before any store)."""
        return self.bytes_stored / self.store_seconds if self.store_seconds > 0 else 0.0

    @property
    def load_bytes_per_s(self) -> float:
        """Bytes loaded per second of load transfer time (0 before any load)."""
        return self.bytes_loaded / self.load_seconds if self.load_seconds > 0 else 0.0


def tier_stats(
    counters: TierCounters,
    *,
    name: str,
    tier_type: str,
    blocks_held: int,
    capacity_blocks: int | None,
    store_jobs: int,
    load_jobs: int,
    closed: bool,
) -> TierStats:
    """The snapshot of a tier's counters and of what its scheduler side knows."""
    submitted = store_jobs + load_jobs
    return TierStats(
        name=name,
        tier_type=tier_type,
        blocks_held=blocks_held,
        capacity_blocks=capacity_blocks,
        jobs_submitted=submitted,
        store_jobs_submitted=store_jobs,
        load_jobs_submitted=load_jobs,
        jobs_succeeded=counters.jobs_succeeded,
        jobs_failed=counters.jobs_failed,
        jobs_in_flight=max(0, submitted - counters.jobs_succeeded - counters.jobs_failed),
        blocks_stored=counters.blocks_stored,
        blocks_loaded=counters.blocks_loaded,
        bytes_stored=counters.bytes_stored,
        bytes_loaded=counters.bytes_loaded,
        store_seconds=counters.store_seconds,
        load_seconds=counters.load_seconds,
        timeouts=counters.timeouts,
        corrupt_reads=counters.corrupt_reads,
        missing_reads=counters.missing_reads,
        abandoned_jobs=counters.abandoned_jobs,
        blocks_removed=counters.blocks_removed,
        events_dropped=counters.events_dropped,
        closed=closed,
        store_seconds_counts=tuple(counters.store_seconds_counts),
        load_seconds_counts=tuple(counters.load_seconds_counts),
        parts_out_of_service=counters.parts_out_of_service,
    )
