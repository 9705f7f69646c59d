"""Sweeps over workload families: per-family tables with the gap closed, and a verdict.

``tiering sweep family:all`` (or ``family:chat-long,scan-heavy``, ``family:builtin@1``)
runs :func:`~tiering.replay.sweep.run_sweep` on each family of
:mod:`tiering.replay.families` and prints, besides each family's hit-rate table, how
much of the LRU→Belady gap each policy closes and how far it is from the better of LRU
and ARC, then the worst such distance over every family and capacity: the figure the
"good enough to be the default" rule (never more than 0.3 point below) is about.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

from tiering.replay.sweep import BELADY, SweepResult

#: The most a default policy may lose against max(LRU, ARC), in points, anywhere.
DEFAULT_RULE_POINTS = 0.3


@dataclass(frozen=True, slots=True)
class Shortfall:
    """A policy's worst distance to max(LRU, ARC) over the families swept."""

    policy: str
    points: float  # policy - max(LRU, ARC), in points (negative: below)
    family: str
    fraction: float  # capacity as a fraction of that family's footprint


def gap_closed(result: SweepResult, index: int, policy: str) -> float | None:
    """(policy - LRU) / (Belady - LRU) at ``result.points[index]`` (None without a gap)."""
    rates = result.points[index].hit_rates
    lru = rates["lru"].token_hit_rate
    gap = rates[BELADY].token_hit_rate - lru
    if gap <= 1e-9:
        return None
    return (rates[policy].token_hit_rate - lru) / gap


def versus_best(result: SweepResult, index: int, policy: str) -> float:
    """policy - max(LRU, ARC) at ``result.points[index]``, in points."""
    rates = result.points[index].hit_rates
    best = max(rates["lru"].token_hit_rate, rates["arc"].token_hit_rate)
    return 100.0 * (rates[policy].token_hit_rate - best)


def render_gaps(result: SweepResult, console: Console) -> None:
    """One row per capacity: each policy's gap closed (LRU→Belady) and its distance to the
    better of LRU and ARC (that column only where ARC was swept)."""
    if "lru" not in result.policies or not result.points:
        return
    others = [name for name in result.policies if name != "lru"]
    with_best = "arc" in result.policies
    table = Table(
        title=f"{result.trace_name}: gap closed, (policy - LRU) / (Belady - LRU)"
        + ("; vs best: policy - max(LRU, ARC), points" if with_best else ""),
        title_justify="left",
    )
    table.add_column("capacity (blocks)", justify="right")
    table.add_column("of footprint", justify="right")
    for name in others:
        table.add_column(f"{name} gap closed", justify="right")
        if with_best and name != "arc":
            table.add_column(f"{name} vs best", justify="right")
    for index, point in enumerate(result.points):
        cells = [
            f"{point.capacity_blocks:,}",
            f"{point.capacity_blocks / max(1, result.footprint_blocks):.0%}",
        ]
        for name in others:
            closed = gap_closed(result, index, name)
            cells.append("—" if closed is None else f"{closed:.0%}")
            if with_best and name != "arc":
                cells.append(f"{versus_best(result, index, name):+.2f}")
        table.add_row(*cells)
    console.print(table)


def shortfalls(results: Sequence[SweepResult]) -> list[Shortfall]:
    """For each policy other than LRU and ARC, its worst distance to max(LRU, ARC)."""
    worst: dict[str, Shortfall] = {}
    for result in results:
        if "lru" not in result.policies or "arc" not in result.policies:
            continue
        for name in result.policies:
            if name in ("lru", "arc"):
                continue
            for index, point in enumerate(result.points):
                points = versus_best(result, index, name)
                fraction = point.capacity_blocks / max(1, result.footprint_blocks)
                if name not in worst or points < worst[name].points:
                    worst[name] = Shortfall(name, points, result.trace_name, fraction)
    return list(worst.values())


def render_verdict(results: Sequence[SweepResult], console: Console) -> None:
    """The worst distance to max(LRU, ARC) of each policy, and the default rule's verdict."""
    for item in shortfalls(results):
        verdict = "meets" if item.points >= -DEFAULT_RULE_POINTS else "does not meet"
        console.print(
            f"{item.policy}: worst {item.points:+.2f} point(s) against max(LRU, ARC) "
            f"({item.family} at {item.fraction:.0%} of its footprint) over "
            f"{len(results)} famil{'y' if len(results) == 1 else 'ies'}: {verdict} the "
            f"default rule (never more than {DEFAULT_RULE_POINTS} point below)",
            soft_wrap=True,
        )
