"""The capacity sweep: numbers, files and the plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path

from tiering.policies import POLICY_NAMES
from tiering.replay.sweep import (
    BELADY,
    default_capacities,
    plot_png,
    run_sweep,
    write_csv,
    write_json,
)
from tiering.replay.synthetic import SyntheticWorkload
from tiering.replay.trace import trace_footprint


def test_sweep_writes_consistent_csv_json_and_png(tmp_path: Path) -> None:
    requests = SyntheticWorkload(num_requests=150).generate()
    footprint = trace_footprint(requests)
    capacities = default_capacities(footprint)
    assert capacities[-1] == footprint and capacities == sorted(set(capacities))
    steps: list[tuple[str, int]] = []
    result = run_sweep(
        requests,
        capacities,
        block_bytes=4096,
        trace_name="synthetic",
        on_step=lambda name, capacity: steps.append((name, capacity)),
    )
    assert len(steps) == len(capacities) * (len(POLICY_NAMES) + 1)
    assert [p.capacity_blocks for p in result.points] == capacities
    for point in result.points:
        optimum = point.hit_rates[BELADY]
        for name in result.policies:
            assert point.hit_rates[name].hit_blocks <= optimum.hit_blocks
        assert optimum.token_hit_rate <= result.unlimited.token_hit_rate
    # At the footprint nothing is ever evicted: every cache reaches the ceiling.
    assert all(h == result.unlimited for h in result.points[-1].hit_rates.values())

    write_csv(result, tmp_path / "s.csv")
    write_json(result, tmp_path / "s.json")
    plot_png(result, tmp_path / "s.png")
    rows = list(csv.DictReader((tmp_path / "s.csv").open()))
    assert len(rows) == len(capacities)
    assert float(rows[0]["belady_token_hit_rate"]) == round(
        result.points[0].hit_rates[BELADY].token_hit_rate, 6
    )
    data = json.loads((tmp_path / "s.json").read_text())
    assert data["policies"] == ["lru", "arc", "kvaware", "adaptive", "belady"]
    assert data["points"][-1]["capacity_bytes"] == footprint * 4096
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_stopped_sweep_keeps_the_finished_capacities() -> None:
    requests = SyntheticWorkload(num_requests=60).generate()
    calls = 0

    def stop_after_first_capacity() -> bool:
        nonlocal calls
        calls += 1
        return calls > len(POLICY_NAMES) + 1  # every policy and belady at the first capacity

    result = run_sweep(requests, [5, 10, 20], should_stop=stop_after_first_capacity)
    assert [p.capacity_blocks for p in result.points] == [5]
