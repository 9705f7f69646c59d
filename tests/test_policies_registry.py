"""Policies as a plug-in point: one resolver behind every place a policy is chosen.

The FIFO policy of docs/writing-a-policy.md is the user's policy here: it must pass
the state machine and be usable by every spelling, in every entry point.
"""

from __future__ import annotations

import importlib.metadata
import re
import sys
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tiering.cli import main
from tiering.config import TieringConfig
from tiering.core.errors import ConfigError
from tiering.policies import (
    ENTRY_POINT_GROUP,
    POLICY_NAMES,
    KVAwarePolicy,
    LRUPolicy,
    PolicyChoice,
    known_policy_names,
    make_policy,
    parse_policy_text,
    resolve_policy,
    split_policy_list,
)
from tiering.replay.offline import simulate_policy
from tiering.replay.sweep import run_sweep
from tiering.replay.synthetic import SyntheticWorkload
from tiering.testing import make_policy_test_case

DOC = Path(__file__).resolve().parent.parent / "docs" / "writing-a-policy.md"
MODULE = "docs_policy_example"


def _fifo_module() -> types.ModuleType:
    source = next(
        block
        for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.DOTALL)
        if "class FIFOPolicy" in block
    )
    module = types.ModuleType(MODULE)
    exec(compile(source, f"{DOC.name}:FIFOPolicy", "exec"), module.__dict__)
    return module


FIFO_MODULE = _fifo_module()
FIFOPolicy: Any = FIFO_MODULE.FIFOPolicy

# The documented example passes the documented test, with and without options.
TestDocumentedFIFOContract = make_policy_test_case(FIFOPolicy, capacity=6)
TestDocumentedFIFOCapacityOne = make_policy_test_case(lambda c: FIFOPolicy(c, spare=2), capacity=1)


@pytest.fixture
def importable_fifo(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    monkeypatch.setitem(sys.modules, MODULE, FIFO_MODULE)
    yield MODULE


@pytest.fixture
def fifo_entry_point(monkeypatch: pytest.MonkeyPatch, importable_fifo: str) -> None:
    real = importlib.metadata.entry_points
    extra = importlib.metadata.EntryPoint(
        name="fifo", value=f"{importable_fifo}:FIFOPolicy", group=ENTRY_POINT_GROUP
    )

    def entry_points(**params: Any) -> Any:
        found = real(**params)
        if params.get("group") == ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints([*found, extra])
        return found

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


def test_builtin_names_are_case_insensitive_and_labelled_in_lower_case() -> None:
    choice = resolve_policy(" KVAware ")
    assert choice.factory is KVAwarePolicy and choice.label == "kvaware"
    assert POLICY_NAMES == ("lru", "arc", "kvaware", "adaptive")
    assert isinstance(make_policy("LRU", 4), LRUPolicy)


def test_every_spelling_resolves_the_documented_policy(
    importable_fifo: str, fifo_entry_point: None
) -> None:
    spellings: list[tuple[object, dict[str, Any]]] = [
        (f"{importable_fifo}:FIFOPolicy", {}),
        ("FIFOPolicy", {"module_path": importable_fifo}),
        ("fifo", {}),
        ({"name": "fifo", "spare": 3}, {}),
        (f"{importable_fifo}:FIFOPolicy(spare=3)", {}),
    ]
    for setting, extra in spellings:
        choice = resolve_policy(setting, **extra)
        assert choice.factory is FIFOPolicy, setting
        policy = choice.build(5)
        assert isinstance(policy, FIFOPolicy) and policy.capacity == 5
    assert "fifo" in known_policy_names()
    assert resolve_policy({"name": "fifo", "spare": 3}).to_json() == {"name": "fifo", "spare": 3}
    assert resolve_policy({"name": "fifo", "spare": 3}).label == "fifo(spare=3)"


def test_kv_connector_extra_config_accepts_vllm_spelling_and_options(importable_fifo: str) -> None:
    config = TieringConfig.from_extra_config(
        {
            "cpu_bytes_to_use": 1 << 20,
            "eviction_policy": "FIFOPolicy",
            "cache_policy_module_path": importable_fifo,
        }
    )
    assert config.policy.factory is FIFOPolicy and config.eviction_policy == "FIFOPolicy"
    config = TieringConfig.from_extra_config(
        {"cpu_bytes_to_use": 1 << 20, "eviction_policy": {"name": "kvaware", "probation_ghosts": 2}}
    )
    assert config.eviction_policy == "kvaware(probation_ghosts=2)"
    policy = config.policy.build(8)
    assert isinstance(policy, KVAwarePolicy) and policy.sizes() == (0, 0, 0, 0)
    # A config built directly resolves its policy from the name.
    assert TieringConfig(cpu_bytes_to_use=1, eviction_policy="arc").policy.label == "arc"


@pytest.mark.parametrize(
    ("setting", "module_path", "message"),
    [
        ("fifo", None, r"eviction_policy must be one of lru, arc, kvaware.*got 'fifo'"),
        ("no_such_module_xyz:Policy", None, r"eviction_policy: cannot import policy"),
        ("tiering.core.errors:ConfigError", None, r"not an EvictionPolicy subclass"),
        ({"name": "kvaware", "bogus": 1}, None, r"eviction_policy: policy kvaware\(bogus=1\) rej"),
        ({"name": "kvaware", "protected_ghosts": -2}, None, r"protected_ghosts must be"),
        ({"probation_ghosts": 2}, None, r"eviction_policy: a mapping needs a 'name' key"),
        ("Missing", "tiering.policies", r"cannot import policy 'tiering.policies:Missing'"),
        ("LRUPolicy", 7, r"cache_policy_module_path must be a module name"),
        (["lru"], None, r"eviction_policy must be one of"),
    ],
)
def test_bad_settings_are_config_errors_naming_the_key(
    setting: object, module_path: object, message: str
) -> None:
    extra: dict[str, Any] = {"cpu_bytes_to_use": 1 << 20, "eviction_policy": setting}
    if module_path is not None:
        extra["cache_policy_module_path"] = module_path
    with pytest.raises(ConfigError, match=message):
        TieringConfig.from_extra_config(extra)


def test_secondary_tiers_take_the_same_settings(tmp_path: Path, importable_fifo: str) -> None:
    from tiers.fs import FileSystemTier
    from tiers.memory import MemoryTier

    fs = FileSystemTier(
        root_dir=tmp_path, capacity_blocks=8, eviction_policy=f"{importable_fifo}:FIFOPolicy"
    ).config
    assert fs.policy.factory is FIFOPolicy
    with pytest.raises(ConfigError, match=r"fs tier: eviction_policy: policy kvaware\(x=1\)"):
        FileSystemTier(
            root_dir=tmp_path, capacity_blocks=8, eviction_policy={"name": "kvaware", "x": 1}
        )
    MemoryTier(capacity_blocks=4, eviction_policy="kvaware(probation_ghosts=0.5)")
    with pytest.raises(ConfigError, match="eviction_policy"):
        MemoryTier(capacity_blocks=4, eviction_policy="lfu")


def test_primary_tier_builds_the_configured_policy(importable_fifo: str) -> None:
    from tiering.spec import TieringOffloadingSpec

    spec = TieringOffloadingSpec(
        {"cpu_bytes_to_use": 8 * 4096, "eviction_policy": f"{importable_fifo}:FIFOPolicy"},
        block_bytes=4096,
        require_alignment=False,
    )
    manager = spec.get_manager()
    try:
        assert isinstance(manager.primary.eviction_policy, FIFOPolicy)
    finally:
        spec.shutdown()


def test_policy_text_and_lists() -> None:
    assert parse_policy_text("kvaware") == {"name": "kvaware"}
    assert parse_policy_text('m:C(a=1, b=true,c=x, d="y")') == {
        "name": "m:C",
        "a": 1,
        "b": True,
        "c": "x",
        "d": "y",
    }
    with pytest.raises(ConfigError, match="key=value"):
        parse_policy_text("kvaware(2)")
    with pytest.raises(ConfigError, match="NAME or NAME"):
        parse_policy_text("(a=1)")
    assert split_policy_list("lru, kvaware(a=1,b=2),m:C") == ["lru", "kvaware(a=1,b=2)", "m:C"]


def test_simulation_and_sweep_take_any_setting(importable_fifo: str) -> None:
    requests = SyntheticWorkload(num_requests=80).generate()
    path = f"{importable_fifo}:FIFOPolicy"
    by_choice = simulate_policy(requests, 30, resolve_policy(path))
    assert simulate_policy(requests, 30, path) == by_choice
    result = run_sweep(requests, [30], policies=["lru", path, "kvaware(probation_ghosts=2)"])
    assert result.policies == ("lru", path, "kvaware(probation_ghosts=2)")
    assert result.points[0].hit_rates[path] == by_choice
    with pytest.raises(ValueError, match="distinct"):
        run_sweep(requests, [30], policies=["lru", "LRU"])


def test_sweep_command_takes_user_policies_with_options(
    tmp_path: Path, importable_fifo: str, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "s"
    policies = f"lru,{importable_fifo}:FIFOPolicy(spare=1)"
    args = ["sweep", "--requests", "60", "--out", str(out), "--no-progress", "--json"]
    assert main([*args, "--capacities", "20", "--policies", policies]) == 0
    assert f'"{importable_fifo}:FIFOPolicy(spare=1)"' in capsys.readouterr().out
    assert main([*args, "--policies", "lru,fifo"]) != 0
    assert "--policies must be one of lru, arc, kvaware" in capsys.readouterr().err


def test_a_resolved_choice_passes_through_unchanged() -> None:
    choice = resolve_policy("kvaware")
    assert resolve_policy(choice) is choice
    assert isinstance(choice, PolicyChoice) and str(choice) == "kvaware"
    with pytest.raises(ConfigError, match="capacity"):
        choice.build(0)
