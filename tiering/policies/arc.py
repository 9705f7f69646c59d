"""Adaptive Replacement Cache (Megiddo & Modha, FAST 2003) behind the owner-driven interface.

ARC keeps two resident lists and two ghost lists, each in LRU order (oldest first):

* ``T1``: resident keys seen once recently (recency);
* ``T2``: resident keys seen at least twice recently (frequency);
* ``B1`` / ``B2``: ghosts, the keys most recently evicted from ``T1`` / ``T2``
  (keys only, no data).

A target size ``p`` for ``T1`` adapts to the workload: re-inserting a key
remembered in ``B1`` means ``T1`` was too small (``p`` grows by
``max(|B2|/|B1|, 1)``); one remembered in ``B2`` means ``T2`` was too small
(``p`` shrinks by ``max(|B1|/|B2|, 1)``). Either ghost hit becomes resident in
``T2``. A new key enters ``T1``. Victims come from ``T1`` while ``|T1| > p``
and from ``T2`` otherwise (the paper's REPLACE), skipping keys the owner
cannot evict (pinned) and falling back to the other list when one list has no
evictable key; every victim becomes a ghost.

Differences from the paper, both forced by the owner-driven interface (the
owner evicts to make room, then inserts): the victims for a ghost hit are
chosen with ``p`` as it was before that hit adapts it, and REPLACE's tie rule
for a ``B2`` hit (evict from ``T1`` when ``|T1| == p``) is not applied because
``evict`` does not know which key is coming. Both only shift one decision per
ghost hit; the invariants below hold exactly.

Each resident key's value is the stamp of its last use (one counter over both
lists), so each list is in use order and :meth:`ARCPolicy.least_recent` can merge
them into the resident set's LRU order (the adaptive policy's LRU expert).

Invariants (``c`` = capacity): ``|T1| + |T2| <= c``, ``|T1| + |B1| <= c``,
``|T1| + |T2| + |B1| + |B2| <= 2c``, ``0 <= p <= c``, the four lists disjoint.
Every operation is O(1) (plus the pinned keys ``evict`` skips).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Iterator
from itertools import chain
from typing import Literal, NamedTuple

from tiering.policies.base import EvictionPolicy, K
from tiering.policies.recency import by_recency, check_use_order, least_recent, restamp

ARCList = Literal["T1", "T2", "B1", "B2"]

# "Not found" for dict.pop: keys may be any hashable, None included.
_MISSING = object()


class ARCSizes(NamedTuple):
    """Lengths of ARC's four lists."""

    t1: int
    t2: int
    b1: int
    b2: int


class ARCPolicy(EvictionPolicy[K]):
    """Adaptive Replacement Cache: balances recency (T1) and frequency (T2) by ghost hits.

    See the module docstring for the algorithm and its two documented
    differences from the paper.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Resident lists: key -> stamp of its last use. Ghosts: key -> None.
        self._t1: OrderedDict[K, int] = OrderedDict()
        self._t2: OrderedDict[K, int] = OrderedDict()
        self._b1: OrderedDict[K, None] = OrderedDict()
        self._b2: OrderedDict[K, None] = OrderedDict()
        self._p = 0.0
        self._clock = 0

    # -- introspection ----------------------------------------------------------------------

    @property
    def target_t1(self) -> float:
        """ARC's adaptive target ``p`` for the size of ``T1`` (0 <= p <= capacity)."""
        return self._p

    def sizes(self) -> ARCSizes:
        """Current lengths of ``T1``, ``T2``, ``B1`` and ``B2``."""
        return ARCSizes(len(self._t1), len(self._t2), len(self._b1), len(self._b2))

    def list_of(self, key: object) -> ARCList | None:
        """Which of ARC's lists holds ``key`` (``None`` if it is neither resident nor a ghost)."""
        if key in self._t1:
            return "T1"
        if key in self._t2:
            return "T2"
        if key in self._b1:
            return "B1"
        if key in self._b2:
            return "B2"
        return None

    # -- the EvictionPolicy interface -------------------------------------------------------

    def insert(self, key: K) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        if key in t1 or key in t2:
            raise ValueError(f"{key!r} is already resident")
        capacity = self.capacity
        n1 = len(t1)
        resident = n1 + len(t2)
        if resident >= capacity:
            raise ValueError(f"cannot insert {key!r}: {capacity} keys resident, evict first")
        self._clock = stamp = self._clock + 1
        if key in b1:
            # Case II: evicted from T1 too early, so T1 deserves more room.
            self._p = min(float(capacity), self._p + max(len(b2) / len(b1), 1.0))
            del b1[key]
            t2[key] = stamp
        elif key in b2:
            # Case III: evicted from T2 too early, so T2 deserves more room.
            self._p = max(0.0, self._p - max(len(b1) / len(b2), 1.0))
            del b2[key]
            t2[key] = stamp
        else:
            # Case IV: a new key. Trim the ghosts so the directory stays within
            # |T1|+|B1| <= c and 2c in total. As |T1|+|T2| < c here, the list
            # trimmed is never empty.
            ghosts1 = len(b1)
            if n1 + ghosts1 >= capacity:
                b1.popitem(last=False)
            elif resident + ghosts1 + len(b2) >= 2 * capacity:
                b2.popitem(last=False)
            t1[key] = stamp

    def access(self, key: K) -> None:
        self.use(key)

    def use(self, key: K) -> bool:
        """``access(key)``, answering whether ``key`` is resident (one lookup for both)."""
        t2 = self._t2
        if key in t2:
            t2.move_to_end(key)
        elif self._t1.pop(key, _MISSING) is _MISSING:
            return False
        # A use in T2, or a second use: promoted from recency to frequency.
        self._clock = t2[key] = self._clock + 1
        return True

    def refresh(self, key: K) -> None:
        """Make resident ``key`` the most recent of its list without counting a use.

        For an owner that sees the same use twice (a request touching its blocks
        again): the key is as safe from eviction as a just-used one, but a key seen
        once stays in ``T1``. Ignored when ``key`` is not resident.
        """
        stamp = self._clock + 1
        if restamp(key, (self._t2, self._t1), stamp):
            self._clock = stamp

    def remove(self, key: K) -> None:
        if self._t1.pop(key, _MISSING) is _MISSING:
            self._t2.pop(key, None)

    def retire(self, key: K) -> None:
        """Evict resident ``key`` chosen by someone else: it becomes a ghost as if ``evict``
        had chosen it (``T1`` to ``B1``, ``T2`` to ``B2``). Ignored when not resident."""
        if self._t1.pop(key, _MISSING) is not _MISSING:
            self._b1[key] = None
        elif self._t2.pop(key, _MISSING) is not _MISSING:
            self._b2[key] = None

    def recency_order(self) -> Iterator[K]:
        """The resident keys, least recently used first (O(n))."""
        return by_recency(self._t1, self._t2)

    def least_recent(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        """Remove and return up to ``n`` evictable resident keys, least recently used first,
        as an LRU cache of the same keys would (no ghosts: ARC did not choose them)."""
        return least_recent(self._t1, self._t2, n, can_evict)

    def evict_one(self) -> K:
        """``evict(1, lambda key: True)[0]`` without the lists: the one victim of a cache
        whose every key is evictable (a standalone or shadow cache). Raises ``KeyError``
        when nothing is resident."""
        t1 = self._t1
        if t1 and (len(t1) > self._p or not self._t2):
            key = t1.popitem(last=False)[0]
            self._b1[key] = None
        else:
            key = self._t2.popitem(last=False)[0]
            self._b2[key] = None
        return key

    def evict(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        if n <= 0:
            return []
        t1, t2 = self._t1, self._t2
        # REPLACE per victim: from T1 while |T1| (less the victims taken) > p, else from
        # T2; a list with no evictable key left hands over to the other. As taking from T2
        # leaves |T1| as is, that is: up to ceil(|T1| - p) from T1, the rest from T2, and
        # what T2 could not give from T1 after all (in that order).
        from_t1: list[K] = []
        from_t2: list[K] = []
        want = min(n, max(0, math.ceil(len(t1) - self._p)))
        scan1 = iter(t1)  # continues where it stopped: pinned keys are skipped once per call
        if want:
            for key in scan1:
                if can_evict(key):
                    from_t1.append(key)
                    if len(from_t1) == want:
                        break
        rest = n - len(from_t1)
        if rest:
            for key in t2:
                if can_evict(key):
                    from_t2.append(key)
                    if len(from_t2) == rest:
                        break
        if len(from_t2) < rest:
            short = n - len(from_t2)
            for key in scan1:
                if can_evict(key):
                    from_t1.append(key)
                    if len(from_t1) == short:
                        break
        victims = from_t1[:want] + from_t2 + from_t1[want:]
        b1, b2 = self._b1, self._b2
        for key in from_t1:
            del t1[key]
            b1[key] = None
        for key in from_t2:
            del t2[key]
            b2[key] = None
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._t1 or key in self._t2

    def __len__(self) -> int:
        return len(self._t1) + len(self._t2)

    def __iter__(self) -> Iterator[K]:
        return chain(self._t1, self._t2)

    def check_invariants(self) -> None:
        c = self.capacity
        t1, t2, b1, b2 = self.sizes()
        assert t1 + t2 <= c, f"|T1|+|T2| = {t1}+{t2} > c = {c}"
        assert t1 + b1 <= c, f"|T1|+|B1| = {t1}+{b1} > c = {c}"
        assert t1 + t2 + b1 + b2 <= 2 * c, f"total {t1 + t2 + b1 + b2} > 2c = {2 * c}"
        assert 0.0 <= self._p <= c, f"p = {self._p} outside [0, {c}]"
        lists = (self._t1, self._t2, self._b1, self._b2)
        union = set().union(*lists)
        assert len(union) == t1 + t2 + b1 + b2, "ARC lists are not disjoint"
        check_use_order(self._t1, "T1")
        check_use_order(self._t2, "T2")
