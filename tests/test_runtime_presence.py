"""KnownPresent: a tier's "present" knowledge, exact for private tiers, aging for shared ones."""

from __future__ import annotations

import gc

from hypothesis import given
from hypothesis import strategies as st

from tiering.core.keys import make_offload_key
from tiering.runtime.presence import KnownPresent


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def k(i: int) -> bytes:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def test_private_knowledge_never_ages() -> None:
    known = KnownPresent()
    for i in range(1000):
        known.add(k(i))
    known.add(k(3))  # again: still known, once
    known.discard(k(4))
    assert not known.ages and known.expire() == [] and len(known) == 999
    assert k(3) in known and k(4) not in known and known.issuperset([k(0), k(999)])


def test_private_knowledge_leaves_the_garbage_collectors_lists() -> None:
    """A tier's every block is in its view: a full collection (GIL held) must not walk them.
    Shared knowledge keeps its learning order, which needs an OrderedDict (always tracked)."""
    known, shared = KnownPresent(), KnownPresent(max_keys=10)
    for i in range(100):
        known.add(k(i))
        shared.add(k(i))
    gc.collect()
    assert not gc.is_tracked(known._keys)
    assert gc.is_tracked(shared._keys) and len(shared) == 10


def test_answers_expire_oldest_first_and_a_refresh_restarts_the_clock() -> None:
    clock = Clock()
    known = KnownPresent(ttl_s=10, clock=clock)
    known.add(k(1))
    clock.now = 4
    known.add(k(2))
    clock.now = 8
    known.add(k(1))  # refreshed: now newer than k(2)
    clock.now = 14
    assert known.expire() == [k(2)]
    assert k(1) in known and k(2) not in known
    clock.now = 18
    assert known.expire() == [k(1)] and len(known) == 0


OPS = st.lists(
    st.tuples(st.sampled_from(["add", "discard", "tick", "expire"]), st.integers(0, 12)),
    max_size=200,
)


@given(OPS, st.integers(1, 6), st.integers(1, 5))
def test_matches_a_reference_model(ops: list[tuple[str, int]], max_keys: int, ttl: int) -> None:
    clock = Clock()
    known = KnownPresent(ttl_s=ttl, max_keys=max_keys, clock=clock)
    model: dict[bytes, float] = {}  # key -> when learnt; dict order = learning order
    for op, i in ops:
        if op == "add":
            model.pop(k(i), None)
            model[k(i)] = clock.now
            expected_forgotten = []
            while len(model) > max_keys:
                oldest = next(iter(model))
                del model[oldest]
                expected_forgotten.append(oldest)
            assert known.add(k(i)) == expected_forgotten
        elif op == "discard":
            model.pop(k(i), None)
            known.discard(k(i))
        elif op == "tick":
            clock.now += i / 4
        else:
            expired = [key for key, at in model.items() if at <= clock.now - ttl]
            for key in expired:
                del model[key]
            assert known.expire() == expired
        known.check_invariants()
        assert list(known) == list(model) and len(known) == len(model)
        assert all(key in known for key in model)


def test_learning_many_at_once_is_learning_each_in_turn() -> None:
    """What a tier's open seeds: exact knowledge takes them all; shared knowledge keeps its
    bound, the latest learnt."""
    known, shared = KnownPresent(), KnownPresent(max_keys=3)
    known.add(k(0))
    known.add_many([k(i) for i in range(10)])
    shared.add_many([k(i) for i in range(10)])
    assert len(known) == 10 and known.issuperset([k(i) for i in range(10)])
    assert list(shared) == [k(7), k(8), k(9)]
    shared.check_invariants()
