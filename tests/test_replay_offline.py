"""Offline hit-rate simulations: the unlimited ceiling, the policies and Belady's optimum."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Sequence
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.policies import POLICY_NAMES, make_policy
from tiering.replay.offline import (
    simulate_belady,
    simulate_policy,
    unlimited_hit_rate,
)
from tiering.replay.trace import Request, read_trace, trace_footprint

SHARED_TRACE = Path(__file__).resolve().parent / "data" / "mooncake_synthetic_trace.jsonl.gz"


def _req(*ids: int, tokens: int | None = None) -> Request:
    return Request(0.0, tokens if tokens is not None else 512 * len(ids), 0, tuple(ids))


def test_unlimited_counts_leading_seen_blocks_weighted_by_tokens() -> None:
    requests = [
        _req(1, 2, 3),
        _req(1, 2, 4, tokens=1024 + 100),  # two leading hits of 512 tokens
        _req(1, 5, 3),  # 3 was seen, but after a miss: not a prefix hit
        _req(1, 2, 4, tokens=1024 + 100),  # all three: 1124 tokens
    ]
    hits = unlimited_hit_rate(requests)
    assert hits.hit_tokens == 0 + 1024 + 512 + 1124
    assert hits.total_tokens == 1536 + 1124 + 1536 + 1124
    assert hits.hit_blocks == 0 + 2 + 1 + 3
    assert hits.total_blocks == 12


def test_the_shared_trace_reuses_about_65_percent_of_tokens() -> None:
    assert unlimited_hit_rate(read_trace(SHARED_TRACE)).token_hit_rate == pytest.approx(
        0.6512, abs=0.0005
    )


@st.composite
def prefix_traces(draw: st.DrawFn, max_requests: int = 25, max_blocks: int = 6) -> list[Request]:
    """Traces whose block ids behave like prefix hashes: each id has one fixed parent."""
    parents: dict[int, int] = {}  # id -> parent id (-1 for a root)
    children: dict[int, list[int]] = {-1: []}
    requests = []
    for _ in range(draw(st.integers(1, max_requests))):
        length = draw(st.integers(1, max_blocks))
        ids: list[int] = []
        parent = -1
        for _ in range(length):
            known = children.setdefault(parent, [])
            if known and draw(st.booleans()):
                block = draw(st.sampled_from(known))
            else:
                block = len(parents)
                parents[block] = parent
                known.append(block)
            ids.append(block)
            parent = block
        tail = draw(st.integers(1, 512))
        requests.append(Request(0.0, 512 * (length - 1) + tail, 0, tuple(ids)))
    return requests


@given(prefix_traces(), st.integers(1, 12))
def test_belady_bounds_every_policy_and_the_ceiling_bounds_belady(
    requests: list[Request], capacity: int
) -> None:
    optimum = simulate_belady(requests, capacity)
    ceiling = unlimited_hit_rate(requests)
    assert optimum.hit_blocks <= ceiling.hit_blocks
    for name in POLICY_NAMES:
        hits = simulate_policy(requests, capacity, name)
        assert hits.hit_blocks <= optimum.hit_blocks, name
    if capacity >= trace_footprint(requests):
        assert optimum == ceiling
        assert all(simulate_policy(requests, capacity, n) == ceiling for n in POLICY_NAMES)


@given(st.lists(st.integers(0, 12), max_size=80), st.integers(1, 8))
def test_lru_policy_is_a_stack_algorithm(references: list[int], capacity: int) -> None:
    """On a plain reference stream a bigger LRU cache always holds a superset of a smaller one."""
    smaller, larger = make_policy("lru", capacity), make_policy("lru", capacity + 1)
    for key in references:
        for policy, size in ((smaller, capacity), (larger, capacity + 1)):
            if key in policy:
                policy.access(key)
                continue
            if len(policy) == size:
                policy.evict(1, lambda _key: True)
            policy.insert(key)
        assert all(k in larger for k in range(13) if k in smaller)


def test_lru_under_the_engine_protocol_is_not_a_stack_algorithm() -> None:
    """Why the simulator's LRU hits can fall as the cache grows (found by Hypothesis).

    The engine touches a request's cached blocks, then stores the missing ones. A
    block cached only in the bigger cache takes its recency from the touch, older
    than the request's newly stored blocks; in the smaller cache it is stored with
    them, head last, and outlives them. So the two caches rank the same blocks
    differently and keep different ones: here the last request hits 2 blocks with a
    4-block cache and 1 with a 5-block cache.
    """
    requests = [
        _req(0, tokens=1),
        _req(1, tokens=1),
        _req(2, 3, 4, 5, tokens=1537),
        _req(1, 6, 7, 8, tokens=1537),
        _req(9, tokens=1),
        _req(10, tokens=1),
        _req(1, 6, tokens=513),
    ]
    assert simulate_policy(requests, 4, "lru").hit_blocks == 2
    assert simulate_policy(requests, 5, "lru").hit_blocks == 1


def _best_possible_block_hits(requests: Sequence[Request], capacity: int) -> int:
    """Exhaustive search over every caching decision (tiny traces only)."""
    accesses = [block for r in requests for block in r.hash_ids]

    @functools.cache
    def search(position: int, cache: frozenset[int]) -> int:
        if position == len(accesses):
            return 0
        block = accesses[position]
        if block in cache:
            return 1 + search(position + 1, cache)
        best = search(position + 1, cache)  # bypass
        if len(cache) < capacity:
            return max(best, search(position + 1, cache | {block}))
        for victim in cache:
            best = max(best, search(position + 1, (cache - {victim}) | {block}))
        return best

    return search(0, frozenset())


@given(prefix_traces(max_requests=4, max_blocks=3), st.integers(1, 3))
def test_belady_is_optimal_on_tiny_traces(requests: list[Request], capacity: int) -> None:
    assert simulate_belady(requests, capacity).hit_blocks == _best_possible_block_hits(
        requests, capacity
    )


def test_policies_differ_where_they_should() -> None:
    # A scan of one-off blocks between reuses of a hot pair: LRU loses the pair, the
    # optimum keeps it.
    requests = list(
        itertools.chain.from_iterable(
            [_req(1, 2), _req(100 + 3 * i), _req(101 + 3 * i), _req(102 + 3 * i)] for i in range(10)
        )
    )
    assert simulate_policy(requests, 3, "lru").hit_blocks == 0
    assert simulate_belady(requests, 3).hit_blocks == 18
