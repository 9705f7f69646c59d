"""Our eviction policies (and the user's) inside vLLM 0.33's CPU primary tier."""

from __future__ import annotations

from typing import Any

import pytest

from tiering.core.errors import ConfigError
from tiering.integrations.vllm.driver import PatternChecker, chained_keys, fill_pattern
from tiering.integrations.vllm.policy import EvictionPolicyCachePolicy, vllm_cache_policy
from tiering.policies import KVAwarePolicy

SPEC = {"spec_name": "KVTieringOffloadingSpec", "spec_module_path": "tiering.integrations.vllm"}


def test_settings_map_to_vllms_own_policies_or_our_adapter() -> None:
    assert vllm_cache_policy({}) == ("lru", None)
    assert vllm_cache_policy({"eviction_policy": "ARC"}) == ("arc", None)
    vllm_lru = {"eviction_policy": "LRUCachePolicy"}
    vllm_lru["cache_policy_module_path"] = "vllm.v1.kv_offload.cpu.policies.lru"
    assert vllm_cache_policy(vllm_lru) == tuple(vllm_lru.values())
    name, module = vllm_cache_policy(
        {"eviction_policy": {"name": "kvaware", "protected_ghosts": 2}}
    )
    assert module == "tiering.integrations.vllm.policy"
    import tiering.integrations.vllm.policy as adapters

    adapter = getattr(adapters, name)
    assert issubclass(adapter, EvictionPolicyCachePolicy)
    assert adapter.choice.label == "kvaware(protected_ghosts=2)"
    assert vllm_cache_policy({"eviction_policy": "kvaware(protected_ghosts=2)"})[0] == name
    with pytest.raises(ConfigError, match="eviction_policy must be one of"):
        vllm_cache_policy({"eviction_policy": "fifo"})


def test_kvaware_runs_vllms_primary_tier_with_evictions(make_manager: Any) -> None:
    manager, driver = make_manager(
        [{"type": "KVTieringMemoryTier", "module_path": "tiering.integrations.vllm"}],
        num_chunks=8,
        extra_config={**SPEC, "eviction_policy": "kvaware"},
    )
    policy = manager.primary_tier._policy
    assert isinstance(policy, EvictionPolicyCachePolicy)
    assert isinstance(policy.policy, KVAwarePolicy)
    keys = chained_keys("kv", 6)
    for round_ in range(3):  # more blocks than rows: each round evicts the previous one's
        driver.store(f"s{round_}", chained_keys(f"r{round_}", 6), fill_pattern)
        driver.run_until_idle()
    driver.store("s", keys, fill_pattern)
    driver.run_until_idle()
    policy.policy.check_invariants()
    assert set(policy.policy) == set(policy.chunks)
    checker = PatternChecker()
    assert driver.load("l", keys, checker) == 6 and checker.bad == []


def test_a_name_registered_with_vllms_factory_is_left_to_vllm() -> None:
    """vLLM documents registered names as valid eviction_policy values: ours must be too."""
    from vllm.v1.kv_offload.cpu.policies.factory import CachePolicyFactory

    from tiering.integrations.vllm.policy import vllm_cache_policy

    name = "kvtiering_test_registered_lru"
    CachePolicyFactory.register_cache_policy(
        name, "vllm.v1.kv_offload.cpu.policies.lru", "LRUCachePolicy"
    )
    try:
        assert vllm_cache_policy({"eviction_policy": name}) == (name, None)
    finally:
        CachePolicyFactory._registry.pop(name, None)
