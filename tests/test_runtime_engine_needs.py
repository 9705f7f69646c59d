"""Runtime behaviour an engine's own tiering manager relies on (vLLM 0.33's, first).

- A key whose load failed answers False for ``failed_load_backoff_s``: vLLM's
  manager promotes every secondary-tier HIT again at once, so without it a
  block whose reads keep failing would be retried every step forever.
- Replaying ``take_events`` gives exactly what the tier holds, also when one
  store job writes more blocks than the tier keeps (it evicts some of its own).
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.runtime_support import fill, key, load, one_result, primary, results, store
from tiering.core.errors import ConfigError
from tiering.core.keys import NO_CONTEXT
from tiering.runtime import AsyncTierManager, Presence
from tiering.testing.faults import FaultPlan, FaultyTier
from tiers.memory import MemoryTier


@pytest.fixture
def buf() -> np.ndarray:
    return primary()


def _stored_then_failing(buf: np.ndarray, backoff_s: float) -> tuple[AsyncTierManager, list]:
    tier = FaultyTier(MemoryTier())
    manager = AsyncTierManager(tier, buf.data, "memory", failed_load_backoff_s=backoff_s)
    keys = [key(i) for i in range(4)]
    for row in range(4):
        fill(buf, row)
    manager.submit_store(store(1, keys, [0, 1, 2, 3]))
    assert one_result(manager).success
    tier.plan = FaultPlan(error_rate=1.0, ops={"read"}, keys={keys[1], keys[2]})
    manager.submit_load(load(2, keys, [10, 11, 12, 13]))
    result = one_result(manager)
    assert not result.success and result.successful_keys == frozenset({keys[0], keys[3]})
    tier.plan = FaultPlan()
    return manager, keys


def test_failed_loads_answer_absent_for_the_backoff(buf: np.ndarray) -> None:
    manager, keys = _stored_then_failing(buf, backoff_s=60)
    with manager:
        # The blocks that failed are a miss; the ones that loaded stay hits.
        assert [manager.lookup(k, NO_CONTEXT) for k in keys] == [True, False, False, True]
        assert manager.lookup_state(keys[1]) is Presence.ABSENT
        # The back-off runs out: the failures are made a minute old rather than waited for
        # (a short back-off and a sleep race the machine's load).
        for k in list(manager._failed_loads):
            manager._failed_loads[k] -= 61
        # After the backoff the tier is asked again (its reads work again).
        assert manager.lookup(keys[1], NO_CONTEXT) is True
        manager.submit_load(load(3, keys[1:3], [14, 15]))
        assert one_result(manager).success


def test_a_new_store_of_the_key_ends_its_backoff(buf: np.ndarray) -> None:
    manager, keys = _stored_then_failing(buf, backoff_s=60)
    with manager:
        assert manager.lookup(keys[2], NO_CONTEXT) is False
        manager.submit_store(store(4, [keys[2]], [2]))
        assert one_result(manager).success
        assert manager.lookup(keys[2], NO_CONTEXT) is True


def test_without_backoff_a_failed_load_leaves_lookups_alone(buf: np.ndarray) -> None:
    manager, keys = _stored_then_failing(buf, backoff_s=0)
    with manager:
        # An I/O error says nothing about presence: the default answers from the view.
        assert manager.lookup(keys[1], NO_CONTEXT) is True


@pytest.mark.parametrize("bad", [-1, "10", True, float("nan")])
def test_backoff_must_be_a_non_negative_number(buf: np.ndarray, bad: object) -> None:
    with pytest.raises(ConfigError, match="failed_load_backoff_s"):
        AsyncTierManager(MemoryTier(), buf.data, "memory", failed_load_backoff_s=bad)  # type: ignore[arg-type]


def test_events_replay_to_what_the_tier_holds_when_a_job_evicts_its_own_blocks(
    buf: np.ndarray,
) -> None:
    with AsyncTierManager(MemoryTier(capacity_blocks=4), buf.data, "memory") as manager:
        keys = [key(i) for i in range(10)]
        for row in range(10):
            fill(buf, row)
        manager.submit_store(store(1, keys[:2], [0, 1]))
        results(manager)
        manager.submit_store(store(2, keys[2:], list(range(2, 10))))  # 8 blocks into 4
        results(manager)
        held: set[bytes] = set()
        for event_keys, removed in manager.take_events():
            if removed:
                assert set(event_keys) <= held, "removal of a block never announced"
                held -= set(event_keys)
            else:
                held |= set(event_keys)
        assert held == set(keys[-4:])
        assert {k for k in keys if manager.lookup(k, NO_CONTEXT)} == held
        assert manager.stats().blocks_held == 4
