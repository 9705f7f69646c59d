"""The replay report: one JSON-able dict built from the replay's own counts and the
manager's statistics, and its rendering as rich tables.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table
from rich.text import Text

from tiering.replay.metrics import LatencySamples
from tiering.replay.offline import HitRate
from tiering.replay.replayer import (
    CPU,
    GPU,
    PHASE_DRAIN,
    PHASE_GPU,
    PHASE_PROMOTION_WAIT,
    PHASE_STORE_STALL,
    PHASE_TIER,
    ReplayTotals,
)
from tiering.replay.units import format_bytes
from tiering.runtime.stats import TierStats as RuntimeTierStats
from tiering.stats import ManagerStats, TierStats


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


# -- rendering ------------------------------------------------------------------------------


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def _blocks(count: int | None) -> str:
    return "unbounded" if count is None else f"{count:,}"


def _speed(mb_per_s: float | None) -> str:
    return "-" if not mb_per_s else f"{mb_per_s:,.0f}"


def _ms(seconds_in_ms: float) -> str:
    return f"{seconds_in_ms:.2f}"


#: Narrower consoles get fewer columns (and no byte amounts) instead of cut-off cells.
WIDE_CONSOLE = 100


def _add_columns(table: Table, columns: Sequence[str], text_columns: Sequence[str]) -> None:
    """Numbers never wrap or get cut; text columns (names) fold when space is short."""
    for column in columns:
        if column in text_columns:
            table.add_column(column, justify="left", overflow="fold")
        else:
            table.add_column(column, justify="right", no_wrap=True)


def _tier_tables(
    report: Mapping[str, Any], block_bytes: int, *, wide: bool = True
) -> tuple[Table, Table]:
    hit = report["hit_rate"]
    hits = Table(title="Prefix hits by tier (token-weighted)", title_justify="left")
    _add_columns(
        hits, ("tier", "medium", "capacity", "held", "hit rate", "hit blocks"), ("tier", "medium")
    )
    moved = Table(
        title="Blocks moved",
        title_justify="left",
        caption="stored: into the tier (GPU->CPU for cpu, cascades for secondary tiers); "
        "promoted: secondary->CPU; dropped: not stored (a secondary tier behind, "
        "back-pressure; cpu: offloads refused for lack of room); "
        "MB/s: per job, while the tier worked on it",
        caption_justify="left",
    )
    _add_columns(
        moved,
        ("tier", "stored", "promoted", "evicted", "dropped", "failures", "store MB/s", "load MB/s"),
        ("tier",),
    )

    def amount(blocks: int | None) -> str:
        if blocks is None:
            return "-"
        return f"{blocks:,} ({format_bytes(blocks * block_bytes)})" if wide else f"{blocks:,}"

    for tier in report["tiers"]:
        hits.add_row(
            tier["name"],
            tier["medium"],
            _blocks(tier.get("capacity_blocks")),
            f"{tier.get('blocks_held', 0):,}",
            _pct(tier["token_hit_rate"]),
            f"{tier['hit_blocks']:,}",
        )
        moved.add_row(
            tier["name"],
            amount(tier.get("stored_blocks")),
            amount(tier.get("promoted_blocks")),
            f"{tier.get('evicted_blocks', 0):,}",
            f"{tier.get('dropped_blocks', 0):,}",
            str(tier.get("failures", "-")),
            _speed(tier.get("store_mb_per_s_per_job")),
            _speed(tier.get("load_mb_per_s_per_job")),
        )
    hits.add_section()
    hits.add_row(
        "total", "", "", "", Text(_pct(hit["total"]), style="bold"), f"{report['blocks']['hit']:,}"
    )
    hits.add_row("unlimited", "offline reference", "unbounded", "", _pct(hit["unlimited"]), "")
    return hits, moved


_OPERATIONS = {
    "store_gpu_to_cpu": "store GPU->CPU",
    "load_cpu_to_gpu": "load CPU->GPU",
    "promotion_wait": "promotion wait",
    "store_stall": "store stall",
}


_LATENCY_COLUMNS = (
    "operation",
    "calls",
    "blocks",
    "p50 ms",
    "p90 ms",
    "p99 ms",
    "max ms",
    "blocks/s",
    "MB/s",
)
#: Left out on a narrow console (p50, p99 and max still bound the distribution).
_NARROW_DROPS = ("p90 ms", "blocks/s")


def _latency_table(report: Mapping[str, Any], *, wide: bool = True) -> Table:
    table = Table(
        title="Transfers as the scheduler sees them (per request)",
        title_justify="left",
        caption="store = prepare_store + copy + complete_store (per prefill chunk); load = "
        "prepare_load + byte verification + complete_load; promotion wait = first 'retry "
        "later' until every promoted block landed; store stall = a refused store waiting for "
        "in-flight cascades to free primary blocks",
        caption_justify="left",
    )
    columns = [c for c in _LATENCY_COLUMNS if wide or c not in _NARROW_DROPS]
    for column in columns:
        if column == "operation":
            table.add_column(column, justify="left", no_wrap=True, min_width=14)
        else:
            table.add_column(column, justify="right", no_wrap=True)
    for key, label in _OPERATIONS.items():
        row = report["latency"][key]
        cells = {
            "operation": label,
            "calls": f"{row['count']:,}",
            "blocks": f"{row['blocks']:,}",
            "p50 ms": _ms(row["p50_ms"]),
            "p90 ms": _ms(row["p90_ms"]),
            "p99 ms": _ms(row["p99_ms"]),
            "max ms": _ms(row["max_ms"]),
            "blocks/s": f"{row['blocks_per_s']:,.0f}",
            "MB/s": f"{row['mb_per_s']:,.0f}",
        }
        table.add_row(*(cells[c] for c in columns))
    return table


def render_report(report: Mapping[str, Any], console: Console) -> None:
    """Print the report as rich tables."""
    trace = report["trace"]
    setup = report["setup"]
    hit = report["hit_rate"]
    block_bytes = int(setup["block_bytes"])

    notes = [
        Text(
            f"{trace['name']}: {trace['requests_replayed']:,} of {trace['requests']:,} requests, "
            f"{report['tokens']['total']:,} prompt tokens, {trace['footprint_blocks']:,} "
            f"distinct blocks of {trace['block_tokens']} tokens ({format_bytes(block_bytes)} each)",
            style="bold",
        ),
        Text(
            f"GPU prefix cache {setup['gpu_blocks']:,} blocks; CPU primary "
            f"{format_bytes(setup['cpu_bytes_to_use'])} ({setup['eviction_policy']}); secondary: "
            + (", ".join(setup["secondary_summary"]) or "none")
        ),
    ]
    warm = setup.get("warm_start") or {}
    if warm.get("blocks_held"):
        notes.append(
            Text(
                f"The cache started warm: the secondary tiers held {warm['blocks_held']:,} "
                f"blocks, {warm['workload_blocks_held']:,} of them this workload's (a persistent "
                f"root_dir). Total hit rate {_pct(hit['total'])} = "
                f"{_pct(hit['fraction_of_unlimited'])} of the {_pct(hit['unlimited'])} an "
                "unlimited cache starting with the same blocks gets on the same requests "
                f"({_pct(warm['unlimited_from_cold'])} from cold).",
                style="yellow",
            )
        )
    else:
        notes.append(
            Text(
                f"Total hit rate {_pct(hit['total'])} = {_pct(hit['fraction_of_unlimited'])} of "
                f"the {_pct(hit['unlimited'])} an unlimited cache gets on the same requests."
            )
        )
    if setup.get("ignored_config_keys"):
        notes.append(
            Text(
                "Ignored config keys (blocks are the trace's): "
                + ", ".join(setup["ignored_config_keys"]),
                style="dim",
            )
        )
    if report["interrupted"]:
        by = f" by {report['stopped_by']}" if report.get("stopped_by") else ""
        notes.append(
            Text(
                f"Interrupted{by}: partial report of the requests replayed so far.",
                style="bold yellow",
            )
        )
    console.print(Panel(Group(*notes), title="tiering replay", expand=False))
    wide = console.width >= WIDE_CONSOLE
    hits_table, moved_table = _tier_tables(report, block_bytes, wide=wide)
    console.print(hits_table)
    console.print(moved_table)
    console.print(_latency_table(report, wide=wide))

    overhead = report["overhead"]
    console.print(
        Text.assemble(
            ("Replay overhead: ", "bold"),
            f"wall {overhead['wall_s']:.2f} s ({overhead['requests_per_s']:,.0f} requests/s, "
            f"{overhead['blocks_per_s']:,.0f} blocks/s) = simulated GPU side "
            f"{overhead['gpu_side_s']:.2f} s ({_pct(overhead['gpu_side_fraction'])}) + tier work "
            f"{overhead['tier_work_s'] + overhead['drain_s']:.2f} s "
            f"({_pct(overhead['tier_work_fraction'])}; of which promotion waits "
            f"{overhead['promotion_wait_s']:.2f} s, store stalls "
            f"{overhead['store_stall_s']:.2f} s, final drain {overhead['drain_s']:.2f} s) + "
            f"replay bookkeeping {overhead['other_s']:.2f} s.",
        )
    )
    problems = {k: v for k, v in report["failures"].items() if v}
    if problems:
        console.print(
            Text(
                "Failures: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in problems.items()),
                style="yellow",
            )
        )
    else:
        console.print(Text("Failures: none.", style="green"))
    tier_failures = report.get("tier_failures")
    if tier_failures is not None and tier_failures["exceeded"]:
        console.print(
            Text(
                f"Tier failures: {tier_failures['count']:,} (failed tier jobs + missing reads + "
                f"tier timeouts), more than --max-tier-failures {tier_failures['max_allowed']:,}: "
                f"exit status {report.get('exit_status', 3)}.",
                style="bold yellow",
            )
        )
    verification = report["verification"]
    if verification["mismatches"]:
        examples = ", ".join(
            f"block {e['hash_id']} from {e['source']} (request {e['request']})"
            for e in verification["examples"]
        )
        console.print(
            Text(
                f"DATA MISMATCH: {verification['mismatches']} of "
                f"{verification['verified_blocks']:,} loaded blocks did not hold the bytes "
                f"stored: {examples}",
                style="bold red",
            )
        )
    else:
        console.print(
            Text(
                f"All {verification['verified_blocks']:,} loaded blocks verified byte for byte.",
                style="bold green",
            )
        )
