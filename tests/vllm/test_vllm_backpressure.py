"""Back-pressure of our tiers under vLLM's manager: on by default, drops and counts.

vLLM gives a tier a detector only when ``backpressure`` is configured; our
tiers then install the pinned-share rule of our own manager. A tier that falls
behind gets its cascades dropped (counted by our detector and by vLLM's
``backpressure_blocks_dropped`` metric), and gets them again once it catches up.
The detector's clock is the test's, so "behind" does not depend on timing.
"""

from __future__ import annotations

import time
from typing import Any

from vllm.v1.kv_offload.base import LookupResult
from vllm.v1.kv_offload.tiering.backpressure import EMABackpressureDetector
from vllm.v1.kv_offload.tiering.base import TieringOffloadingMetrics

from tests.vllm.test_vllm_tiers import Metrics, _ctx, ours, tier_of
from tiering.integrations.vllm.backpressure import PinnedShareDetector
from tiering.integrations.vllm.driver import chained_keys, fill_pattern


def test_our_tiers_have_back_pressure_unless_vllms_is_configured(make_manager: Any) -> None:
    manager, _ = make_manager([ours("KVTieringMemoryTier")], num_chunks=32)
    detector = tier_of(manager).bp_detector
    assert isinstance(detector, PinnedShareDetector) and detector.budget_blocks == 8
    manager, _ = make_manager(
        [ours("KVTieringMemoryTier")],
        num_chunks=32,
        extra_config={"cascade_max_pinned_fraction": 0.5},
    )
    assert tier_of(manager).bp_detector.budget_blocks == 16
    configured = ours(
        "KVTieringMemoryTier", backpressure={"backpressure_cls": "EMABackpressureDetector"}
    )
    manager, _ = make_manager([configured], num_chunks=32)
    assert isinstance(tier_of(manager).bp_detector, EMABackpressureDetector)


def gated() -> dict[str, Any]:
    """A memory tier whose writes wait until the test opens its gate (a tier that is behind)."""
    return ours("KVTieringTier", tier="tests.manager_helpers:GatedMemoryTier")


def test_a_tier_behind_its_share_loses_cascades_counted_then_catches_up(
    make_manager: Any,
) -> None:
    manager, driver = make_manager([gated()], num_chunks=32)  # a share of 8 chunks
    metrics = Metrics(manager)
    label = f"1:{tier_of(manager).tier_type}"
    tier = tier_of(manager)
    gate, detector = tier.runtime.tier.gate, tier.bp_detector
    driver.store("first", chained_keys("bp-first", 6), fill_pattern)  # 6 chunks in flight
    detector._clock = lambda: time.monotonic() + 1.0  # the first cascade is now "old"
    driver.store("second", chained_keys("bp-second", 4), fill_pattern)  # 6 + 4 > 8
    assert detector.dropped_blocks == 4 and detector.is_under_pressure()
    assert metrics.total(TieringOffloadingMetrics.BACKPRESSURE_BLOCKS_DROPPED, label) == 4
    gate.set()  # the tier catches up
    driver.run_until_idle(timeout_s=10)
    driver.store("third", chained_keys("bp-third", 4), fill_pattern)
    driver.run_until_idle(timeout_s=10)
    assert detector.dropped_blocks == 4 and not detector.is_under_pressure()
    assert tier.stats().blocks_held == 10  # first and third, not second


def test_a_tier_behind_answers_miss_rather_than_promote_behind_its_backlog(
    make_manager: Any,
) -> None:
    manager, driver = make_manager([gated()], num_chunks=32)
    tier = tier_of(manager)
    gate, detector = tier.runtime.tier.gate, tier.bp_detector
    held = chained_keys("bp-held", 4)
    gate.set()
    driver.store("held", held, fill_pattern)
    driver.run_until_idle(timeout_s=10)
    assert tier.lookup(held[0], _ctx()) == LookupResult.HIT
    gate.clear()  # the tier falls behind
    driver.store("slow", chained_keys("bp-slow", 8), fill_pattern)  # 8 of a share of 8
    detector._clock = lambda: time.monotonic() + 1.0
    assert tier.lookup(held[0], _ctx()) == LookupResult.MISS
    assert detector.refused_hits == 1
    gate.set()
    driver.run_until_idle(timeout_s=10)
    assert tier.lookup(held[0], _ctx()) == LookupResult.HIT  # caught up
