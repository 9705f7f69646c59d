"""Creating secondary tiers from ``secondary_tiers`` config dicts."""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from tests.runtime_support import (
    assert_store_load_lookup,
    primary,
)
from tiering.core.errors import ConfigError
from tiering.registry import (
    BUILTIN_TIERS,
    ENTRY_POINT_GROUP,
    create_secondary_tier,
    known_tier_types,
    register_tier_type,
    resolve_tier_class,
    unregister_tier_type,
)
from tiering.runtime import AsyncTierManager
from tiers.memory import ExampleTier, MemoryTier


class NeedsRoot(MemoryTier):
    """A tier with a required option (like a filesystem tier's root)."""

    def __init__(self, root: str, *, depth: int = 1) -> None:
        super().__init__()
        self.root = root
        self.depth = depth


class TakesAnything(MemoryTier):
    def __init__(self, **options: Any) -> None:
        super().__init__()
        self.options = options


@pytest.fixture
def view() -> memoryview:
    return primary(rows=8).data


@pytest.fixture
def created() -> Iterator[list[AsyncTierManager]]:
    managers: list[AsyncTierManager] = []
    yield managers
    for manager in managers:
        manager.shutdown()


def test_memory_tier_from_config_with_framework_options(
    view: memoryview, created: list[AsyncTierManager]
) -> None:
    config = {"type": "memory", "capacity_blocks": 4, "job_timeout_s": 5, "shutdown_timeout_s": 2}
    manager = create_secondary_tier(config, view, position=0, layout_fingerprint="fp")
    created.append(manager)
    assert isinstance(manager.tier, MemoryTier) and manager.tier.capacity_blocks == 4
    assert manager.tier_type == "memory" and manager.name == "memory-0"
    assert manager.job_timeout_s == 5 and manager.shutdown_timeout_s == 2
    assert manager.tier.context.layout_fingerprint == "fp"
    assert_store_load_lookup(manager, np.frombuffer(view, dtype=np.uint8).reshape(8, -1))


def test_the_seed_example_config_works_unchanged(
    view: memoryview, created: list[AsyncTierManager]
) -> None:
    manager = create_secondary_tier({"type": "example", "custom_param": 67}, view, position=0)
    created.append(manager)
    assert isinstance(manager.tier, ExampleTier) and manager.tier.custom_param == 67


def test_unknown_type_names_position_type_and_known_types(view: memoryview) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[2\] \(type 'nope'\).*memory"):
        create_secondary_tier({"type": "nope"}, view, position=2)


def test_unknown_option_names_position_type_and_key(view: memoryview) -> None:
    with pytest.raises(
        ConfigError,
        match=r"secondary_tiers\[1\] \(type 'memory'\): unknown option 'capacity'.*capacity_blocks",
    ):
        create_secondary_tier({"type": "memory", "capacity": 3}, view, position=1)


def test_missing_required_option_names_it(view: memoryview) -> None:
    path = f"{__name__}:NeedsRoot"
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*missing required option 'root'"):
        create_secondary_tier({"type": path, "depth": 2}, view, position=0)


def test_module_class_path_and_vllm_module_path(
    view: memoryview, created: list[AsyncTierManager]
) -> None:
    by_path = create_secondary_tier(
        {"type": f"{__name__}:NeedsRoot", "root": "/r"}, view, position=0
    )
    created.append(by_path)
    assert isinstance(by_path.tier, NeedsRoot) and by_path.tier.root == "/r"
    by_module = create_secondary_tier(
        {"type": "NeedsRoot", "module_path": __name__, "root": "/s", "name": "mine"},
        view,
        position=1,
    )
    created.append(by_module)
    assert by_module.name == "mine" and by_module.tier.root == "/s"  # type: ignore[attr-defined]


def test_a_tier_taking_any_keyword_gets_every_option(
    view: memoryview, created: list[AsyncTierManager]
) -> None:
    manager = create_secondary_tier(
        {"type": f"{__name__}:TakesAnything", "a": 1, "b": "x", "job_timeout_s": 3},
        view,
        position=0,
    )
    created.append(manager)
    assert manager.tier.options == {"a": 1, "b": "x"}  # type: ignore[attr-defined]


def test_bad_values_become_config_errors_with_position(view: memoryview) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[3\] \(type 'memory'\).*positive"):
        create_secondary_tier({"type": "memory", "capacity_blocks": -1}, view, position=3)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*job_timeout_s"):
        create_secondary_tier({"type": "memory", "job_timeout_s": "soon"}, view, position=0)
    # Found only when the tier opens (needs the block size): still named.
    with pytest.raises(ConfigError, match=r"secondary_tiers\[4\].*holds no block"):
        create_secondary_tier({"type": "memory", "capacity_bytes": 100}, view, position=4)


def test_malformed_entries(view: memoryview) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] must be a dict"):
        create_secondary_tier(["memory"], view, position=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"secondary_tiers\[5\]: missing required key 'type'"):
        create_secondary_tier({"capacity_blocks": 3}, view, position=5)
    with pytest.raises(ConfigError, match="not an AsyncTier"):
        create_secondary_tier({"type": "builtins:dict"}, view, position=0)
    with pytest.raises(ConfigError, match="cannot import"):
        create_secondary_tier({"type": "no_such_module_xyz:Tier"}, view, position=0)


def test_register_tier_type(view: memoryview, created: list[AsyncTierManager]) -> None:
    register_tier_type("needs-root", NeedsRoot)
    register_tier_type("lazy-root", f"{__name__}:NeedsRoot")
    try:
        assert resolve_tier_class("needs-root") is NeedsRoot
        assert resolve_tier_class("lazy-root") is NeedsRoot
        assert "needs-root" in known_tier_types()
        with pytest.raises(ValueError, match="already defined"):
            register_tier_type("needs-root", MemoryTier)
        with pytest.raises(ValueError, match="already defined"):
            register_tier_type("memory", NeedsRoot)
        register_tier_type("needs-root", TakesAnything, replace=True)
        manager = create_secondary_tier({"type": "needs-root", "z": 1}, view, position=0)
        created.append(manager)
        assert isinstance(manager.tier, TakesAnything)
        with pytest.raises(TypeError):
            register_tier_type("bad", dict)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"package\.module:Class"):
            register_tier_type("bad", "no_colon")
    finally:
        unregister_tier_type("needs-root")
        unregister_tier_type("lazy-root")


def test_entry_points_are_found(
    monkeypatch: pytest.MonkeyPatch, view: memoryview, created: list[AsyncTierManager]
) -> None:
    fake = importlib.metadata.EntryPoint(
        name="third-party", value=f"{__name__}:NeedsRoot", group=ENTRY_POINT_GROUP
    )
    real = importlib.metadata.entry_points

    def entry_points(**kwargs: Any) -> Any:
        if kwargs.get("group") == ENTRY_POINT_GROUP:
            return importlib.metadata.EntryPoints([fake])
        return real(**kwargs)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    assert resolve_tier_class("third-party") is NeedsRoot
    assert "third-party" in known_tier_types()
    manager = create_secondary_tier({"type": "third-party", "root": "/x"}, view, position=0)
    created.append(manager)
    assert manager.tier_type == "third-party"


def test_builtin_names_are_lazy_strings() -> None:
    assert BUILTIN_TIERS["memory"] == "tiers.memory:MemoryTier"
    assert BUILTIN_TIERS["fs"] == "tiers.fs:FileSystemTier"
    assert BUILTIN_TIERS["redis"] == "tiers.redis:RedisTier"
    assert resolve_tier_class("memory") is MemoryTier


def test_entries_written_for_vllm_run_our_tiers_without_vllm(
    view: memoryview, created: list[AsyncTierManager], tmp_path: Any
) -> None:
    import sys

    vllm_entry = {
        "type": "KVTieringMemoryTier",
        "module_path": "tiering.integrations.vllm",
        "capacity_blocks": 3,
        "medium": "CPU",  # what vLLM reports: meaningless outside vLLM, dropped
        "job_timeout_s": 5,
        # vLLM's per-tier detector: our manager applies its own back-pressure instead
        "backpressure": {"backpressure_cls": "EMABackpressureDetector"},
    }
    manager = create_secondary_tier(vllm_entry, view, position=0)
    created.append(manager)
    assert isinstance(manager.tier, MemoryTier) and manager.tier.capacity_blocks == 3
    assert manager.name == "memory-0"
    generic = {
        "type": "KVTieringTier",
        "module_path": "tiering.integrations.vllm",
        "tier": "fs",
        "root_dir": str(tmp_path),
        "capacity_bytes": "1MiB",
    }
    manager = create_secondary_tier(generic, view, position=1)
    created.append(manager)
    assert manager.tier_type == "fs"
    assert "vllm" not in sys.modules, "reading a vLLM-style entry must not import vLLM"
    with pytest.raises(ConfigError, match=r"secondary_tiers\[2\]: KVTieringTier needs a 'tier'"):
        create_secondary_tier({**generic, "tier": None}, view, position=2)
    with pytest.raises(ConfigError, match="always runs our 'redis' tier"):
        create_secondary_tier(
            {"type": "KVTieringRedisTier", "module_path": "tiering.integrations.vllm", "tier": "x"},
            view,
            position=3,
        )


def test_isolation_process_runs_the_tier_in_a_child_process(tmp_path: Any) -> None:
    from tiering.isolation import IsolatedTierManager
    from tiering.primary.host_buffer import HostBuffer, make_shared_name

    with HostBuffer.create(8, 4096, shared_name=make_shared_name("registry")) as host:
        config = {"type": "memory", "capacity_blocks": 4, "isolation": "process"}
        manager = create_secondary_tier(config, host.view, position=2, primary_buffer=host)
        try:
            assert isinstance(manager, IsolatedTierManager) and manager.name == "memory-2"
            assert_store_load_lookup(manager, host.as_numpy())
            assert manager.stats().capacity_blocks == 4
        finally:
            manager.shutdown()
            host.unlink()


class LocalOnly(MemoryTier):
    """Takes an option that cannot be pickled (a lock), so it cannot go to a child process."""

    def __init__(self, guard: object = None) -> None:
        super().__init__()
        self.guard = guard


def test_isolation_is_checked_before_anything_starts(view: memoryview) -> None:
    import threading

    from tiering.primary.host_buffer import HostBuffer, make_shared_name

    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*isolation must be one of"):
        create_secondary_tier({"type": "memory", "isolation": "fork"}, view, position=0)
    with pytest.raises(ConfigError, match="needs the primary buffer in named shared memory"):
        create_secondary_tier({"type": "memory", "isolation": "process"}, view, position=0)
    with HostBuffer.create(8, 4096, shared_name=make_shared_name("registry")) as host:
        try:
            config = {
                "type": "tests.test_registry:LocalOnly",
                "guard": threading.Lock(),
                "isolation": "process",
            }
            with pytest.raises(ConfigError, match="LocalOnly and its options do not pickle"):
                create_secondary_tier(config, host.view, position=0, primary_buffer=host)
        finally:
            host.unlink()


def test_a_spec_with_an_isolated_tier_shares_its_primary_buffer() -> None:
    """The tier's process copies blocks out of and back into the spec's primary buffer:
    a round trip through it returns the bytes (it could not, on a private copy)."""
    from tests.manager_helpers import BLOCK_BYTES, key, load_and_verify, promote, settle, store
    from tiering.core.keys import NO_CONTEXT
    from tiering.isolation import IsolatedTierManager
    from tiering.spec import build_manager

    config = {
        "cpu_bytes_to_use": 8 * BLOCK_BYTES,
        "secondary_tiers": [{"type": "memory", "capacity_blocks": 4, "isolation": "process"}],
    }
    manager = build_manager(config, block_bytes=BLOCK_BYTES, require_alignment=False)
    try:
        tier = manager.secondary_tiers[0]
        assert isinstance(tier, IsolatedTierManager)
        assert manager.primary.buffer.name is not None
        blocks = [key(i) for i in range(4)]
        store(manager, blocks)
        settle(manager)
        assert tier.stats().blocks_stored == 4  # read by the child from the shared rows
        store(manager, [key(100 + i) for i in range(8)], success=False)  # evicts the four
        assert promote(manager, blocks) == [None] * 4  # promotions started...
        settle(manager)
        assert [manager.lookup(k, NO_CONTEXT) for k in blocks] == [True] * 4  # ...and landed
        load_and_verify(manager, blocks)  # written by the child into the shared rows
    finally:
        manager.shutdown()


def test_null_means_the_default_for_the_runtime_keys(
    view: memoryview, created: list[AsyncTierManager]
) -> None:
    """docs/configuration.md: JSON null means "use the default" for every optional key."""
    manager = create_secondary_tier(
        {"type": "memory", "job_timeout_s": None, "shutdown_timeout_s": None, "max_events": None},
        view,
        position=0,
    )
    created.append(manager)
    assert manager.job_timeout_s == 30 and manager.shutdown_timeout_s == 10


def test_null_means_the_default_for_a_tiers_own_options(
    view: memoryview, created: list[AsyncTierManager], tmp_path: Any
) -> None:
    manager = create_secondary_tier(
        {"type": "memory", "eviction_policy": None, "capacity_blocks": 3}, view, position=0
    )
    created.append(manager)
    assert isinstance(manager.tier, MemoryTier)
    manager = create_secondary_tier(
        {"type": "directory", "root_dir": str(tmp_path), "fsync": None}, view, position=1
    )
    created.append(manager)
