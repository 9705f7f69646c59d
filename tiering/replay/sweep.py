"""Hit rate against capacity: every eviction policy and Belady's optimum, offline.

For each capacity the trace is run through a single cache of that many blocks under
each of the framework's eviction policies (the classes the primary tier uses) and
under Belady's MIN, the offline upper bound. The unlimited-capacity hit rate is the
ceiling they all approach. Results are written as CSV, JSON and a PNG plot, and
printed as a table.
"""

from __future__ import annotations

import csv
import json
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from tiering.policies import POLICY_NAMES, PolicyChoice, resolve_admission, resolve_policy
from tiering.replay.offline import (
    DEFAULT_STORE_CHUNK_BLOCKS,
    HitRate,
    StackHitRate,
    simulate_belady,
    simulate_policy,
    simulate_stack,
    unlimited_hit_rate,
)
from tiering.replay.trace import DEFAULT_BLOCK_TOKENS, Request, trace_footprint
from tiering.replay.units import format_bytes

BELADY = "belady"

#: Default capacities, as fractions of the trace's distinct blocks.
DEFAULT_FRACTIONS = (0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.7, 1.0)


@dataclass(frozen=True, slots=True)
class SweepPoint:
    """Hit rates of every simulated cache at one capacity."""

    capacity_blocks: int
    capacity_bytes: int
    hit_rates: dict[str, HitRate]  # policy name (or "belady") -> hits


@dataclass(frozen=True, slots=True)
class SweepResult:
    """A whole sweep: the trace's description, the ceiling and one point per capacity."""

    trace_name: str
    num_requests: int
    footprint_blocks: int
    block_tokens: int
    block_bytes: int
    policies: tuple[str, ...]
    unlimited: HitRate
    points: tuple[SweepPoint, ...]

    def to_json(self) -> dict[str, Any]:
        return {
            "trace": self.trace_name,
            "requests": self.num_requests,
            "footprint_blocks": self.footprint_blocks,
            "footprint_bytes": self.footprint_blocks * self.block_bytes,
            "block_tokens": self.block_tokens,
            "block_bytes": self.block_bytes,
            "policies": [*self.policies, BELADY],
            "unlimited_token_hit_rate": self.unlimited.token_hit_rate,
            "unlimited_block_hit_rate": self.unlimited.block_hit_rate,
            "points": [
                {
                    "capacity_blocks": point.capacity_blocks,
                    "capacity_bytes": point.capacity_bytes,
                    "token_hit_rate": {
                        name: hits.token_hit_rate for name, hits in point.hit_rates.items()
                    },
                    "block_hit_rate": {
                        name: hits.block_hit_rate for name, hits in point.hit_rates.items()
                    },
                }
                for point in self.points
            ],
        }


#: Default size of the simulated secondary tier, as a multiple of the primary's capacity.
DEFAULT_SECONDARY_FACTOR = 4.0


@dataclass(frozen=True, slots=True)
class AdmissionPoint:
    """One primary capacity, eviction policy and admission policy over an LRU secondary."""

    capacity_blocks: int
    secondary_blocks: int
    policy: str
    admission: str
    result: StackHitRate

    def to_json(self, block_bytes: int) -> dict[str, Any]:
        result = self.result
        return {
            "capacity_blocks": self.capacity_blocks,
            "secondary_blocks": self.secondary_blocks,
            "policy": self.policy,
            "admission": self.admission,
            "token_hit_rate": result.hits.token_hit_rate,
            "secondary_hit_blocks": result.secondary_hit_blocks,
            "blocks_written": result.blocks_written,
            "bytes_written": result.blocks_written * block_bytes,
            "bytes_written_per_hit_token": result.bytes_written_per_hit_token(block_bytes),
        }


def run_admission_sweep(
    requests: Sequence[Request],
    capacities: Sequence[int],
    *,
    policies: Sequence[str | PolicyChoice] = ("lru",),
    admissions: Sequence[str | PolicyChoice] = ("all", "reuse"),
    secondary_factor: float = DEFAULT_SECONDARY_FACTOR,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    store_chunk_blocks: int = DEFAULT_STORE_CHUNK_BLOCKS,
    should_stop: Callable[[], bool] | None = None,
) -> list[AdmissionPoint]:
    """Every (capacity, policy, admission) over a secondary of ``secondary_factor x`` capacity.

    The cost of an admission policy is what it writes below the primary tier:
    compare ``bytes_written_per_hit_token`` and the hit rate against ``"all"``.
    """
    if not secondary_factor > 0:
        raise ValueError(f"secondary_factor must be positive, got {secondary_factor}")
    policy_choices = [resolve_policy(p, key="--policies") for p in policies]
    admission_choices = [resolve_admission(a, key="--admission") for a in admissions]
    points: list[AdmissionPoint] = []
    for capacity in sorted(set(capacities)):
        secondary = max(1, math.ceil(capacity * secondary_factor))
        for policy in policy_choices:
            for admission in admission_choices:
                if should_stop is not None and should_stop():
                    return points
                result = simulate_stack(
                    requests,
                    capacity,
                    secondary,
                    policy,
                    admission,
                    block_tokens,
                    store_chunk_blocks,
                )
                points.append(
                    AdmissionPoint(capacity, secondary, policy.label, admission.label, result)
                )
    return points


def render_admission_table(
    points: Sequence[AdmissionPoint], footprint_blocks: int, block_bytes: int, console: Console
) -> None:
    """Hit rate and bytes written below the primary tier, per admission policy."""
    table = Table(
        title="cascade admission: CPU primary over an LRU secondary tier "
        "(bytes written to the secondary per token served from cache)",
        title_justify="left",
    )
    for column in (
        "primary (blocks)",
        "of footprint",
        "secondary (blocks)",
        "policy",
        "admission",
        "token hit rate",
        "blocks written",
        "bytes written / hit token",
    ):
        table.add_column(column, justify="right")
    for point in points:
        result = point.result
        table.add_row(
            f"{point.capacity_blocks:,}",
            f"{point.capacity_blocks / max(1, footprint_blocks):.0%}",
            f"{point.secondary_blocks:,}",
            point.policy,
            point.admission,
            f"{result.hits.token_hit_rate:.1%}",
            f"{result.blocks_written:,}",
            f"{result.bytes_written_per_hit_token(block_bytes):,.0f}",
        )
    console.print(table)


def default_capacities(footprint_blocks: int) -> list[int]:
    """Capacities spread over the trace's footprint (distinct, ascending, at least 1)."""
    return sorted({max(1, math.ceil(footprint_blocks * f)) for f in DEFAULT_FRACTIONS})


def run_sweep(
    requests: Sequence[Request],
    capacities: Sequence[int],
    *,
    policies: Sequence[str | PolicyChoice] = POLICY_NAMES,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    block_bytes: int = 0,
    store_chunk_blocks: int = DEFAULT_STORE_CHUNK_BLOCKS,
    trace_name: str = "trace",
    on_step: Callable[[str, int], None] | None = None,
    should_stop: Callable[[], bool] | None = None,
) -> SweepResult:
    """Simulate every policy (and Belady) at every capacity.

    ``policies`` are settings :func:`~tiering.policies.resolve_policy` accepts
    (names, ``pkg.mod:Class`` paths, ``name(k=v)`` texts, resolved choices); results
    are keyed by each choice's label. ``on_step(name, capacity)`` is called after
    each simulation (for progress);
    ``should_stop()`` is checked before each one, and a stopped sweep returns the
    capacities finished so far.
    """
    if not capacities or any(c <= 0 for c in capacities):
        raise ValueError(f"capacities must be positive block counts, got {list(capacities)}")
    choices = [resolve_policy(policy, key="--policies") for policy in policies]
    labels = [choice.label for choice in choices]
    if len(set(labels)) != len(labels):
        raise ValueError(f"policies must be distinct, got {labels}")
    points: list[SweepPoint] = []
    for capacity in sorted(set(capacities)):
        rates: dict[str, HitRate] = {}
        for name, choice in (*zip(labels, choices, strict=True), (BELADY, None)):
            if should_stop is not None and should_stop():
                break
            if choice is None:
                rates[name] = simulate_belady(requests, capacity, block_tokens)
            else:
                rates[name] = simulate_policy(
                    requests, capacity, choice, block_tokens, store_chunk_blocks
                )
            if on_step is not None:
                on_step(name, capacity)
        if len(rates) < len(choices) + 1:
            break
        points.append(SweepPoint(capacity, capacity * block_bytes, rates))
    return SweepResult(
        trace_name=trace_name,
        num_requests=len(requests),
        footprint_blocks=trace_footprint(requests),
        block_tokens=block_tokens,
        block_bytes=block_bytes,
        policies=tuple(labels),
        unlimited=unlimited_hit_rate(requests, block_tokens),
        points=tuple(points),
    )


def write_csv(result: SweepResult, path: Path) -> None:
    """One row per capacity: blocks, bytes, then the token hit rate of each cache."""
    names = [*result.policies, BELADY]
    with path.open("w", newline="", encoding="utf-8") as out:
        writer = csv.writer(out)
        writer.writerow(
            [
                "capacity_blocks",
                "capacity_bytes",
                *(f"{n}_token_hit_rate" for n in names),
                "unlimited_token_hit_rate",
            ]
        )
        for point in result.points:
            writer.writerow(
                [
                    point.capacity_blocks,
                    point.capacity_bytes,
                    *(f"{point.hit_rates[n].token_hit_rate:.6f}" for n in names),
                    f"{result.unlimited.token_hit_rate:.6f}",
                ]
            )


def sweep_json(result: SweepResult, admission: Sequence[AdmissionPoint] = ()) -> dict[str, Any]:
    """The sweep as JSON, with the admission comparison under ``"admission"`` when run."""
    data = result.to_json()
    if admission:
        data["admission"] = [point.to_json(result.block_bytes) for point in admission]
    return data


def write_json(result: SweepResult, path: Path, admission: Sequence[AdmissionPoint] = ()) -> None:
    path.write_text(json.dumps(sweep_json(result, admission), indent=2) + "\n", encoding="utf-8")


def plot_png(result: SweepResult, path: Path) -> None:
    """Hit rate (%) against capacity, one line per policy, Belady dashed, ceiling dotted."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(8, 5), dpi=100)
    capacities = [p.capacity_blocks for p in result.points]
    for name in result.policies:
        axes.plot(
            capacities,
            [100 * p.hit_rates[name].token_hit_rate for p in result.points],
            marker="o",
            label=_column_title(name),
        )
    axes.plot(
        capacities,
        [100 * p.hit_rates[BELADY].token_hit_rate for p in result.points],
        linestyle="--",
        color="black",
        marker=".",
        label="Belady (offline optimum)",
    )
    axes.axhline(
        100 * result.unlimited.token_hit_rate,
        linestyle=":",
        color="grey",
        label=f"unlimited capacity ({100 * result.unlimited.token_hit_rate:.1f}%)",
    )
    axes.set_xscale("log")
    size = f"{result.block_tokens} tokens"
    if result.block_bytes:
        size += f", {result.block_bytes / 1024:g} KiB"
    axes.set_xlabel(
        f"cache capacity (blocks of {size}; footprint {result.footprint_blocks} blocks)"
    )
    axes.set_ylabel("token-weighted prefix hit rate (%)")
    axes.set_ylim(0, 100)
    axes.set_title(f"{result.trace_name}: {result.num_requests} requests")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend(loc="lower right")
    figure.tight_layout()
    figure.savefig(path)
    plt.close(figure)


def render_table(result: SweepResult, console: Console) -> None:
    """Print the sweep as a rich table: one row per capacity, one column per cache."""
    names = [*result.policies, BELADY]
    table = Table(
        title=f"{result.trace_name}: token-weighted prefix hit rate by capacity "
        f"({result.num_requests:,} requests, {result.footprint_blocks:,} distinct blocks; "
        f"unlimited {result.unlimited.token_hit_rate:.1%})",
        title_justify="left",
    )
    table.add_column("capacity (blocks)", justify="right")
    table.add_column("capacity", justify="right")
    table.add_column("of footprint", justify="right")
    for name in names:
        table.add_column(
            "Belady (optimum)" if name == BELADY else _column_title(name), justify="right"
        )
    for point in result.points:
        table.add_row(
            f"{point.capacity_blocks:,}",
            format_bytes(point.capacity_bytes),
            f"{point.capacity_blocks / max(1, result.footprint_blocks):.0%}",
            *(f"{point.hit_rates[n].token_hit_rate:.1%}" for n in names),
        )
    console.print(table)


def _column_title(label: str) -> str:
    """Built-in names in capitals (LRU, ARC, KVAWARE); user policies as written."""
    return label.upper() if label in POLICY_NAMES else label
