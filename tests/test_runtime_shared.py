"""Shared tiers (``shared = True``): lookups of unknown keys resolved in the background."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from tests.runtime_support import (
    BLOCK,
    SharedStore,
    SharedTier,
    fill,
    key,
    load,
    one_result,
    primary,
    store,
    wait_until,
)
from tiering.core.keys import NO_CONTEXT
from tiering.runtime import AsyncTierManager


@pytest.fixture
def medium() -> SharedStore:
    return SharedStore()


@pytest.fixture
def buf() -> np.ndarray:
    return primary()


def test_unknown_key_answers_none_then_the_resolved_answer_which_is_cached(
    medium: SharedStore, buf: np.ndarray
) -> None:
    tier = SharedTier(medium)
    with AsyncTierManager(tier, buf.data, "shared") as manager:
        medium.blocks[key(1)] = b"\x01" * BLOCK  # another process stored it
        assert manager.lookup(key(1), NO_CONTEXT) is None
        wait_until(lambda: manager.lookup(key(1), NO_CONTEXT) is True)
        calls = len(tier.contains_calls)
        for _ in range(100):
            assert manager.lookup(key(1), NO_CONTEXT) is True
        assert len(tier.contains_calls) == calls  # cached: no new round trip


def test_absent_answers_are_cached(medium: SharedStore, buf: np.ndarray) -> None:
    tier = SharedTier(medium)
    with AsyncTierManager(tier, buf.data, "shared", shared_absent_ttl_s=600) as manager:
        assert manager.lookup(key(2), NO_CONTEXT) is None
        wait_until(lambda: manager.lookup(key(2), NO_CONTEXT) is False)
        calls = len(tier.contains_calls)
        medium.blocks[key(2)] = b"\x02" * BLOCK  # appears behind our back...
        for _ in range(100):
            assert manager.lookup(key(2), NO_CONTEXT) is False  # ...unseen within the TTL
        assert len(tier.contains_calls) == calls


def test_absent_answers_expire_and_are_asked_again(medium: SharedStore, buf: np.ndarray) -> None:
    tier = SharedTier(medium)
    with AsyncTierManager(tier, buf.data, "shared", shared_absent_ttl_s=0.05) as manager:
        assert manager.lookup(key(2), NO_CONTEXT) is None
        wait_until(lambda: manager.lookup(key(2), NO_CONTEXT) is not None)
        calls = len(tier.contains_calls)
        medium.blocks[key(2)] = b"\x02" * BLOCK  # appears behind our back
        wait_until(lambda: manager.lookup(key(2), NO_CONTEXT) is True)
        assert len(tier.contains_calls) > calls


def test_lookups_of_many_unknown_keys_are_batched(medium: SharedStore, buf: np.ndarray) -> None:
    checks_may_finish = threading.Event()
    tier = SharedTier(medium, gate=checks_may_finish)
    keys = [key(i) for i in range(200)]
    for k in keys[::2]:
        medium.blocks[k] = b"\x00" * BLOCK
    with AsyncTierManager(tier, buf.data, "shared") as manager:
        assert all(manager.lookup(k, NO_CONTEXT) is None for k in keys)
        # Asking again while the check runs (held open by the gate) sends nothing new.
        assert all(manager.lookup(k, NO_CONTEXT) is None for k in keys[:10])
        checks_may_finish.set()
        wait_until(lambda: all(manager.lookup(k, NO_CONTEXT) is not None for k in keys))
        assert [manager.lookup(k, NO_CONTEXT) for k in keys] == [True, False] * 100
        asked = [k for call in tier.contains_calls for k in call]
        assert sorted(asked) == sorted(keys)  # each key asked once
        assert len(tier.contains_calls) < 50  # and in batches, not one round trip per key
        assert max(len(c) for c in tier.contains_calls) <= tier.max_concurrency


def test_store_skips_keys_another_process_already_stored(
    medium: SharedStore, buf: np.ndarray
) -> None:
    with AsyncTierManager(SharedTier(medium), buf.data, "shared") as manager:
        medium.blocks[key(1)] = b"\x01" * BLOCK
        fill(buf, 0)
        fill(buf, 1)
        manager.submit_store(store(1, [key(1), key(2)], [0, 1]))
        result = one_result(manager)
        assert result.success and result.transfer_bytes == BLOCK
        assert medium.blocks[key(1)] == b"\x01" * BLOCK  # not overwritten
        assert manager.lookup(key(1), NO_CONTEXT) is True
        assert manager.lookup(key(2), NO_CONTEXT) is True


def test_loads_read_blocks_only_others_stored_and_learn_from_misses(
    medium: SharedStore, buf: np.ndarray
) -> None:
    with AsyncTierManager(SharedTier(medium), buf.data, "shared") as manager:
        medium.blocks[key(1)] = b"\x05" * BLOCK
        manager.submit_load(load(1, [key(1)], [3]))
        assert one_result(manager).success
        assert bytes(buf[3]) == b"\x05" * BLOCK
        assert manager.lookup(key(1), NO_CONTEXT) is True
        del medium.blocks[key(1)]  # evicted by another process
        manager.submit_load(load(2, [key(1)], [4]))
        failed = one_result(manager)
        assert not failed.success and "BlockNotFound" in (failed.error or "")
        assert manager.lookup(key(1), NO_CONTEXT) is False
        assert list(manager.take_events()) == [([key(1)], True)]


def test_present_answers_age_so_a_block_evicted_behind_our_back_turns_absent(
    medium: SharedStore, buf: np.ndarray
) -> None:
    tier = SharedTier(medium)
    with AsyncTierManager(
        tier, buf.data, "shared", shared_present_ttl_s=0.2, shared_absent_ttl_s=600
    ) as manager:
        fill(buf, 0)
        manager.submit_store(store(1, [key(1)], [0]))
        assert one_result(manager).success
        assert manager.lookup(key(1), NO_CONTEXT) is True
        del medium.blocks[key(1)]  # the server evicted it
        # The present answer is forgotten after its TTL, asked again, and found absent.
        wait_until(lambda: manager.lookup(key(1), NO_CONTEXT) is False)
        assert any(key(1) in call for call in tier.contains_calls)


def test_known_present_answers_are_bounded(medium: SharedStore, buf: np.ndarray) -> None:
    tier = SharedTier(medium)
    keys = [key(i) for i in range(6)]
    with AsyncTierManager(tier, buf.data, "shared", shared_max_known_keys=4) as manager:
        for i, k in enumerate(keys):
            fill(buf, i)
            manager.submit_store(store(i + 1, [k], [i]))
            assert one_result(manager).success
        assert manager.stats().blocks_held == 4
        # The two oldest answers were forgotten, not removed: asked again, still there.
        assert manager.lookup(keys[0], NO_CONTEXT) is None
        wait_until(lambda: manager.lookup(keys[0], NO_CONTEXT) is True)
        assert all(manager.lookup(k, NO_CONTEXT) is True for k in keys[3:])
        assert not any(removed for _, removed in manager.take_events())


def test_shared_knowledge_options_are_checked(buf: np.ndarray) -> None:
    from tiering.core.errors import ConfigError

    with pytest.raises(ConfigError, match="shared_present_ttl_s must be a positive number"):
        AsyncTierManager(SharedTier(SharedStore()), buf.data, "s", shared_present_ttl_s=0)
    with pytest.raises(ConfigError, match="shared_max_known_keys must be a positive int"):
        AsyncTierManager(SharedTier(SharedStore()), buf.data, "s", shared_max_known_keys=0)
