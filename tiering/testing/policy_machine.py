"""A reusable Hypothesis state machine that checks any :class:`EvictionPolicy`.

Usage, in a test module::

    from tiering.testing import make_policy_state_machine

    TestMyPolicy = make_policy_state_machine(MyPolicy, capacity=8).TestCase

The machine drives the policy the way a tier does (insert, access, remove,
evict with some keys pinned, and "store": evict one if full, then insert) and
checks it after every step against a plain model of the contract:

* the resident set is exactly what inserts, removes and evictions imply
  (``len``, ``in`` for every key, iteration);
* ``evict(n, can_evict)`` returns distinct resident keys that ``can_evict``
  allowed, exactly ``min(n, number of evictable keys)`` of them, and asks
  ``can_evict`` only about resident keys;
* inserting a resident key or into a full policy raises ``ValueError`` and
  changes nothing;
* ``check_invariants()`` passes and ``len(policy) <= capacity``.

With ``reference=`` (a simple, obviously-correct implementation of the same
policy, e.g. :class:`ReferenceLRU`, :class:`ReferenceARC` or
:class:`ReferenceKVAware`), every victim list
must also equal the reference's exactly, which checks the eviction *order*.
"""

from __future__ import annotations

import unittest
from collections.abc import Callable, Iterator

from hypothesis import settings as Settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiering.policies.base import EvictionPolicy, K

PolicyFactory = Callable[[int], EvictionPolicy[int]]


class ReferenceLRU(EvictionPolicy[K]):
    """LRU on a plain list (oldest first): O(n), written to be obviously right."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._keys: list[K] = []

    def insert(self, key: K) -> None:
        if key in self._keys or len(self._keys) >= self.capacity:
            raise ValueError(f"cannot insert {key!r}")
        self._keys.append(key)

    def access(self, key: K) -> None:
        if key in self._keys:
            self._keys.remove(key)
            self._keys.append(key)

    def remove(self, key: K) -> None:
        if key in self._keys:
            self._keys.remove(key)

    def evict(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        victims = [k for k in self._keys if can_evict(k)][: max(n, 0)]
        for key in victims:
            self._keys.remove(key)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[K]:
        return iter(list(self._keys))

    def check_invariants(self) -> None:
        assert len(self._keys) <= self.capacity


class ReferenceARC(EvictionPolicy[K]):
    """ARC (as :class:`~tiering.policies.arc.ARCPolicy` specifies it) on plain lists.

    Follows the paper's case analysis step by step, one victim at a time, with
    no incremental bookkeeping: slow, but easy to check by reading.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.t1: list[K] = []
        self.t2: list[K] = []
        self.b1: list[K] = []
        self.b2: list[K] = []
        self.p = 0.0

    def insert(self, key: K) -> None:
        c = self.capacity
        if key in self.t1 or key in self.t2 or len(self.t1) + len(self.t2) >= c:
            raise ValueError(f"cannot insert {key!r}")
        if key in self.b1:
            self.p = min(float(c), self.p + max(len(self.b2) / len(self.b1), 1.0))
            self.b1.remove(key)
            self.t2.append(key)
        elif key in self.b2:
            self.p = max(0.0, self.p - max(len(self.b1) / len(self.b2), 1.0))
            self.b2.remove(key)
            self.t2.append(key)
        else:
            if len(self.t1) + len(self.b1) == c:
                del self.b1[0]
            elif len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) == 2 * c:
                del self.b2[0]
            self.t1.append(key)

    def access(self, key: K) -> None:
        if key in self.t1:
            self.t1.remove(key)
            self.t2.append(key)
        elif key in self.t2:
            self.t2.remove(key)
            self.t2.append(key)

    def remove(self, key: K) -> None:
        for resident in (self.t1, self.t2):
            if key in resident:
                resident.remove(key)

    def evict(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        victims: list[K] = []
        while len(victims) < n:
            in_t1 = [k for k in self.t1 if can_evict(k)]
            in_t2 = [k for k in self.t2 if can_evict(k)]
            if in_t1 and (len(self.t1) > self.p or not in_t2):
                key = in_t1[0]
                self.t1.remove(key)
                self.b1.append(key)
            elif in_t2:
                key = in_t2[0]
                self.t2.remove(key)
                self.b2.append(key)
            else:
                break
            victims.append(key)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self.t1 or key in self.t2

    def __len__(self) -> int:
        return len(self.t1) + len(self.t2)

    def __iter__(self) -> Iterator[K]:
        return iter(self.t1 + self.t2)

    def check_invariants(self) -> None:
        c = self.capacity
        assert len(self.t1) + len(self.t2) <= c
        assert len(self.t1) + len(self.b1) <= c
        assert len(self.t1) + len(self.t2) + len(self.b1) + len(self.b2) <= 2 * c
        assert 0.0 <= self.p <= c


class ReferenceKVAware(EvictionPolicy[K]):
    """:class:`~tiering.policies.kvaware.KVAwarePolicy` on plain lists, one victim at a time.

    Probation and protected lists (oldest first), two ghost lists trimmed from
    the front, and the adaptive protected target, written out without any
    incremental bookkeeping.
    """

    def __init__(
        self,
        capacity: int,
        *,
        probation_ghosts: float = 1.0,
        protected_ghosts: float = 1.0,
        initial_protected: float = 0.9,
    ) -> None:
        super().__init__(capacity)
        self.probation: list[K] = []
        self.protected: list[K] = []
        self.b1: list[K] = []
        self.b2: list[K] = []
        self.max_b1 = int(probation_ghosts * capacity)
        self.max_b2 = int(protected_ghosts * capacity)
        self.target = float(initial_protected * capacity)

    def insert(self, key: K) -> None:
        c = self.capacity
        if key in self.probation or key in self.protected:
            raise ValueError(f"cannot insert {key!r}")
        if len(self.probation) + len(self.protected) >= c:
            raise ValueError(f"cannot insert {key!r}")
        if key in self.b1:
            self.target = max(0.0, self.target - max(1.0, len(self.b2) / len(self.b1)))
            self.b1.remove(key)
            self.protected.append(key)
        elif key in self.b2:
            self.target = min(float(c), self.target + max(1.0, len(self.b1) / len(self.b2)))
            self.b2.remove(key)
            self.protected.append(key)
        else:
            self.probation.append(key)

    def access(self, key: K) -> None:
        if key in self.protected:
            self.protected.remove(key)
            self.protected.append(key)
        elif key in self.probation:
            self.probation.remove(key)
            self.protected.append(key)

    def remove(self, key: K) -> None:
        for resident in (self.probation, self.protected):
            if key in resident:
                resident.remove(key)

    def evict(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        victims: list[K] = []
        while len(victims) < n:
            in_probation = [k for k in self.probation if can_evict(k)]
            in_protected = [k for k in self.protected if can_evict(k)]
            if in_probation and (len(self.protected) <= self.target or not in_protected):
                key = in_probation[0]
                self.probation.remove(key)
                self.b1.append(key)
                del self.b1[: max(0, len(self.b1) - self.max_b1)]
            elif in_protected:
                key = in_protected[0]
                self.protected.remove(key)
                self.b2.append(key)
                del self.b2[: max(0, len(self.b2) - self.max_b2)]
            else:
                break
            victims.append(key)
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self.probation or key in self.protected

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __iter__(self) -> Iterator[K]:
        return iter(self.probation + self.protected)

    def check_invariants(self) -> None:
        assert len(self.probation) + len(self.protected) <= self.capacity
        assert len(self.b1) <= self.max_b1 and len(self.b2) <= self.max_b2
        assert 0.0 <= self.target <= self.capacity


def make_policy_state_machine(
    factory: PolicyFactory,
    *,
    capacity: int = 8,
    key_space: int | None = None,
    reference: PolicyFactory | None = None,
    settings: Settings | None = None,
    name: str | None = None,
) -> type[RuleBasedStateMachine]:
    """Build a state machine class that checks the policies ``factory(capacity)`` builds.

    ``key_space`` (default ``3 * capacity``) bounds the integer keys used, so
    keys come back after eviction (which exercises ghost entries). ``reference``
    builds a simple implementation whose victims must match exactly. The
    returned class's ``TestCase`` attribute is a ``unittest.TestCase`` that
    pytest collects; ``settings`` (default: the loaded Hypothesis profile)
    applies to it.
    """
    if capacity < 1:
        raise ValueError(f"capacity must be >= 1, got {capacity}")
    space = 3 * capacity if key_space is None else key_space
    if space < capacity + 1:
        raise ValueError(f"key_space must exceed capacity ({capacity}), got {space}")
    keys = st.integers(min_value=0, max_value=space - 1)
    counts = st.integers(min_value=-1, max_value=capacity + 2)

    class PolicyStateMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.policy = factory(capacity)
            self.reference = reference(capacity) if reference is not None else None
            self.resident: set[int] = set()
            self.pinned: set[int] = set()

        # -- helpers --------------------------------------------------------------------

        def _can_evict(self, key: int) -> bool:
            assert key in self.resident, f"can_evict asked about non-resident key {key}"
            return key not in self.pinned

        def _evict(self, n: int) -> list[int]:
            evictable = len(self.resident - self.pinned)
            victims = self.policy.evict(n, self._can_evict)
            assert len(victims) == len(set(victims)), f"duplicate victims {victims}"
            assert set(victims) <= self.resident, f"victims {victims} not all resident"
            assert not set(victims) & self.pinned, f"pinned keys evicted: {victims}"
            assert len(victims) == min(max(n, 0), evictable), (
                f"evict({n}) returned {len(victims)} keys with {evictable} evictable"
            )
            if self.reference is not None:
                expected = self.reference.evict(n, lambda k: k not in self.pinned)
                assert victims == expected, f"victims {victims}, reference {expected}"
            self.resident -= set(victims)
            return victims

        def _insert(self, key: int) -> None:
            self.policy.insert(key)
            if self.reference is not None:
                self.reference.insert(key)
            self.resident.add(key)

        # -- rules ----------------------------------------------------------------------

        @rule(key=keys)
        def insert(self, key: int) -> None:
            """Insert as the contract allows, or check the rejection changes nothing."""
            if key in self.resident or len(self.resident) >= capacity:
                before = set(self.policy)
                try:
                    self.policy.insert(key)
                except ValueError:
                    pass
                else:
                    raise AssertionError(f"insert({key}) was accepted (resident or full)")
                assert set(self.policy) == before, "a rejected insert changed the policy"
                return
            self._insert(key)

        @rule(key=keys)
        def store(self, key: int) -> None:
            """What a tier does: make room for one key if full, then insert it."""
            if key in self.resident:
                return
            if len(self.resident) >= capacity and not self._evict(1):
                return  # every resident key is pinned: the tier would refuse the store
            self._insert(key)

        @rule(key=keys)
        def access(self, key: int) -> None:
            self.policy.access(key)
            if self.reference is not None:
                self.reference.access(key)

        @rule(key=keys)
        def remove(self, key: int) -> None:
            self.policy.remove(key)
            if self.reference is not None:
                self.reference.remove(key)
            self.resident.discard(key)
            self.pinned.discard(key)

        @precondition(lambda self: bool(self.resident - self.pinned))
        @rule(data=st.data())
        def pin(self, data: st.DataObject) -> None:
            key = data.draw(st.sampled_from(sorted(self.resident - self.pinned)))
            self.pinned.add(key)

        @precondition(lambda self: bool(self.pinned))
        @rule(data=st.data())
        def unpin(self, data: st.DataObject) -> None:
            self.pinned.discard(data.draw(st.sampled_from(sorted(self.pinned))))

        @rule(n=counts)
        def evict(self, n: int) -> None:
            self._evict(n)

        # -- invariants -----------------------------------------------------------------

        @invariant()
        def matches_model(self) -> None:
            self.policy.check_invariants()
            assert len(self.policy) == len(self.resident) <= capacity
            assert set(self.policy) == self.resident, (sorted(self.policy), sorted(self.resident))
            for key in range(space):
                assert (key in self.policy) == (key in self.resident), f"membership of {key}"
            if self.reference is not None:
                self.reference.check_invariants()
                assert set(self.reference) == self.resident

    label = name or f"{getattr(factory, '__name__', 'Policy')}StateMachine"
    PolicyStateMachine.__name__ = PolicyStateMachine.__qualname__ = label
    if settings is not None:
        PolicyStateMachine.TestCase.settings = settings
    return PolicyStateMachine


def make_policy_test_case(
    factory: PolicyFactory,
    *,
    capacity: int = 8,
    key_space: int | None = None,
    reference: PolicyFactory | None = None,
    settings: Settings | None = None,
) -> type[unittest.TestCase]:
    """``make_policy_state_machine(...).TestCase``: assign it to a ``Test*`` name for pytest."""
    machine = make_policy_state_machine(
        factory, capacity=capacity, key_space=key_space, reference=reference, settings=settings
    )
    return machine.TestCase
