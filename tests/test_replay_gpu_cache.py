"""The replay's simulated GPU prefix cache."""

from __future__ import annotations

import pytest

from tiering.replay.gpu_cache import GPUPrefixCache


def test_pressure_trims_a_cached_prefix_from_its_end() -> None:
    cache = GPUPrefixCache(100)
    first = list(range(80))
    cache.admit(first)
    cache.admit(list(range(1000, 1040)))  # 20 blocks over capacity
    assert cache.evictions == 20
    # The tail of the first request went; its first 60 blocks still serve a prefix.
    assert cache.prefix_hits(first) == 60
    assert 59 in cache and 60 not in cache


def test_a_reused_prefix_becomes_most_recent() -> None:
    cache = GPUPrefixCache(6)
    cache.admit([1, 2, 3])
    cache.admit([4, 5, 6])
    cache.admit([1, 2])  # reused: now more recent than 4, 5, 6
    cache.admit([7, 8])
    assert cache.prefix_hits([1, 2, 3]) == 2  # 3 was the least recent
    assert cache.prefix_hits([4, 5, 6]) == 3 - 1  # 6, its tail, went before 4 and 5
    assert len(cache) == 6


def test_zero_capacity_holds_nothing_and_negative_is_refused() -> None:
    cache = GPUPrefixCache(0)
    cache.admit([1, 2, 3])
    assert len(cache) == 0 and cache.prefix_hits([1]) == 0
    with pytest.raises(ValueError, match="capacity_blocks must be >= 0"):
        GPUPrefixCache(-1)
