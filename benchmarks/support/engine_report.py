"""The table ``benchmarks/engine_step.py`` prints: one pair of rows per tier or control.

Owns :class:`TierRow` (a row's alone and busy phases and the tier's throughput and
CPU cost) and :func:`report`: ``schedule()`` p50/p99 against the alone rounds of the
same row with the targets met or missed, the whole step's wall time, wake latency,
GC steps, the scheduler thread's CPU ratio and stalls, the alone rounds' A/A (the
noise floor of the run) and the paired per-round ratio, then the notes.
"""

from __future__ import annotations

import argparse
import statistics
from dataclasses import dataclass, field

from benchmarks.support.common import pct, print_markdown_table
from benchmarks.support.scheduler import P50_TARGET, P99_TARGET, RUSAGE_THREAD, Phase


@dataclass
class TierRow:
    tier: str
    description: str
    placement: str = "thread"
    skipped: str = ""
    alone: Phase = field(default_factory=Phase)
    busy: Phase = field(default_factory=Phase)
    blocks_per_s: float = 0.0
    loop_cpu_us_per_block: float = 0.0
    #: The loop thread's involuntary context switches per second beside the steps
    #: (None: not measured, e.g. a tier in a child process).
    loop_preemptions_per_s: float | None = None
    failures: int = 0


def _wall(phase: Phase) -> str:
    return f"{pct(phase.step_s, 50) * 1e6:.0f} / {pct(phase.step_s, 99) * 1e6:.0f}"


def _wake(phase: Phase) -> str:
    if not phase.wake_s:
        return "-"
    return f"{pct(phase.wake_s, 50) * 1e6:.0f} / {pct(phase.wake_s, 99) * 1e6:.0f}"


def _share(steps: int, phase: Phase) -> str:
    return f"{steps / len(phase.schedule_s):.1%}" if phase.schedule_s else "-"


def _cpu_ratio(busy: Phase, alone: Phase) -> str:
    if not alone.cpu_s or not busy.cpu_s:
        return "-"
    ratios = [(pct(busy.cpu_s, q), pct(alone.cpu_s, q)) for q in (50, 99)]
    return " / ".join(f"{b / a:.2f}x" if a else "-" for b, a in ratios)


def _alone_spread(alone: Phase) -> tuple[float, float] | None:
    """How far apart identical steps measure: the alone rounds' even half against their odd
    half, p50 and p99, each as the larger over the smaller (None under 2 rounds)."""
    even, odd = alone.alternate_rounds()
    if not even or not odd:
        return None
    spread = []
    for q in (50, 99):
        low, high = sorted((pct(even, q), pct(odd, q)))
        spread.append(high / low if low else float("inf"))
    return spread[0], spread[1]


def _paired_p50(later: list[list[float]], earlier: list[list[float]]) -> str:
    """The median over rounds of each round's p50 over the p50 of the round just before it.

    Rounds seconds apart see the same machine, so a drift slower than a round (another
    guest's burst) cancels out of each pair; pooled percentiles keep it.
    """
    medians = [(pct(a, 50), pct(b, 50)) for a, b in zip(earlier, later, strict=False) if a and b]
    ratios = [b / a for a, b in medians if a > 0]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def _spread_cell(alone: Phase) -> str:
    spread = _alone_spread(alone)
    return "-" if spread is None else f"{spread[0]:.2f}x / {spread[1]:.2f}x"


def _stalls(phase: Phase) -> str:
    if RUSAGE_THREAD is None:
        return "-"
    return f"{_share(phase.waited_steps, phase)} / {_share(phase.preempted_steps, phase)}"


def report(rows: list[TierRow], args: argparse.Namespace) -> None:
    header = (
        "tier",
        "schedule p50 us",
        "p50 ratio",
        "schedule p99 us",
        "p99 ratio",
        "step wall p50/p99 us",
        "wake p50/p99 us",
        "blocks/s",
        "tier CPU us/block",
        "GC steps",
        "step CPU p50/p99",
        "waited / preempted",
        "alone A/A p50/p99",
        "paired p50 ratio",
        f"p50 <= {P50_TARGET:.2f}x",
        f"p99 <= {P99_TARGET:.2f}x",
    )
    lines: list[tuple[str, ...]] = []
    notes: list[str] = []
    for row in rows:
        if row.skipped:
            notes.append(f"- {row.tier}: skipped: {row.skipped}")
            continue
        control = row.placement == "control"
        a50, a99 = pct(row.alone.schedule_s, 50), pct(row.alone.schedule_s, 99)
        b50, b99 = pct(row.busy.schedule_s, 50), pct(row.busy.schedule_s, 99)
        r50, r99 = b50 / a50, b99 / a99
        lines.append(
            (
                f"steps alone ({row.tier} rounds)",
                f"{a50 * 1e6:.0f}",
                "1.00x",
                f"{a99 * 1e6:.0f}",
                "1.00x",
                _wall(row.alone),
                _wake(row.alone),
                "-",
                "-",
                _share(row.alone.gc_steps, row.alone),
                "1.00x / 1.00x",
                _stalls(row.alone),
                _spread_cell(row.alone),
                _paired_p50(row.alone.rounds()[1:], row.alone.rounds()[:-1]),
                "",
                "",
            )
        )
        lines.append(
            (
                row.tier,
                f"{b50 * 1e6:.0f}",
                f"{r50:.2f}x",
                f"{b99 * 1e6:.0f}",
                f"{r99:.2f}x",
                _wall(row.busy),
                _wake(row.busy),
                "-" if control else f"{row.blocks_per_s:,.0f}",
                "-" if control else f"{row.loop_cpu_us_per_block:.1f}",
                _share(row.busy.gc_steps, row.busy),
                _cpu_ratio(row.busy, row.alone),
                _stalls(row.busy),
                "",
                _paired_p50(row.busy.rounds(), row.alone.rounds()),
                "met" if r50 <= P50_TARGET else "missed",
                "met" if r99 <= P99_TARGET else "missed",
            )
        )
        if control:
            notes.append(
                f"- {row.tier}: {row.description}; {len(row.busy.schedule_s)} steps beside it, "
                f"{len(row.alone.schedule_s)} alone"
            )
            continue
        preempted = (
            ""
            if row.loop_preemptions_per_s is None
            else f"; loop thread preempted {row.loop_preemptions_per_s:,.0f} times/s"
        )
        notes.append(
            f"- {row.tier}: {row.description}; {len(row.busy.schedule_s)} steps with the tier, "
            f"{len(row.alone.schedule_s)} alone; failed store jobs: {row.failures}{preempted}"
        )
    print_markdown_table(header, lines)
    print()
    spreads = [s for row in rows if not row.skipped and (s := _alone_spread(row.alone))]
    if spreads:
        print(
            f"- alone A/A: each row's alone rounds split in two (even rounds against odd ones, "
            f"the larger over the smaller), identical steps seconds apart: "
            f"p50 {min(s[0] for s in spreads):.2f}-{max(s[0] for s in spreads):.2f}x, "
            f"p99 {min(s[1] for s in spreads):.2f}-{max(s[1] for s in spreads):.2f}x over "
            f"{len(spreads)} rows. A ratio inside that range is not told apart from the "
            f"machine's own noise in this run (each half holds half the steps, so its p99 is "
            f"the rougher estimate)."
        )
    print("\n".join(notes))
