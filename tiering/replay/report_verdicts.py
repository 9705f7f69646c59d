"""The replay report's sentences: what was replayed, and the verdicts on it.

This module owns the text around :mod:`tiering.replay.report_tables`' tables:
the heading panel (the workload, the stack, the total hit rate against an
unlimited cache's, a warm start, ignored config keys, an interruption) and the
closing verdicts (where the wall time went, the failures, a tier-failure count
over ``--max-tier-failures``, and whether every loaded block held the bytes
stored). Each reads only :func:`~tiering.replay.report.build_report`'s dict.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rich.console import Group
from rich.panel import Panel
from rich.text import Text

from tiering.replay.report_tables import percent
from tiering.replay.units import format_bytes


def heading(report: Mapping[str, Any]) -> Panel:
    """The panel above the tables: what was replayed on what, and the hit rate it got."""
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
                f"root_dir). Total hit rate {percent(hit['total'])} = "
                f"{percent(hit['fraction_of_unlimited'])} of the {percent(hit['unlimited'])} an "
                "unlimited cache starting with the same blocks gets on the same requests "
                f"({percent(warm['unlimited_from_cold'])} from cold).",
                style="yellow",
            )
        )
    else:
        notes.append(
            Text(
                f"Total hit rate {percent(hit['total'])} = {percent(hit['fraction_of_unlimited'])} "
                f"of the {percent(hit['unlimited'])} an unlimited cache gets on the same requests."
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
    return Panel(Group(*notes), title="tiering replay", expand=False)


def verdicts(report: Mapping[str, Any]) -> list[Text]:
    """The lines below the tables, in order: the wall time's split, the failures (or none),
    tier failures over the allowed count, and the byte-for-byte verification."""
    overhead = report["overhead"]
    lines = [
        Text.assemble(
            ("Replay overhead: ", "bold"),
            f"wall {overhead['wall_s']:.2f} s ({overhead['requests_per_s']:,.0f} requests/s, "
            f"{overhead['blocks_per_s']:,.0f} blocks/s) = simulated GPU side "
            f"{overhead['gpu_side_s']:.2f} s ({percent(overhead['gpu_side_fraction'])}) + tier "
            f"work {overhead['tier_work_s'] + overhead['drain_s']:.2f} s "
            f"({percent(overhead['tier_work_fraction'])}; of which promotion waits "
            f"{overhead['promotion_wait_s']:.2f} s, store stalls "
            f"{overhead['store_stall_s']:.2f} s, final drain {overhead['drain_s']:.2f} s) + "
            f"replay bookkeeping {overhead['other_s']:.2f} s.",
        )
    ]
    problems = {k: v for k, v in report["failures"].items() if v}
    if problems:
        lines.append(
            Text(
                "Failures: " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in problems.items()),
                style="yellow",
            )
        )
    else:
        lines.append(Text("Failures: none.", style="green"))
    tier_failures = report.get("tier_failures")
    if tier_failures is not None and tier_failures["exceeded"]:
        lines.append(
            Text(
                f"Tier failures: {tier_failures['count']:,} (failed tier jobs, not counting "
                "routine misses, + tier timeouts + corrupt reads), more than "
                f"--max-tier-failures {tier_failures['max_allowed']:,}: "
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
        lines.append(
            Text(
                f"DATA MISMATCH: {verification['mismatches']} of "
                f"{verification['verified_blocks']:,} loaded blocks did not hold the bytes "
                f"stored: {examples}",
                style="bold red",
            )
        )
    else:
        lines.append(
            Text(
                f"All {verification['verified_blocks']:,} loaded blocks verified byte for byte.",
                style="bold green",
            )
        )
    return lines
