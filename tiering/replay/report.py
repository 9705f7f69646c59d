"""The replay report: one JSON-able dict built from the replay's own counts and the
manager's statistics, and its rendering as rich tables.

This module owns the report's data: :func:`build_report` (what ``--json`` prints:
hit rates by place, blocks moved, per-tier figures, latencies, failures,
verification and where the wall time went). :func:`render_report` prints that
dict: the tables are laid out in :mod:`tiering.replay.report_tables`, the heading
and the verdicts around them in :mod:`tiering.replay.report_verdicts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console

from tiering.core.stats import ManagerStats, TierStats
from tiering.replay.metrics import LatencySamples
from tiering.replay.offline import HitRate
from tiering.replay.report_tables import WIDE_CONSOLE, latency_table, tier_tables
from tiering.replay.report_verdicts import heading, verdicts
from tiering.replay.totals import (
    CPU,
    GPU,
    PHASE_DRAIN,
    PHASE_GPU,
    PHASE_PROMOTION_WAIT,
    PHASE_STORE_STALL,
    PHASE_TIER,
    ReplayTotals,
)
from tiering.runtime.stats import TierStats as RuntimeTierStats


def _rate(part: float, whole: float) -> float:
    return part / whole if whole > 0 else 0.0


def _throughput(blocks: int, block_bytes: int, seconds: float) -> dict[str, float]:
    return {
        "blocks_per_s": blocks / seconds if seconds > 0 else 0.0,
        "mb_per_s": blocks * block_bytes / seconds / 1e6 if seconds > 0 else 0.0,
    }


def _latency(samples: LatencySamples, blocks: int, block_bytes: int) -> dict[str, Any]:
    summary = samples.summary()
    return {
        **summary.to_json(),
        "blocks": blocks,
        "bytes": blocks * block_bytes,
        **_throughput(blocks, block_bytes, summary.total_s),
    }


def _runtime_json(runtime: RuntimeTierStats) -> dict[str, Any]:
    """The facade's own view of a secondary tier: evictions, per-direction speed, faults."""
    return {
        "evicted_blocks": runtime.blocks_removed,
        "store_mb_per_s_per_job": runtime.store_bytes_per_s / 1e6,
        "load_mb_per_s_per_job": runtime.load_bytes_per_s / 1e6,
        "runtime": {
            "jobs_submitted": runtime.jobs_submitted,
            "jobs_failed": runtime.jobs_failed,
            "blocks_stored": runtime.blocks_stored,
            "blocks_loaded": runtime.blocks_loaded,
            "store_seconds": runtime.store_seconds,
            "load_seconds": runtime.load_seconds,
            "timeouts": runtime.timeouts,
            "corrupt_reads": runtime.corrupt_reads,
            "missing_reads": runtime.missing_reads,
            "abandoned_jobs": runtime.abandoned_jobs,
            "blocks_removed": runtime.blocks_removed,
        },
    }


def _tier_stats_json(stats: TierStats, block_bytes: int) -> dict[str, Any]:
    return {
        "capacity_blocks": stats.capacity_blocks,
        "blocks_held": stats.blocks_held,
        "stored_blocks": stats.cascades,
        "stored_bytes": stats.cascades * block_bytes,
        "promoted_blocks": stats.promotions,
        "promoted_bytes": stats.promotions * block_bytes,
        "evicted_blocks": stats.evictions,
        "dropped_blocks": stats.dropped,
        "failures": stats.failures,
        "lookup_hits": stats.hits,
        "lookup_misses": stats.misses,
        "bytes_moved": stats.bytes_moved,
        "seconds_moved": stats.seconds_moved,
        "per_job_mb_per_s": (
            stats.bytes_moved / stats.seconds_moved / 1e6 if stats.seconds_moved > 0 else 0.0
        ),
        "jobs_in_flight": stats.jobs_in_flight,
    }


def build_report(
    *,
    totals: ReplayTotals,
    stats: ManagerStats,
    unlimited: HitRate,
    trace_name: str,
    footprint_blocks: int,
    block_tokens: int,
    block_bytes: int,
    gpu_blocks: int,
    gpu_evictions: int,
    gpu_held: int,
    setup: Mapping[str, Any],
    secondary_names: Sequence[str],
    runtime_stats: Sequence[RuntimeTierStats | None] = (),
    configured_capacities: Sequence[int | None] = (),
) -> dict[str, Any]:
    """The whole report as plain data (what ``--json`` prints).

    ``runtime_stats`` are the secondary tiers' own snapshots (from the async
    facade), where available, in the order of ``secondary_names``;
    ``configured_capacities`` the capacities their configs give, shown where a
    tier does not report its own.
    """
    total_tokens = totals.total_tokens
    hit_tokens = sum(tally.tokens for tally in totals.hits.values())
    hit_blocks = sum(tally.blocks for tally in totals.hits.values())

    def place(name: str) -> dict[str, Any]:
        tally = totals.hit(name)
        return {
            "hit_tokens": tally.tokens,
            "hit_blocks": tally.blocks,
            "token_hit_rate": _rate(tally.tokens, total_tokens),
        }

    tiers: list[dict[str, Any]] = [
        {
            "name": GPU,
            "medium": "GPU (simulated)",
            **place(GPU),
            "capacity_blocks": gpu_blocks,
            "blocks_held": gpu_held,
            "evicted_blocks": gpu_evictions,
        },
        {
            "name": CPU,
            "medium": stats.primary.medium,
            **place(CPU),
            **_tier_stats_json(stats.primary, block_bytes),
            # A refused store the replay retried (and stored, or refused once more) is
            # counted once, as the blocks the engine kept on the GPU only.
            "dropped_blocks": stats.primary.dropped - totals.retried_refusal_blocks,
            "loaded_to_gpu_blocks": totals.blocks_loaded,
            "loaded_to_gpu_bytes": totals.blocks_loaded * block_bytes,
        },
    ]
    runtimes = list(runtime_stats) or [None] * len(secondary_names)
    capacities = list(configured_capacities) or [None] * len(secondary_names)
    for name, tier_stats, runtime, capacity in zip(
        secondary_names, stats.secondary, runtimes, capacities, strict=True
    ):
        row = {
            "name": name,
            "medium": tier_stats.medium,
            **place(name),
            **_tier_stats_json(tier_stats, block_bytes),
            **(_runtime_json(runtime) if runtime is not None else {}),
        }
        if row["capacity_blocks"] is None:
            row["capacity_blocks"] = capacity
        tiers.append(row)

    clock = totals.clock
    gpu_side = clock.get(PHASE_GPU)
    tier_work = clock.get(PHASE_TIER)
    drain = clock.get(PHASE_DRAIN)
    other = max(0.0, totals.wall_s - gpu_side - tier_work - drain)
    tier_failures = sum(t.failures for t in stats.tiers)
    present = [r for r in runtimes if r is not None]
    failures = {
        "verification_mismatches": totals.mismatches,
        "tier_job_failures": tier_failures,
        # failed only because blocks left a bounded or shared tier since the lookup
        "routine_job_failures": sum(t.routine_failures for t in stats.tiers),
        "promotion_timeouts": totals.promotion_timeouts,
        "store_rejected_blocks": totals.store_rejected_blocks,
        "lost_before_load": totals.lost_before_load,
        "load_errors": totals.load_errors,
        "tier_timeouts": sum(r.timeouts for r in present),
        "corrupt_reads": sum(r.corrupt_reads for r in present),
        "missing_reads": sum(r.missing_reads for r in present),
        "promotion_no_room": stats.promotion_no_room,
        "internal_errors": stats.internal_errors,
        "unexpected_results": stats.unexpected_results,
        "jobs_left_in_flight": stats.jobs_in_flight,
    }
    unlimited_rate = unlimited.token_hit_rate
    total_rate = _rate(hit_tokens, total_tokens)
    return {
        "ok": totals.mismatches == 0 and not totals.interrupted,
        "interrupted": totals.interrupted,
        "trace": {
            "name": trace_name,
            "requests": totals.requests_total,
            "requests_replayed": totals.requests_done,
            "block_tokens": block_tokens,
            "footprint_blocks": footprint_blocks,
            "footprint_bytes": footprint_blocks * block_bytes,
        },
        "setup": dict(setup),
        "hit_rate": {
            "total": total_rate,
            "gpu": _rate(totals.hit(GPU).tokens, total_tokens),
            "cpu": _rate(totals.hit(CPU).tokens, total_tokens),
            "secondary": {
                name: _rate(totals.hit(name).tokens, total_tokens) for name in secondary_names
            },
            "unlimited": unlimited_rate,
            "fraction_of_unlimited": total_rate / unlimited_rate if unlimited_rate else 0.0,
            "total_blocks": _rate(hit_blocks, totals.total_blocks),
            "unlimited_blocks": unlimited.block_hit_rate,
        },
        "tokens": {"total": total_tokens, "hit": hit_tokens, "miss": total_tokens - hit_tokens},
        "blocks": {
            "total": totals.total_blocks,
            "hit": hit_blocks,
            "stored_gpu_to_cpu": totals.blocks_stored,
            "loaded_cpu_to_gpu": totals.blocks_loaded,
            "promoted_and_loaded": totals.blocks_promoted_used,
            "verified": totals.verified_blocks,
        },
        "tiers": tiers,
        "latency": {
            "store_gpu_to_cpu": _latency(totals.store_latency, totals.blocks_stored, block_bytes),
            "load_cpu_to_gpu": _latency(totals.load_latency, totals.blocks_loaded, block_bytes),
            "promotion_wait": _latency(
                totals.promotion_latency, totals.blocks_promoted_used, block_bytes
            ),
            "store_stall": _latency(totals.store_stalls, 0, block_bytes),
        },
        "failures": failures,
        "verification": {
            "verified_blocks": totals.verified_blocks,
            "mismatches": totals.mismatches,
            "examples": [
                {"request": m.request_index, "hash_id": m.hash_id, "source": m.source}
                for m in totals.mismatch_examples
            ],
        },
        "overhead": {
            "wall_s": totals.wall_s,
            "gpu_side_s": gpu_side,
            "tier_work_s": tier_work,
            "promotion_wait_s": clock.get(PHASE_PROMOTION_WAIT),
            "store_stall_s": clock.get(PHASE_STORE_STALL),
            "drain_s": drain,
            "drained": totals.drained,
            "other_s": other,
            "gpu_side_fraction": _rate(gpu_side, totals.wall_s),
            "tier_work_fraction": _rate(tier_work + drain, totals.wall_s),
            "requests_per_s": _rate(totals.requests_done, totals.wall_s),
            "blocks_per_s": _rate(totals.total_blocks, totals.wall_s),
        },
    }


def render_report(report: Mapping[str, Any], console: Console) -> None:
    """Print the report as rich tables."""
    console.print(heading(report))
    wide = console.width >= WIDE_CONSOLE
    hits_table, moved_table = tier_tables(report, int(report["setup"]["block_bytes"]), wide=wide)
    console.print(hits_table)
    console.print(moved_table)
    console.print(latency_table(report, wide=wide))
    for line in verdicts(report):
        console.print(line)
