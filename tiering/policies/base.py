"""The eviction-policy interface: pure, synchronous, O(1) per operation.

A policy only orders keys; it never sees bytes, pins or threads. Its owner (a
tier) tells it which keys became resident, were accessed or were removed, and
asks it for victims among the keys the owner can evict right now.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Hashable, Iterator
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)


class EvictionPolicy(ABC, Generic[K]):
    """Orders resident keys for eviction. ``capacity`` is the most keys resident at once.

    Contract (checked by :meth:`check_invariants` and the reusable state
    machine in :mod:`tiering.testing.policy_machine`):

    * ``insert`` of a key not resident makes it resident. The owner evicts
      first: inserting a resident key, or any key while ``capacity`` keys are
      resident, raises ``ValueError`` and changes nothing.
    * ``access`` of a resident key records a use; of a non-resident key it is
      ignored.
    * ``remove`` of a resident key forgets it without recording it as evicted
      (no ghost entry); of a non-resident key it is ignored.
    * ``evict(n, can_evict)`` removes and returns up to ``n`` resident keys
      for which ``can_evict(key)`` is True, in the policy's order. It returns
      fewer only when fewer evictable keys exist. ``can_evict`` must not
      change the policy.
    """

    def __init__(self, capacity: int) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity <= 0:
            raise ValueError(f"capacity must be a positive int, got {capacity!r}")
        self.capacity = capacity

    @abstractmethod
    def insert(self, key: K) -> None:
        """Record that ``key`` became resident.

        Raises ``ValueError`` (changing nothing) if it is already resident or
        the policy is full.
        """

    @abstractmethod
    def access(self, key: K) -> None:
        """Record a use of ``key`` (ignored when not resident)."""

    @abstractmethod
    def remove(self, key: K) -> None:
        """Forget resident ``key`` without treating it as evicted (ignored when absent)."""

    @abstractmethod
    def evict(self, n: int, can_evict: Callable[[K], bool]) -> list[K]:
        """Remove and return up to ``n`` evictable keys, best victims first."""

    @abstractmethod
    def __contains__(self, key: object) -> bool:
        """Whether ``key`` is resident."""

    @abstractmethod
    def __len__(self) -> int:
        """Number of resident keys."""

    @abstractmethod
    def __iter__(self) -> Iterator[K]:
        """Resident keys, in no guaranteed order."""

    @abstractmethod
    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if the policy's internal invariants do not hold."""
