"""Least-recently-used eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator

from tiering.policies.base import EvictionPolicy, K


class LRUPolicy(EvictionPolicy[K]):
    """Evicts the least recently inserted-or-accessed evictable key.

    One ``OrderedDict`` (oldest first) makes every operation O(1); ``evict``
    skips non-evictable (pinned) keys, so its cost grows only with the number
    of pinned keys at the old end.
    """

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._order: OrderedDict[K, None] = OrderedDict()

    def insert(self, key: K) -> None:
        order = self._order
        if key in order:
            raise ValueError(f"{key!r} is already resident")
        if len(order) >= self.capacity:
            raise ValueError(f"cannot insert {key!r}: {self.capacity} keys resident, evict first")
        order[key] = None

    def access(self, key: K) -> None:
        if key in self._order:
            self._order.move_to_end(key)

    def remove(self, key: K) -> None:
        self._order.pop(key, None)

    def evict(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        victims: list[K] = []
        if n <= 0:
            return victims
        # Collect first, delete after: an OrderedDict cannot change while iterated.
        for key in self._order:
            if can_evict(key):
                victims.append(key)
                if len(victims) == n:
                    break
        order = self._order
        for key in victims:
            del order[key]
        return victims

    def __contains__(self, key: object) -> bool:
        return key in self._order

    def __len__(self) -> int:
        return len(self._order)

    def __iter__(self) -> Iterator[K]:
        return iter(self._order)

    def check_invariants(self) -> None:
        assert len(self._order) <= self.capacity, (len(self._order), self.capacity)
