"""Statistics: transfer accounting, what the tiers hold, and the ``ManagerStats`` snapshot.

Counters (:class:`~tiering.core.stats.TierCounters`) are updated by every layer as
jobs finish; this layer turns them and the tiers' holdings into the immutable
snapshot :meth:`~tiering.manager.TieringOffloadingManager.stats` returns and the
metrics export publishes.
"""

from __future__ import annotations

from dataclasses import dataclass

from tiering.core.jobs import JobResult, SecondaryTierManager
from tiering.core.stats import ManagerStats, TierCounters, TierStats
from tiering.manager.state import Job, ManagerState


class StatisticsMixin(ManagerState):
    """Transfer accounting and snapshots."""

    def stats(self) -> ManagerStats:
        """An immutable snapshot: the primary tier first, then each secondary tier.

        After :meth:`shutdown`, the snapshot taken when the tiers were drained.
        """
        if self._final_stats is not None:
            return self._final_stats
        return self._snapshot()

    def publish_metrics(self) -> None:
        """Publish a fresh snapshot to Prometheus now (``step`` does it about once a second)."""
        self._metrics.publish(self.stats())

    def _count_transfer(
        self, counters: TierCounters, job: Job, result: JobResult, blocks: int
    ) -> None:
        nbytes = result.transfer_bytes or blocks * self._block_bytes
        seconds = result.transfer_time or max(0.0, self._clock() - job.submitted_at)
        counters.add_transfer(nbytes, seconds)
        self._primary_counters.add_transfer(nbytes, seconds)

    def _snapshot(self) -> ManagerStats:
        return self._stats_from(self._holdings())

    def _holdings(self) -> Holdings:
        primary = self._primary
        held: list[int | None] = []
        capacities: list[int | None] = []
        parts_out: list[int] = []
        for tier in self._tiers:
            blocks, capacity, out = tier_holdings(tier)
            held.append(blocks)
            capacities.append(capacity)
            parts_out.append(out)
        return Holdings(
            primary_ready=primary.num_ready(),
            primary_pinned=primary.num_pinned(),
            tier_blocks=held,
            tier_capacities=capacities,
            tier_parts_out_of_service=parts_out,
        )

    def _stats_from(self, holdings: Holdings) -> ManagerStats:
        tiers: list[TierStats] = [
            self._primary_counters.snapshot(
                blocks_held=holdings.primary_ready, capacity_blocks=self._primary.num_blocks
            )
        ]
        for counters, held, capacity, out in zip(
            self._tier_counters,
            holdings.tier_blocks,
            holdings.tier_capacities,
            holdings.tier_parts_out_of_service,
            strict=True,
        ):
            tiers.append(
                counters.snapshot(
                    blocks_held=held or 0, capacity_blocks=capacity, parts_out_of_service=out
                )
            )
        oldest = next(iter(self._jobs.values()), None)
        return ManagerStats(
            tiers=tuple(tiers),
            lookups=self._lookups,
            retries=self._retries,
            promotion_no_room=self._no_room,
            backoff_keys=len(self._backoff),
            pinned_blocks=holdings.primary_pinned,
            staged_promotions=self._num_staged,
            unexpected_results=self._unexpected_results,
            internal_errors=self._internal_errors,
            oldest_job_age_s=0.0 if oldest is None else self._clock() - oldest.submitted_at,
            closed=self._closed,
        )


@dataclass(frozen=True, slots=True)
class Holdings:
    """What the tiers hold at one moment (read before they shut down)."""

    primary_ready: int
    primary_pinned: int
    tier_blocks: list[int | None]
    tier_capacities: list[int | None]
    tier_parts_out_of_service: list[int]

    @classmethod
    def unknown(cls, num_tiers: int) -> Holdings:
        return cls(0, 0, [None] * num_tiers, [None] * num_tiers, [0] * num_tiers)


def tier_holdings(tier: SecondaryTierManager) -> tuple[int | None, int | None, int]:
    """Blocks held, capacity and parts out of service of a tier, from its ``stats()`` snapshot."""
    try:
        stats = getattr(tier, "stats", None)
        snapshot = stats() if callable(stats) else None
        held = getattr(snapshot, "blocks_held", None)
        if not isinstance(held, int):
            held = tier.get_num_blocks()
        capacity = getattr(snapshot, "capacity_blocks", getattr(tier, "capacity_blocks", None))
        out = getattr(snapshot, "parts_out_of_service", 0)
    except Exception:
        return None, None, 0
    return held, capacity if isinstance(capacity, int) else None, out if isinstance(out, int) else 0
