"""The replay loop against the real stack: the correctness anchor, policy agreement,
byte verification, promotion time-outs and a clean stop."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tiering.replay.offline import simulate_policy, unlimited_hit_rate
from tiering.replay.replayer import CPU, GPU, Replayer, ReplayStack, ReplayTotals
from tiering.replay.stack import build_stack
from tiering.replay.synthetic import SyntheticWorkload
from tiering.replay.trace import Request, read_trace, trace_footprint

SHARED_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"
BLOCK = 4096


@contextmanager
def stack_for(config: dict[str, Any]) -> Iterator[ReplayStack]:
    stack = build_stack(config, block_bytes=BLOCK, block_tokens=512)
    try:
        yield stack
    finally:
        stack.shutdown()


def replay(
    config: dict[str, Any], requests: Sequence[Request], gpu_blocks: int = 0, **options: Any
) -> tuple[ReplayTotals, ReplayStack]:
    with stack_for(config) as stack:
        totals = Replayer(stack, gpu_blocks=gpu_blocks, **options).run(requests)
    return totals, stack


def hit_tokens(totals: ReplayTotals) -> int:
    return sum(tally.tokens for tally in totals.hits.values())


def check_accounting(totals: ReplayTotals, requests: Sequence[Request]) -> None:
    assert totals.requests_done == len(requests)
    assert totals.total_tokens == sum(r.input_length for r in requests)
    assert totals.mismatches == 0
    assert totals.drained
    # Everything loaded to the GPU was a CPU or secondary hit, and was verified.
    offloaded = sum(t.blocks for place, t in totals.hits.items() if place != GPU)
    assert totals.blocks_loaded == totals.verified_blocks == offloaded


def test_unlimited_capacity_matches_the_offline_hit_rate_through_promotions() -> None:
    requests = SyntheticWorkload(num_requests=400, seed=11).generate()
    footprint = trace_footprint(requests)
    # A small GPU cache and CPU tier: most hits must be promoted from the memory tier.
    config = {
        "cpu_bytes_to_use": 64 * BLOCK,
        "secondary_tiers": [{"type": "memory"}],
        # Back-pressure only when no primary row is left: a loaded machine's slow loop
        # thread then rarely turns a hit into a miss (a promotion with no room).
        "cascade_max_pinned_fraction": 1.0,
    }
    totals, stack = replay(config, requests, gpu_blocks=16)
    check_accounting(totals, requests)
    expected = unlimited_hit_rate(requests)
    rate = hit_tokens(totals) / totals.total_tokens
    stats = stack.stats()
    refusals = (
        stats.promotion_no_room + stats.primary.dropped + sum(t.dropped for t in stats.secondary)
    )
    if refusals == 0:  # every hit the offline count promises arrived
        assert rate == pytest.approx(expected.token_hit_rate, abs=0.001)
    else:  # e.g. a promotion found every row pinned by jobs in flight: that request missed
        assert expected.token_hit_rate - 0.05 < rate <= expected.token_hit_rate + 1e-9
    assert totals.hits["memory"].blocks > footprint // 4
    assert totals.hits[CPU].blocks > 0 and totals.hits[GPU].blocks > 0
    assert totals.blocks_promoted_used == totals.hits["memory"].blocks
    assert totals.promotion_timeouts == totals.lost_before_load == 0


def test_the_shared_trace_at_unlimited_capacity_hits_65_percent_like_the_offline_count() -> None:
    requests = read_trace(SHARED_TRACE)
    footprint = trace_footprint(requests)
    totals, stack = replay({"cpu_bytes_to_use": footprint * BLOCK}, requests)
    check_accounting(totals, requests)
    rate = hit_tokens(totals) / totals.total_tokens
    assert rate == pytest.approx(unlimited_hit_rate(requests).token_hit_rate, abs=0.001)
    assert rate == pytest.approx(0.651, abs=0.005)
    assert stack.stats().primary.evictions == 0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_cpu_tier_hits_exactly_what_the_offline_policy_simulation_predicts(
    policy: str,
) -> None:
    requests = SyntheticWorkload(num_requests=300, seed=5).generate()
    capacity = 150
    config = {"cpu_bytes_to_use": capacity * BLOCK, "eviction_policy": policy}
    totals, stack = replay(config, requests)
    check_accounting(totals, requests)
    predicted = simulate_policy(requests, capacity, policy)
    assert totals.hits[CPU].tokens == predicted.hit_tokens
    assert totals.hits[CPU].blocks == predicted.hit_blocks
    assert stack.stats().primary.evictions > 0  # capacity really was the limit
    assert predicted.hit_tokens < unlimited_hit_rate(requests).hit_tokens


def test_a_gpu_cache_serves_reuse_before_the_tiers() -> None:
    requests = SyntheticWorkload(num_requests=200, seed=2).generate()
    config = {"cpu_bytes_to_use": 4096 * BLOCK}
    without_gpu, _ = replay(config, requests)
    with_gpu, _ = replay(config, requests, gpu_blocks=200)
    assert with_gpu.hits[GPU].tokens > 0
    assert hit_tokens(with_gpu) == hit_tokens(without_gpu)  # the CPU tier holds it all anyway
    assert with_gpu.blocks_loaded < without_gpu.blocks_loaded


CORRUPTING = "tests.replay_faults:CorruptingMemoryTier"


def test_silently_corrupted_promotions_are_failed_by_the_runtime_and_become_misses() -> None:
    requests = SyntheticWorkload(num_requests=150, seed=4).generate()
    config = {
        "cpu_bytes_to_use": 32 * BLOCK,
        "secondary_tiers": [{"type": CORRUPTING, "corrupt_rate": 1.0}],
    }
    totals, stack = replay(config, requests)
    # The runtime's store-time checksum fails every corrupted load before the bytes count:
    # the replay never sees a wrong block, and the tier's promotions are failures.
    check_accounting(totals, requests)
    assert stack.stats().tier(CORRUPTING).failures > 0
    assert totals.hits[CORRUPTING].blocks == 0
    assert hit_tokens(totals) < unlimited_hit_rate(requests).hit_tokens


def test_the_replay_catches_corruption_that_reaches_the_primary_tier() -> None:
    # With the runtime's verification off, corrupted bytes land in the primary tier: the
    # replay's own byte-for-byte check is then the last line and must catch them.
    requests = SyntheticWorkload(num_requests=150, seed=4).generate()
    config = {
        "cpu_bytes_to_use": 32 * BLOCK,
        "secondary_tiers": [{"type": CORRUPTING, "corrupt_rate": 1.0, "verify": False}],
    }
    totals, _ = replay(config, requests)
    assert totals.mismatches > 0
    assert totals.mismatch_examples[0].source == CORRUPTING
    # A corrupt block (and what follows it in the prefix) is a miss, not a hit.
    assert totals.hits[CORRUPTING].blocks == 0
    assert hit_tokens(totals) < unlimited_hit_rate(requests).hit_tokens


def test_promotions_slower_than_the_timeout_become_misses() -> None:
    requests = SyntheticWorkload(num_requests=60, seed=8).generate()
    config = {
        "cpu_bytes_to_use": 16 * BLOCK,
        "secondary_tiers": [{"type": "tests.replay_faults:SlowMemoryTier", "delay_s": 0.05}],
    }
    totals, _ = replay(config, requests, promotion_timeout_s=0.01)
    assert totals.promotion_timeouts > 0
    assert totals.mismatches == 0
    assert totals.requests_done == len(requests)


def test_stores_refused_while_cascades_pin_the_cpu_tier_wait_for_them_or_are_dropped() -> None:
    requests = SyntheticWorkload(num_requests=30, seed=9).generate()
    config = {
        "cpu_bytes_to_use": 48 * BLOCK,
        "secondary_tiers": [
            {"type": "tests.replay_faults:SlowMemoryTier", "delay_s": 0.02, "ops": "write"}
        ],
    }
    impatient, _ = replay(config, requests, store_wait_s=0)
    assert impatient.store_rejected_blocks > 0 and not impatient.store_stalls.samples
    assert impatient.retried_refusal_blocks == 0
    with stack_for(config) as stack:
        patient = Replayer(stack, gpu_blocks=0, store_wait_s=30).run(requests)
        refused = stack.stats().primary.dropped  # the manager counts every refusal
    assert patient.store_rejected_blocks == 0 and patient.store_stalls.samples
    assert patient.blocks_stored > impatient.blocks_stored
    assert patient.mismatches == impatient.mismatches == 0
    # Each refusal the replay retried is one the report must not count as dropped.
    assert refused > 0 and refused - patient.retried_refusal_blocks == 0


def test_a_stop_request_ends_the_run_early_and_cleanly() -> None:
    requests = SyntheticWorkload(num_requests=300, seed=1).generate()
    with stack_for(
        {"cpu_bytes_to_use": 64 * BLOCK, "secondary_tiers": [{"type": "memory"}]}
    ) as stack:
        replayer = Replayer(stack, gpu_blocks=8)

        def stop_at_50(totals: ReplayTotals) -> None:
            if totals.requests_done == 50:
                replayer.request_stop()

        totals = replayer.run(requests, stop_at_50)
        assert totals.interrupted and totals.requests_done == 50
        assert totals.drained and stack.stats().jobs_in_flight == 0
    assert totals.mismatches == 0
    assert totals.total_tokens == sum(r.input_length for r in requests[:50])
