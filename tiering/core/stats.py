"""Statistics of the tiering manager: mutable counters owned by the scheduler thread,
immutable snapshots for everyone else.

The manager bumps :class:`TierCounters` on the scheduler thread; ``stats()``
turns them into frozen :class:`TierStats` / :class:`ManagerStats` objects that
can be handed to any thread (a metrics exporter, a log line, a test).
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

#: Upper bounds (seconds) of the job-duration histogram buckets; a last bucket takes the rest.
JOB_SECONDS_BUCKETS: tuple[float, ...] = (
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class TierStats:
    """One tier's figures at one moment.

    For the CPU primary tier: ``hits``/``misses`` are lookups the whole stack
    answered True/False, ``promotions`` blocks promoted into it, ``cascades``
    blocks stored into it from the GPU, ``evictions`` blocks it dropped to
    make room. For a secondary tier: ``hits`` are lookups it answered
    present (a promotion was started), ``misses`` lookups it answered absent,
    ``promotions`` blocks promoted out of it, ``cascades`` blocks stored into
    it. ``failures`` counts failed jobs (and, for the primary, failed stores
    from the GPU); ``routine_failures`` those of them that failed only because
    blocks had left the tier since the lookup (normal for bounded and shared
    tiers). ``bytes_moved``/``seconds_moved`` add up finished jobs
    (successful blocks only); ``jobs_in_flight`` are jobs without a result yet.
    ``job_seconds_counts`` counts those finished jobs by duration, one count per
    bucket of :data:`JOB_SECONDS_BUCKETS` plus a last one for longer jobs.
    ``parts_out_of_service`` is how many parts of a secondary tier made of parts
    (the drives of a striped fs tier) are out of service now.
    ``dropped`` counts blocks not stored: for a secondary tier, cascades dropped
    because the tier was behind (back-pressure: its in-flight cascades already pinned
    its share of the primary tier); for the primary tier, blocks of offloads that
    ``prepare_store`` refused because no primary block could be freed.
    """

    name: str
    medium: str
    blocks_held: int
    capacity_blocks: int | None
    hits: int
    misses: int
    promotions: int
    cascades: int
    evictions: int
    failures: int
    bytes_moved: int
    seconds_moved: float
    jobs_in_flight: int
    routine_failures: int = 0
    job_seconds_counts: tuple[int, ...] = (0,) * (len(JOB_SECONDS_BUCKETS) + 1)
    dropped: int = 0
    parts_out_of_service: int = 0


@dataclass(frozen=True, slots=True)
class ManagerStats:
    """The whole stack at one moment: the primary tier first, then each secondary tier.

    ``retries`` are lookups answered None (retry later); ``promotion_no_room``
    lookups that found a block in a secondary tier but could not reserve a
    primary block (answered False); ``backoff_keys`` keys whose promotion
    failed recently and are answered False until their back-off expires;
    ``pinned_blocks`` primary blocks pinned right now (by the engine, by
    cascades and by promotions); ``unexpected_results`` results for unknown
    job ids or from the wrong tier (always 0 unless a tier misbehaves);
    ``internal_errors`` exceptions caught while handling results or talking
    to a tier; ``oldest_job_age_s`` the age of the oldest job in flight.
    """

    tiers: tuple[TierStats, ...]
    lookups: int
    retries: int
    promotion_no_room: int
    backoff_keys: int
    pinned_blocks: int
    staged_promotions: int
    unexpected_results: int
    internal_errors: int
    oldest_job_age_s: float
    closed: bool

    @property
    def primary(self) -> TierStats:
        """The CPU primary tier's figures."""
        return self.tiers[0]

    @property
    def secondary(self) -> tuple[TierStats, ...]:
        """The secondary tiers' figures, in lookup order."""
        return self.tiers[1:]

    def tier(self, name: str) -> TierStats:
        """The figures of the tier called ``name`` (raises ``KeyError`` if none)."""
        for tier in self.tiers:
            if tier.name == name:
                return tier
        raise KeyError(f"no tier named {name!r}; tiers: {[t.name for t in self.tiers]}")

    @property
    def jobs_in_flight(self) -> int:
        """Secondary-tier jobs without a result, all tiers together."""
        return sum(t.jobs_in_flight for t in self.secondary)


class TierCounters:
    """Mutable counters of one tier; only the scheduler thread touches them."""

    __slots__ = (
        "bytes_moved",
        "cascades",
        "dropped",
        "evictions",
        "failures",
        "hits",
        "job_seconds_counts",
        "jobs_in_flight",
        "medium",
        "misses",
        "name",
        "promotions",
        "routine_failures",
        "seconds_moved",
    )

    def __init__(self, name: str, medium: str) -> None:
        self.name = name
        self.medium = medium
        self.hits = 0
        self.misses = 0
        self.promotions = 0
        self.cascades = 0
        self.evictions = 0
        self.failures = 0
        self.routine_failures = 0
        self.bytes_moved = 0
        self.seconds_moved = 0.0
        self.jobs_in_flight = 0
        self.dropped = 0
        self.job_seconds_counts = [0] * (len(JOB_SECONDS_BUCKETS) + 1)

    def add_transfer(self, nbytes: int, seconds: float) -> None:
        """Count one finished job that moved ``nbytes`` in ``seconds``."""
        self.bytes_moved += nbytes
        self.seconds_moved += seconds
        self.job_seconds_counts[bisect.bisect_left(JOB_SECONDS_BUCKETS, seconds)] += 1

    def snapshot(
        self, *, blocks_held: int, capacity_blocks: int | None, parts_out_of_service: int = 0
    ) -> TierStats:
        return TierStats(
            name=self.name,
            medium=self.medium,
            blocks_held=blocks_held,
            capacity_blocks=capacity_blocks,
            hits=self.hits,
            misses=self.misses,
            promotions=self.promotions,
            cascades=self.cascades,
            evictions=self.evictions,
            failures=self.failures,
            bytes_moved=self.bytes_moved,
            seconds_moved=self.seconds_moved,
            jobs_in_flight=self.jobs_in_flight,
            routine_failures=self.routine_failures,
            job_seconds_counts=tuple(self.job_seconds_counts),
            dropped=self.dropped,
            parts_out_of_service=parts_out_of_service,
        )
