"""Workload families: seeded generators with prefix-hash block ids, the regimes they are
meant to stress, ``family:`` parsing, and ``tiering sweep family:...`` end to end."""

from __future__ import annotations

from pathlib import Path

import pytest

from tiering.cli import main
from tiering.cli.exits import EXIT_BAD_INPUT, EXIT_OK
from tiering.core.errors import ConfigError
from tiering.replay.families import (
    ALL_FAMILIES,
    GENERATED_FAMILIES,
    ScanWorkload,
    family_requests,
    parse_families,
)
from tiering.replay.offline import simulate_policy
from tiering.replay.synthetic import SyntheticWorkload
from tiering.replay.trace import Request, trace_footprint


def prefix_closed(requests: list[Request]) -> bool:
    """Block ids behave as prefix hashes: one id, one parent (the block before it)."""
    parent: dict[int, int] = {}
    for request in requests:
        previous = -1
        for block in request.hash_ids:
            if parent.setdefault(block, previous) != previous:
                return False
            previous = block
    return True


@pytest.mark.parametrize("name", list(GENERATED_FAMILIES))
def test_generated_families_are_seeded_and_prefix_hashed(name: str) -> None:
    first = family_requests(name, 300, 0)
    assert first == family_requests(name, 300, 0)
    assert first != family_requests(name, 300, 1)
    assert len(first) == 300 and prefix_closed(first)
    assert all(r.hash_ids and r.input_length > 0 for r in first)
    assert [r.timestamp_ms for r in first] == sorted(r.timestamp_ms for r in first)


def test_builtin_family_is_the_built_in_workload() -> None:
    assert (
        family_requests("builtin", 200, 2) == SyntheticWorkload(num_requests=200, seed=2).generate()
    )


def _reuse_distances(requests: list[Request]) -> list[int]:
    """Distinct-ish reuse distance in block accesses, for every reuse."""
    last: dict[int, int] = {}
    distances = []
    position = 0
    for request in requests:
        for block in request.hash_ids:
            if block in last:
                distances.append(position - last[block])
            last[block] = position
            position += 1
    return distances


def test_chat_long_reuse_comes_back_later_than_the_builtin_workload() -> None:
    """Long think times with many open sessions: a small cache forgets between turns."""
    builtin = sorted(_reuse_distances(family_requests("builtin", 1500, 0)))
    long = sorted(_reuse_distances(family_requests("chat-long", 1500, 0)))
    assert long[len(long) // 2] > 1.4 * builtin[len(builtin) // 2]
    footprint = trace_footprint(family_requests("chat-long", 1500, 0))
    assert long[len(long) // 2] > footprint // 50  # beyond a 2% cache


def test_scan_heavy_is_mostly_one_off_blocks_behind_a_hot_prompt() -> None:
    requests = family_requests("scan-heavy", 1000, 0)
    uses: dict[int, int] = {}
    for request in requests:
        for block in request.hash_ids:
            uses[block] = uses.get(block, 0) + 1
    once = sum(1 for count in uses.values() if count == 1)
    assert once > 0.7 * len(uses)  # the scan
    first_blocks = [r.hash_ids[0] for r in requests]
    hottest = max(set(first_blocks), key=first_blocks.count)
    assert first_blocks.count(hottest) > 0.15 * len(requests)  # the hot system prompt
    assert max(len(r.hash_ids) for r in requests) > 40  # long documents


def test_the_two_generated_families_pull_lru_and_arc_apart() -> None:
    """They stress opposite regimes: ARC well ahead of LRU on long chats at 1%, LRU ahead
    of ARC on the scan-heavy family at 10%."""
    chat = family_requests("chat-long", 1500, 0)
    c = max(1, trace_footprint(chat) // 100)
    assert simulate_policy(chat, c, "arc").token_hit_rate > (
        simulate_policy(chat, c, "lru").token_hit_rate + 0.03
    )
    scan = family_requests("scan-heavy", 800, 0)
    c = max(1, trace_footprint(scan) // 10)
    assert simulate_policy(scan, c, "lru").token_hit_rate > (
        simulate_policy(scan, c, "arc").token_hit_rate + 0.01
    )


def test_scan_workload_checks_its_parameters() -> None:
    with pytest.raises(ConfigError, match="document_tokens_median"):
        ScanWorkload(document_tokens_median=0)
    with pytest.raises(ConfigError, match="sum to <= 1"):
        ScanWorkload(document_share=0.8, follow_up_share=0.3)
    with pytest.raises(ConfigError, match="rates"):
        ScanWorkload(requests_per_s=0)


def test_parse_families() -> None:
    assert parse_families("all") == [
        (name.partition("@")[0], int(name.partition("@")[2]) if "@" in name else None)
        for name in ALL_FAMILIES
    ]
    assert parse_families("chat-long, builtin@3") == [("chat-long", None), ("builtin", 3)]
    with pytest.raises(ConfigError, match="unknown family 'nope'"):
        parse_families("nope")
    with pytest.raises(ConfigError, match="must be an integer"):
        parse_families("builtin@x")
    with pytest.raises(ConfigError, match="give 'all'"):
        parse_families(" , ")
    with pytest.raises(ConfigError, match="not generated"):
        family_requests("trace", 10, 0)


def test_sweep_over_families_prints_every_family_gap_and_verdict(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "sweep",
            "family:scan-heavy,builtin@1",
            "--requests",
            "150",
            "--policies",
            "adaptive",
            "--capacities",
            "20,80",
            "--out",
            str(tmp_path / "f"),
            "--no-progress",
        ]
    )
    assert code == EXIT_OK
    out = capsys.readouterr().out
    assert "scan-heavy(seed=0, requests=150)" in out and "builtin(seed=1, requests=150)" in out
    assert "adaptive gap closed" in out and "adaptive vs best" in out
    assert "adaptive: worst" in out and "over 2 families" in out
    for index in (0, 1):
        for ext in ("png", "csv", "json"):
            assert (tmp_path / f"f-{index}.{ext}").stat().st_size > 0


def test_sweep_of_one_trace_prints_the_gap_closed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["sweep", "--requests", "100", "--policies", "lru,arc,adaptive", "--capacities", "10"]
    assert main([*args, "--out", str(tmp_path / "s"), "--no-progress"]) == EXIT_OK
    out = capsys.readouterr().out
    assert "gap closed" in out and "adaptive vs best" in out


def test_sweep_rejects_unknown_families_and_admission(tmp_path: Path) -> None:
    out = ["--out", str(tmp_path / "s"), "--no-progress"]
    assert main(["sweep", "family:nope", *out]) == EXIT_BAD_INPUT
    assert main(["sweep", "family:builtin", "--admission", "all", *out]) == EXIT_BAD_INPUT
