"""What a tier's runtime knows to be readable in the tier: the lookup view's "present".

The loop thread is the only writer; the scheduler thread reads it without a
lock (``key in known`` and ``len(known)`` are single atomic operations on a
dict under the GIL).

For a private tier (``shared = False``) the knowledge is exact: only this
process adds and removes blocks, so it never ages. For a shared tier, other
processes and the server (eviction, expiry) change the contents behind our
back, so a "present" answer is *recent knowledge*: it is forgotten after
``ttl_s`` (the next lookup asks the tier again, answering None meanwhile) and
at most ``max_keys`` answers are kept, the oldest forgotten first. Forgetting
is never a removal: the block may well still be there.
"""

from __future__ import annotations

import enum
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from tiering.core.keys import OffloadKey


class Presence(enum.Enum):
    """What :meth:`SchedulerSide.lookup_state` knows about a key."""

    ABSENT = "absent"
    PRESENT = "present"
    STORING = "storing"
    CHECKING = "checking"


class KnownPresent:
    """Keys known readable, each with when it was learnt (loop thread writes)."""

    __slots__ = ("_clock", "_keys", "max_keys", "ttl_s")

    def __init__(
        self,
        *,
        ttl_s: float | None = None,
        max_keys: int | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s is not None and not ttl_s > 0:
            raise ValueError(f"ttl_s must be positive or None, got {ttl_s!r}")
        if max_keys is not None and max_keys < 1:
            raise ValueError(f"max_keys must be >= 1 or None, got {max_keys!r}")
        self.ttl_s = ttl_s
        self.max_keys = max_keys
        self._clock = clock
        # Knowledge that never ages needs no order: a plain dict of bytes and floats, which
        # the garbage collector stops tracking (an OrderedDict it walks in every full
        # collection: a tier's every block, GIL held; docs/runtime.md), at two thirds of
        # the memory.
        self._keys: dict[OffloadKey, float] = OrderedDict() if self.ages else {}

    @property
    def ages(self) -> bool:
        """Whether answers are forgotten (a shared tier's knowledge)."""
        return self.ttl_s is not None or self.max_keys is not None

    def __contains__(self, key: object) -> bool:
        return key in self._keys

    def __len__(self) -> int:
        return len(self._keys)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(list(self._keys))

    def issuperset(self, keys: Iterable[OffloadKey]) -> bool:
        known = self._keys
        return all(key in known for key in keys)

    def add(self, key: OffloadKey) -> list[OffloadKey]:
        """Learn (or refresh) that ``key`` is readable; returns the keys forgotten for room."""
        keys = self._keys
        if not isinstance(keys, OrderedDict):  # never ages: no order to keep
            keys[key] = 0.0
            return []
        if key in keys:
            keys.move_to_end(key)
        keys[key] = self._clock() if self.ttl_s is not None else 0.0
        if self.max_keys is None or len(keys) <= self.max_keys:
            return []
        forgotten: list[OffloadKey] = []
        while len(keys) > self.max_keys:
            forgotten.append(keys.popitem(last=False)[0])
        return forgotten

    def add_many(self, keys: Iterable[OffloadKey]) -> None:
        """:meth:`add` for each of ``keys`` in order, the forgotten keys dropped (a tier's
        recovered blocks at open: one dict update when the knowledge never ages)."""
        if isinstance(self._keys, OrderedDict):
            for key in keys:
                self.add(key)
        else:
            self._keys.update(dict.fromkeys(keys, 0.0))

    def discard(self, key: OffloadKey) -> None:
        self._keys.pop(key, None)

    def expire(self) -> list[OffloadKey]:
        """Forget the answers older than ``ttl_s``; returns the keys forgotten."""
        if self.ttl_s is None:
            return []
        horizon = self._clock() - self.ttl_s
        keys = self._keys
        forgotten: list[OffloadKey] = []
        while keys:
            oldest, learnt = next(iter(keys.items()))
            if learnt > horizon:
                break
            del keys[oldest]
            forgotten.append(oldest)
        return forgotten

    def check_invariants(self) -> None:
        """Insertion order is learning order (oldest first) and the bound holds."""
        if self.max_keys is not None:
            assert len(self._keys) <= self.max_keys
        if self.ttl_s is not None:
            times = list(self._keys.values())
            assert times == sorted(times), "answers out of learning order"
