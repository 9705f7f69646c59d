"""Cascade admission: the pure policies, their configuration, the manager's use of them,
and the offline stack simulation that reports what each writes below the primary tier."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.manager_helpers import key, load_and_verify, make_facade, make_primary, settle, store
from tiering.cli import main
from tiering.config import TieringConfig
from tiering.core.errors import ConfigError
from tiering.core.keys import NO_CONTEXT
from tiering.manager import TieringOffloadingManager
from tiering.policies import AdmitAll, ReuseAdmission, resolve_admission
from tiering.replay.offline import simulate_stack, unlimited_hit_rate
from tiering.replay.sweep import run_admission_sweep
from tiering.replay.synthetic import SyntheticWorkload
from tiering.replay.trace import trace_footprint
from tiers.memory import MemoryTier


def test_admit_all_admits_everything_and_nothing_late() -> None:
    gate: AdmitAll[int] = AdmitAll(4)
    assert gate.admit([3, 1, 2]) == [3, 1, 2]
    assert gate.on_use([3, 1]) == []


def test_reuse_admits_on_a_second_store_or_a_use() -> None:
    gate: ReuseAdmission[int] = ReuseAdmission(10)
    assert gate.admit([1, 2, 3]) == []  # first appearance: remembered, not written
    assert gate.admit([1, 2, 3]) == [1, 2, 3]  # stored again: it came back
    assert gate.admit([4, 5]) == []
    assert gate.on_use([4, 9]) == [4]  # used while in the primary tier: write it now
    assert gate.on_use([4]) == []  # once
    assert gate.num_remembered == 1  # 5


def test_reuse_keeps_prefixes_whole() -> None:
    gate: ReuseAdmission[int] = ReuseAdmission(10)
    gate.admit([1, 2])
    # 1 and 2 came back, 7 is new: 7 and everything after it in the batch waits (2 would be
    # worthless below the primary tier without 7).
    assert gate.admit([1, 7, 2]) == [1]
    assert gate.admit([7, 2]) == [7, 2]


def test_reuse_history_is_bounded() -> None:
    gate: ReuseAdmission[int] = ReuseAdmission(2, history=1.5)
    for block in range(10):
        gate.admit([block])
    assert gate.num_remembered == 3
    assert gate.admit([0]) == []  # forgotten: new again
    assert gate.admit([9]) == [9]


@given(
    batches=st.lists(
        st.tuples(st.booleans(), st.lists(st.integers(0, 30), max_size=6, unique=True)),
        max_size=40,
    ),
    capacity=st.integers(1, 6),
)
def test_reuse_answers_are_prefixes_or_subsets_and_memory_stays_bounded(
    batches: list[tuple[bool, list[int]]], capacity: int
) -> None:
    gate: ReuseAdmission[int] = ReuseAdmission(capacity, history=2.0)
    for is_use, keys in batches:
        if is_use:
            used = gate.on_use(keys)
            assert used == [k for k in keys if k in set(used)]
        else:
            admitted = gate.admit(keys)
            assert admitted == keys[: len(admitted)]
        assert gate.num_remembered <= 2 * capacity


def test_config_names_admission_like_policies() -> None:
    base: dict[str, Any] = {"cpu_bytes_to_use": 1 << 20}
    assert TieringConfig.from_extra_config(base).cascade_admission is None
    assert (
        TieringConfig.from_extra_config({**base, "cascade_admission": "ALL"}).cascade_admission
        is None
    )
    choice = TieringConfig.from_extra_config(
        {**base, "cascade_admission": {"name": "reuse", "history": 2}}
    ).cascade_admission
    assert choice is not None and choice.label == "reuse(history=2)"
    assert isinstance(choice.build(8), ReuseAdmission)
    for bad, message in [
        ("lfu", r"cascade_admission must be one of all, reuse"),
        ("reuse(history=0)", r"cascade_admission: policy reuse\(history=0\) rejected"),
        ("tiering.policies:LRUPolicy", r"not an AdmissionPolicy subclass"),
    ]:
        with pytest.raises(ConfigError, match=message):
            TieringConfig.from_extra_config({**base, "cascade_admission": bad})
    assert resolve_admission("tiering.policies:ReuseAdmission").factory is ReuseAdmission


def test_manager_cascades_only_admitted_blocks_and_used_ones_late() -> None:
    primary = make_primary(8)
    tier = make_facade(MemoryTier(), primary)
    manager = TieringOffloadingManager(
        primary, [tier], metrics_registry=False, cascade_admission=ReuseAdmission(8)
    )
    with manager:
        keys = [key(i) for i in range(4)]
        store(manager, keys)
        settle(manager)
        assert tier.get_num_blocks() == 0  # first appearance: kept in the CPU tier only
        manager.touch(keys[:2], NO_CONTEXT)  # a prefix hit: those two earned the disk
        settle(manager)
        assert tier.get_num_blocks() == 2
        assert all(tier.lookup(k, NO_CONTEXT) is True for k in keys[:2])
        load_and_verify(manager, keys)
        assert manager.stats().secondary[0].cascades == 2


def test_stack_simulation_reaches_the_ceiling_and_reuse_writes_less() -> None:
    requests = SyntheticWorkload(num_requests=200).generate()
    footprint = trace_footprint(requests)
    # A CPU tier that holds the longest request (each request's hits are pinned there
    # at once) and a secondary tier that holds everything: nothing is ever lost below.
    longest = max(len(r.hash_ids) for r in requests)
    everything = simulate_stack(requests, longest, footprint, "lru", "all")
    assert everything.hits == unlimited_hit_rate(requests)
    assert everything.blocks_written == footprint  # every distinct block written once
    reuse = simulate_stack(requests, longest, footprint, "kvaware", "reuse")
    assert reuse.blocks_written < everything.blocks_written
    assert reuse.hits.hit_tokens <= everything.hits.hit_tokens
    points = run_admission_sweep(requests, [20, 40], policies=["lru"], admissions=["all", "reuse"])
    assert [(p.capacity_blocks, p.admission) for p in points] == [
        (20, "all"),
        (20, "reuse"),
        (40, "all"),
        (40, "reuse"),
    ]
    assert points[0].to_json(1024)["bytes_written"] == points[0].result.blocks_written * 1024


def test_sweep_command_compares_admission_policies(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["sweep", "--requests", "60", "--capacities", "20", "--out", str(tmp_path / "s")]
    args += ["--no-progress", "--json", "--policies", "lru"]
    assert main([*args, "--admission", "all,reuse(history=2)"]) == 0
    rows = json.loads(capsys.readouterr().out)["admission"]
    assert [(r["policy"], r["admission"]) for r in rows] == [
        ("lru", "all"),
        ("lru", "reuse(history=2)"),
    ]
    assert rows[1]["blocks_written"] < rows[0]["blocks_written"]
    assert main([*args, "--admission", "all,bogus"]) != 0
    assert "--admission must be one of all, reuse" in capsys.readouterr().err


def test_replay_command_takes_a_cascade_admission(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    report = tmp_path / "r.json"
    args = ["replay", "--requests", "40", "--no-progress", "--output", str(report)]
    assert main([*args, "--cascade-admission", "reuse", "--eviction-policy", "kvaware"]) == 0
    setup = json.loads(report.read_text())["setup"]
    assert (setup["cascade_admission"], setup["eviction_policy"]) == ("reuse", "kvaware")


def test_a_request_never_hits_more_blocks_than_the_cpu_tier_holds() -> None:
    """Every loaded block is pinned in the CPU tier at once: with one block of it, a request
    hits at most one block, however many the secondary tier holds."""
    from tiering.replay.trace import Request

    requests = [Request(0.0, 1536, 0, (1, 2, 3)), Request(0.0, 1536, 0, (1, 2, 3))]
    result = simulate_stack(requests, 1, 4, "lru", "all", store_chunk_blocks=1)
    assert result.primary_hit_blocks + result.secondary_hit_blocks <= 1
    assert result.hits.hit_tokens <= 512
