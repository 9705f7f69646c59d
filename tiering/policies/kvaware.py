"""A KV-cache-aware eviction policy: probation for blocks used once, adaptive protection for reuse.

Why this shape (measured with ``tiering sweep``; see ``docs/policies.md``):

* **Most blocks are used once** (58% of the Mooncake trace's blocks, half of the
  synthetic workload's). They enter a *probation* list and are the first victims,
  so a burst of one-off prefills cannot flush blocks that were reused.
* **A block used twice is likely to be used again** (84% of the trace's blocks
  used twice are used a third time). A block hit while resident, or stored again
  while remembered in a ghost list, moves to the *protected* list.
* **A block is worthless without its prefix.** The owner inserts and touches a
  request's blocks last block first (the first block ends most recently used), so
  within each list a request's tail blocks are older than its head and go first:
  eviction eats prefixes from the leaves, never leaving a child whose parent was
  evicted earlier by this policy.
* **How much to protect depends on the workload and the capacity** (at 1% of the
  footprint protecting shared heads is worth 10 points over LRU; near the
  footprint a fixed protected share costs a point). The protected list's target
  size adapts the way ARC adapts ``p``: a key remembered as evicted from
  probation and stored again means probation was too small (shrink the target);
  one remembered as evicted from protection means protection was too small (grow
  it). Victims come from protected while it exceeds its target, otherwise from
  probation (falling back to the other list when one has no evictable key).

Each resident key's value is the stamp of its last use (one counter over both
lists), so :meth:`KVAwarePolicy.least_recent` can merge them into the resident set's
LRU order. Ghost lists hold keys only, ``probation_ghosts x capacity`` and
``protected_ghosts x capacity`` of them (defaults 1.0 each). Every operation is
O(1) (plus the pinned keys ``evict`` skips).

Invariants (``c`` = capacity): ``|probation| + |protected| <= c``; the four lists
disjoint; ghost lists within their bounds; ``0 <= target <= c``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import chain
from typing import NamedTuple

from tiering.policies.base import EvictionPolicy, K
from tiering.policies.recency import by_recency, check_use_order, least_recent, restamp

_MISSING = object()


class KVAwareSizes(NamedTuple):
    """Lengths of the policy's lists."""

    probation: int
    protected: int
    probation_ghosts: int
    protected_ghosts: int


class KVAwarePolicy(EvictionPolicy[K]):
    """Probation for new blocks, a protected list for reused ones, ARC-style adaptive split.

    ``probation_ghosts`` and ``protected_ghosts`` size the two ghost lists as
    multiples of ``capacity`` (numbers in [0, 64]; 0 disables a list and with
    it that direction of adaptation); ``initial_protected`` is the protected
    list's starting target as a fraction of ``capacity``. See the module docstring for the
    reasoning and ``docs/policies.md`` for the measurements.
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
        if (
            isinstance(initial_protected, bool)
            or not isinstance(initial_protected, (int, float))
            or not 0 <= initial_protected <= 1
        ):
            raise ValueError(f"initial_protected must be in [0, 1], got {initial_protected!r}")
        for name, value in (
            ("probation_ghosts", probation_ghosts),
            ("protected_ghosts", protected_ghosts),
        ):
            if (
                isinstance(value, bool)
                or not isinstance(value, (int, float))
                or not math.isfinite(value)
                or not 0 <= value <= 64
            ):
                raise ValueError(f"{name} must be a number in [0, 64], got {value!r}")
        # Resident lists: key -> stamp of its last use. Ghosts: key -> None.
        self._probation: OrderedDict[K, int] = OrderedDict()
        self._protected: OrderedDict[K, int] = OrderedDict()
        self._clock = 0
        self._probation_ghosts: OrderedDict[K, None] = OrderedDict()
        self._protected_ghosts: OrderedDict[K, None] = OrderedDict()
        self._max_probation_ghosts = int(probation_ghosts * capacity)
        self._max_protected_ghosts = int(protected_ghosts * capacity)
        # Start with protected allowed most of the room, probation victims first; starting at
        # the whole capacity cost up to 0.55 point near 40% of the footprint (docs/policies.md).
        self._target = float(initial_protected * capacity)

    # -- introspection ----------------------------------------------------------------------

    @property
    def protected_target(self) -> float:
        """The adaptive target size of the protected list (0 <= target <= capacity)."""
        return self._target

    def sizes(self) -> KVAwareSizes:
        """Current lengths of probation, protected and the two ghost lists."""
        return KVAwareSizes(
            len(self._probation),
            len(self._protected),
            len(self._probation_ghosts),
            len(self._protected_ghosts),
        )

    def is_protected(self, key: object) -> bool:
        """Whether ``key`` is resident in the protected list."""
        return key in self._protected

    # -- the EvictionPolicy interface -------------------------------------------------------

    def insert(self, key: K) -> None:
        probation, protected = self._probation, self._protected
        if key in probation or key in protected:
            raise ValueError(f"{key!r} is already resident")
        capacity = self.capacity
        if len(probation) + len(protected) >= capacity:
            raise ValueError(f"cannot insert {key!r}: {capacity} keys resident, evict first")
        b1, b2 = self._probation_ghosts, self._protected_ghosts
        self._clock = stamp = self._clock + 1
        if key in b1:
            # Evicted from probation before its second use: probation was too small.
            self._target = max(0.0, self._target - max(1.0, len(b2) / len(b1)))
            del b1[key]
            protected[key] = stamp
        elif key in b2:
            # Evicted from protection and wanted again: protection was too small.
            self._target = min(float(capacity), self._target + max(1.0, len(b1) / len(b2)))
            del b2[key]
            protected[key] = stamp
        else:
            probation[key] = stamp

    def access(self, key: K) -> None:
        self.use(key)

    def use(self, key: K) -> bool:
        """``access(key)``, answering whether ``key`` is resident (one lookup for both)."""
        protected = self._protected
        if key in protected:
            protected.move_to_end(key)
        elif self._probation.pop(key, _MISSING) is _MISSING:
            return False
        # A use in protection, or a second use: protected from now on.
        self._clock = protected[key] = self._clock + 1
        return True

    def refresh(self, key: K) -> None:
        """Make resident ``key`` the most recent of its list without counting a use
        (a key on probation stays there). Ignored when ``key`` is not resident."""
        stamp = self._clock + 1
        if restamp(key, (self._protected, self._probation), stamp):
            self._clock = stamp

    def remove(self, key: K) -> None:
        if self._probation.pop(key, _MISSING) is _MISSING:
            self._protected.pop(key, None)

    def retire(self, key: K) -> None:
        """Evict resident ``key`` chosen by someone else: it is remembered in its list's
        ghosts as if ``evict`` had chosen it. Ignored when not resident."""
        if key in self._probation:
            self._retire([key], self._probation, self._probation_ghosts, self._max_probation_ghosts)
        elif key in self._protected:
            self._retire([key], self._protected, self._protected_ghosts, self._max_protected_ghosts)

    def evict(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        victims: list[K] = []
        if n <= 0:
            return victims
        probation, protected = self._probation, self._protected
        # Scans continue where they stopped, so pinned keys are skipped once per call.
        scan_probation: Iterator[K] = (k for k in probation if can_evict(k))
        scan_protected: Iterator[K] = (k for k in protected if can_evict(k))
        probation_done = protected_done = False
        from_probation: list[K] = []
        from_protected: list[K] = []
        protected_left = len(protected)
        target = self._target
        while len(victims) < n and not (probation_done and protected_done):
            if (protected_left <= target and not probation_done) or protected_done:
                key = next(scan_probation, _MISSING)
                if key is _MISSING:
                    probation_done = True
                    continue
                from_probation.append(key)  # type: ignore[arg-type]
            else:
                key = next(scan_protected, _MISSING)
                if key is _MISSING:
                    protected_done = True
                    continue
                from_protected.append(key)  # type: ignore[arg-type]
                protected_left -= 1
            victims.append(key)  # type: ignore[arg-type]
        self._retire(from_probation, probation, self._probation_ghosts, self._max_probation_ghosts)
        self._retire(from_protected, protected, self._protected_ghosts, self._max_protected_ghosts)
        return victims

    def recency_order(self) -> Iterator[K]:
        """The resident keys, least recently used first (O(n))."""
        return by_recency(self._probation, self._protected)

    def least_recent(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        """Remove and return up to ``n`` evictable resident keys, least recently used first,
        as an LRU cache of the same keys would (no ghosts: this policy did not choose them)."""
        return least_recent(self._probation, self._protected, n, can_evict)

    @staticmethod
    def _retire(
        keys: list[K],
        resident: OrderedDict[K, int],
        ghosts: OrderedDict[K, None],
        max_ghosts: int,
    ) -> None:
        for key in keys:
            del resident[key]
            if max_ghosts:
                ghosts[key] = None
        while len(ghosts) > max_ghosts:
            ghosts.popitem(last=False)

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __iter__(self) -> Iterator[K]:
        return chain(self._probation, self._protected)

    def check_invariants(self) -> None:
        c = self.capacity
        probation, protected, b1, b2 = self.sizes()
        assert probation + protected <= c, f"{probation} + {protected} resident > c = {c}"
        assert b1 <= self._max_probation_ghosts, f"{b1} probation ghosts"
        assert b2 <= self._max_protected_ghosts, f"{b2} protected ghosts"
        assert 0.0 <= self._target <= c, f"target {self._target} outside [0, {c}]"
        lists = (self._probation, self._protected, self._probation_ghosts, self._protected_ghosts)
        union = set().union(*lists)
        assert len(union) == probation + protected + b1 + b2, "the lists are not disjoint"
        check_use_order(self._probation, "probation")
        check_use_order(self._protected, "protected")
