"""``cascade_admission`` inside vLLM: our tiers copy only what the policy admits.

Driven through vLLM's own ``TieringOffloadingManager`` (built by our spec, as
vLLM builds it), with the scheduler's calls played by
:class:`~tiering.integrations.vllm.driver.SchedulerDriver`. A request that
offers blocks already in the CPU tier stands for a request reusing them
(vLLM's request-level offload, which our tiers ask for). The last test runs
one script through vLLM's manager and through ours and compares what the
secondary tier holds.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from vllm.v1.kv_offload.base import OffloadPolicy, ReqContext

from tests.manager_helpers import settle
from tests.vllm.test_vllm_tiers import ours, tier_of
from tiering.core.keys import ReqContext as OurReqContext
from tiering.integrations.vllm.driver import (
    PatternChecker,
    chained_keys,
    fill_pattern,
)
from tiering.manager import TieringOffloadingManager
from tiering.policies.admission import ReuseAdmission
from tiering.primary import CPUPrimaryTier
from tiering.registry import create_secondary_tier

BLOCK = 64 * 1024
CHUNKS = 16
OUR_SPEC = {"spec_name": "KVTieringOffloadingSpec", "spec_module_path": "tiering.integrations.vllm"}
REUSE = {**OUR_SPEC, "cascade_admission": "reuse"}
SCRUB = 0xA5


def held(manager: Any, index: int = 0) -> int:
    return tier_of(manager, index).get_num_chunks()


def make(
    make_manager: Any, tiers: int = 1, num_chunks: int = CHUNKS, **extra: Any
) -> tuple[Any, Any]:
    return make_manager(
        [ours("KVTieringMemoryTier", capacity_blocks=64)] * tiers,
        block_bytes=BLOCK,
        num_chunks=num_chunks,
        extra_config={**REUSE, **extra},
    )


def test_a_block_used_once_never_leaves_the_cpu_tier(make_manager: Any) -> None:
    manager, driver = make(make_manager)
    for prompt in range(3):
        driver.store(f"once-{prompt}", chained_keys(f"once-{prompt}", 4), fill_pattern)
    driver.run_until_idle()
    assert held(manager) == 0
    stats = tier_of(manager).stats()
    assert stats.jobs_failed == 0 and stats.blocks_stored == 0
    # The refused chunks were unpinned with the job: the CPU tier can evict all of them.
    assert driver.evict_primary() == 12


def test_reuse_in_the_cpu_tier_writes_the_block_below_it(make_manager: Any) -> None:
    manager, driver = make(make_manager)
    keys = chained_keys("reused", 6)
    driver.store("first", keys, fill_pattern)
    driver.run_until_idle()
    assert held(manager) == 0
    # A second request with the same prefix: vLLM offers the chunks already in its CPU tier.
    assert driver.store("second", keys, fill_pattern) == []  # nothing new for the CPU tier
    driver.run_until_idle()
    assert held(manager) == 6
    # Served from our tier once the CPU tier has forgotten them, byte for byte.
    driver.evict_primary()
    driver.rows[:] = SCRUB
    checker = PatternChecker()
    assert driver.load("third", keys, checker) == 6
    assert checker.good == 6 and checker.bad == []


def test_a_second_store_after_eviction_is_reuse_too(make_manager: Any) -> None:
    manager, driver = make(make_manager)
    keys = chained_keys("came-back", 5)
    driver.store("first", keys, fill_pattern)
    driver.run_until_idle()
    driver.evict_primary()
    assert driver.store("again", keys, fill_pattern) == keys  # stored into the CPU tier again
    driver.run_until_idle()
    assert held(manager) == 5


def test_blocks_the_tier_holds_do_not_cut_a_reused_prefix_short(make_manager: Any) -> None:
    manager, driver = make(make_manager)
    head, tail = chained_keys("head", 4), chained_keys("tail", 3)
    for name in ("first", "reuse"):
        driver.store(name, head, fill_pattern)
        driver.run_until_idle()
    assert held(manager) == 4
    # head + tail: the held head is not offered to the policy; the new tail is refused...
    driver.store("longer", head + tail, fill_pattern)
    driver.run_until_idle()
    assert held(manager) == 4
    driver.store("head-again", head, fill_pattern)  # an offer of held blocks only
    driver.run_until_idle()
    # ...until a request reuses it, behind the held head.
    driver.store("longer-again", head + tail, fill_pattern)
    driver.run_until_idle()
    assert held(manager) == 7


def test_each_of_our_tiers_applies_the_policy(make_manager: Any) -> None:
    manager, driver = make(make_manager, tiers=2)
    keys = chained_keys("two-tiers", 3)
    driver.store("first", keys, fill_pattern)
    driver.run_until_idle()
    assert (held(manager, 0), held(manager, 1)) == (0, 0)
    driver.store("second", keys, fill_pattern)
    driver.run_until_idle()
    assert (held(manager, 0), held(manager, 1)) == (3, 3)


def test_only_an_admission_policy_asks_for_request_level_offload(make_manager: Any) -> None:
    with_policy, _ = make(make_manager)
    without, _ = make(make_manager, cascade_admission="all")
    ctx = ReqContext(req_id="r")
    assert tier_of(with_policy).on_new_request(ctx).policy is OffloadPolicy.REQUEST_LEVEL
    assert tier_of(without).on_new_request(ctx).policy is OffloadPolicy.CHUNK_LEVEL
    assert tier_of(without)._admission is None


def test_policy_options_are_checked_before_the_tier_starts(make_manager: Any) -> None:
    with pytest.raises(ValueError, match="history must be a number"):
        make(make_manager, cascade_admission={"name": "reuse", "history": -1})


# -- the same script through vLLM's manager and ours ------------------------------------------

#: Room for every prompt of a script: only its "evict" steps evict (the two CPU tiers'
#: LRU orders need not agree).
SCRIPT_CHUNKS = 64


def script(seed: int) -> list[tuple[str, int]]:
    """Operations: ("new", prompt), ("reuse", prompt) or ("evict", 0); prompts of 3 blocks."""
    rng = random.Random(seed)
    ops: list[tuple[str, int]] = [("new", 0)]
    prompts = 1
    for _ in range(14):
        roll = rng.random()
        if roll < 0.4:
            ops.append(("new", prompts))
            prompts += 1
        elif roll < 0.85:
            ops.append(("reuse", rng.randrange(prompts)))
        else:
            ops.append(("evict", 0))
    return ops


def vllm_holds(make_manager: Any, ops: list[tuple[str, int]]) -> set[bytes]:
    manager, driver = make(make_manager, num_chunks=SCRIPT_CHUNKS)
    for op, prompt in ops:
        if op == "evict":
            driver.evict_primary()
            continue
        # A reuse in the CPU tier is a second offer; one whose blocks left it, a second store.
        driver.store(f"{op}-{prompt}", chained_keys(f"p{prompt}", 3), fill_pattern)
        driver.run_until_idle()
    runtime = tier_of(manager).runtime
    return {bytes(k) for p in range(len(ops)) for k in chained_keys(f"p{p}", 3) if runtime.holds(k)}


def our_holds(ops: list[tuple[str, int]]) -> set[bytes]:
    primary = CPUPrimaryTier(SCRIPT_CHUNKS, BLOCK)
    tier = create_secondary_tier(
        {"type": "memory", "capacity_blocks": 64}, primary.kv_view, position=0
    )
    manager = TieringOffloadingManager(
        primary, [tier], cascade_admission=ReuseAdmission(SCRIPT_CHUNKS), metrics_registry=False
    )
    filler = 0
    try:
        for op, prompt in ops:
            keys = chained_keys(f"p{prompt}", 3)
            ctx = OurReqContext(f"{op}-{prompt}")
            if op == "evict":
                settle(manager)
                filler += 1
                out = manager.prepare_store(chained_keys(f"filler-{filler}", SCRIPT_CHUNKS), ctx)
                assert out is not None
                manager.complete_store(out.keys_to_store, success=False)
                continue
            if op == "reuse" and all(primary.is_ready(k) for k in keys):
                manager.touch(keys, ctx)  # a prefix hit in the CPU tier: the block is used
            else:
                out = manager.prepare_store(keys, ctx)
                assert out is not None
                manager.complete_store(out.keys_to_store)
            settle(manager)
        return {
            bytes(k) for p in range(len(ops)) for k in chained_keys(f"p{p}", 3) if tier.holds(k)
        }
    finally:
        manager.shutdown()


@pytest.mark.parametrize("seed", range(6))
def test_reuse_admits_under_vllm_what_it_admits_in_our_manager(
    make_manager: Any, seed: int
) -> None:
    ops = script(seed)
    ours_held = our_holds(ops)
    assert vllm_holds(make_manager, ops) == ours_held
    if any(op == "reuse" for op, _ in ops):
        assert ours_held  # the script exercised admission, not just refusals
