"""Recency read from use stamps: ARC's and kvaware's two resident lists, merged by stamp,
are the LRU order of the resident set, which the adaptive policy's LRU expert evicts by.

The model is a plain list in use order (LRU's own definition), driven alongside the
policy by every operation; ``least_recent`` must take exactly the first evictable keys
of that list, and ``recency_order`` must be that list.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.policies import AdaptivePolicy, ARCPolicy, KVAwarePolicy, LRUPolicy
from tiering.policies.recency import least_recent

DERANDOMIZED = settings(derandomize=True, max_examples=300)

# Few keys and long runs: most operations meet resident keys, in both lists.
KEYS = st.integers(0, 8)
OPS = st.lists(
    st.one_of(
        st.tuples(st.just("insert"), KEYS),
        st.tuples(st.just("access"), KEYS),
        st.tuples(st.just("refresh"), KEYS),
        st.tuples(st.just("remove"), KEYS),
        st.tuples(st.just("evict"), st.integers(1, 3), st.integers(0, 3)),
        st.tuples(st.just("least_recent"), st.integers(1, 3), st.integers(0, 3)),
    ),
    min_size=30,
    max_size=150,
)


def _unpinned(modulus: int) -> Callable[[int], bool]:
    # Keys divisible by ``modulus`` are pinned (modulus 0: none), so walks must skip them.
    return lambda key: modulus == 0 or key % modulus != 0


@pytest.mark.parametrize("expert", [ARCPolicy, KVAwarePolicy])
@DERANDOMIZED
@given(ops=OPS)
def test_least_recent_is_the_lru_order_of_the_resident_set(
    expert: type[ARCPolicy[int]] | type[KVAwarePolicy[int]], ops: list[tuple[object, ...]]
) -> None:
    policy = expert(6)
    model: list[int] = []  # resident keys, least recently used first
    for op in ops:
        name = op[0]
        if name == "insert":
            key = op[1]
            assert isinstance(key, int)
            if key in model:
                continue
            if len(model) == policy.capacity:
                model.remove(policy.least_recent(1, _unpinned(0))[0])
            policy.insert(key)
            model.append(key)
        elif name in ("access", "refresh"):
            key = op[1]
            getattr(policy, name)(key)
            if key in model:  # a use, counted or not, makes it the most recent
                model.remove(key)
                model.append(key)
        elif name == "remove":
            policy.remove(op[1])
            if op[1] in model:
                model.remove(op[1])
        else:
            n, modulus = op[1], op[2]
            assert isinstance(n, int) and isinstance(modulus, int)
            can_evict = _unpinned(modulus)
            if name == "evict":  # the policy's own choice: the model only forgets them
                for key in policy.evict(n, can_evict):
                    model.remove(key)
            else:
                expected = [key for key in model if can_evict(key)][:n]
                assert policy.least_recent(n, can_evict) == expected
                for key in expected:
                    model.remove(key)
        assert list(policy.recency_order()) == model
        policy.check_invariants()


def test_least_recent_merges_both_lists_and_removes_only_what_it_returns() -> None:
    first: OrderedDict[str, int] = OrderedDict(a=1, c=4, e=7)
    second: OrderedDict[str, int] = OrderedDict(b=2, d=5, f=6)
    assert least_recent(first, second, 3, lambda key: key != "b") == ["a", "c", "d"]
    assert list(first) == ["e"] and list(second) == ["b", "f"]
    assert least_recent(first, second, 5, lambda key: True) == ["b", "f", "e"]
    assert not first and not second
    assert least_recent(first, second, 0, lambda key: True) == []


def test_a_use_order_that_is_not_increasing_fails_the_invariants() -> None:
    policy: ARCPolicy[int] = ARCPolicy(4)
    policy.insert(1)
    policy.insert(2)
    policy._t1[1] = 99  # as a bug that stamps a key without moving it would leave it
    with pytest.raises(AssertionError, match="T1 is not in use order"):
        policy.check_invariants()


@pytest.mark.parametrize("expert", ["arc", "kvaware"])
def test_adaptive_following_lru_evicts_as_lru_does(expert: str) -> None:
    """Followed from the start (``start="lru"``, never switching), the adaptive policy
    chooses LRU's victims, with the LRU order read from its reuse expert's stamps."""
    adaptive: AdaptivePolicy[int] = AdaptivePolicy(
        8, expert=expert, start="lru", margin=1.0, guided=False
    )
    lru: LRUPolicy[int] = LRUPolicy(8)
    uses = [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8, 4, 6, 2, 6, 4, 3, 3, 8]
    for step, key in enumerate(uses * 3):
        key = (key * (step // len(uses) + 1)) % 13
        if key in lru:
            lru.access(key)
            adaptive.access(key)
            continue
        if len(lru) == 8:
            can_evict = _unpinned(step % 5 + 2)
            assert adaptive.evict(2, can_evict) == lru.evict(2, can_evict)
        lru.insert(key)
        adaptive.insert(key)
        assert list(adaptive) == list(lru)
    assert adaptive.following == "lru"
