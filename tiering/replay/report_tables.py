"""The replay report's tables: prefix hits and blocks moved by tier, and transfer latencies.

This module owns how :func:`~tiering.replay.report.build_report`'s dict is laid out
as rich tables: their columns, captions and cell formats, and which columns a
console narrower than :data:`WIDE_CONSOLE` leaves out (it gets fewer columns, and
no byte amounts, instead of cut-off cells). The sentences around the tables are
in :mod:`tiering.replay.report_verdicts`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.table import Table
from rich.text import Text

from tiering.replay.units import format_bytes


def percent(value: float) -> str:
    """A rate (0..1) as a percentage with one decimal, as every part of the report shows it."""
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


def tier_tables(
    report: Mapping[str, Any], block_bytes: int, *, wide: bool = True
) -> tuple[Table, Table]:
    """The prefix hits by tier (with the total and the unlimited reference) and the blocks
    moved by tier; ``wide`` shows byte amounts next to block counts."""
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
            percent(tier["token_hit_rate"]),
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
    total = Text(percent(hit["total"]), style="bold")
    hits.add_row("total", "", "", "", total, f"{report['blocks']['hit']:,}")
    hits.add_row("unlimited", "offline reference", "unbounded", "", percent(hit["unlimited"]), "")
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


def latency_table(report: Mapping[str, Any], *, wide: bool = True) -> Table:
    """The scheduler's view of each transfer: calls, blocks, percentiles and throughput
    (without p90 and blocks/s unless ``wide``)."""
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
