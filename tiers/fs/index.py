"""The in-memory index of a filesystem tier: keys to slots, slot states, eviction (pure code).

Every slot below the high-water mark is in exactly one state:

* **live**: holds a visible block (``key -> Entry``), ordered by the eviction policy;
* **reserved**: being written; invisible and never evicted;
* **free**: reusable once the journal is durable through its ``ready_seq`` (the
  record that released it), so that after a crash no journal record still
  points a key at bytes that were overwritten;
* **zombie**: removed while readers held it; freed when the last reader leaves.

Readers pin slots: a pinned live slot is never evicted and a removed pinned
slot is never reused before its readers finish. The owner (the tier, on its
loop thread) drives it; nothing here blocks or awaits.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, KeysView, Mapping, ValuesView
from dataclasses import dataclass, field
from typing import Final

from tiering.core.keys import OffloadKey
from tiering.policies import EvictionPolicy
from tiers.fs.records import EntryValue

#: Where a visible block lives, the xxh3_128 checksum of its bytes and its MAC tag
#: (:mod:`tiering.tier.auth`; None for a block stored without one), read as
#: ``entry[SLOT]``, ``entry[CHECKSUM]``, ``entry[TAG]``. A plain tuple, not a class, and
#: never a subclass: CPython's collector stops tracking a tuple of ints and bytes the
#: first time it sees one, so a tier of millions of blocks adds nothing to a full
#: collection, which holds the GIL (and so the scheduler) for its whole length. With one
#: slots dataclass per block, a full collection of a 2M-block index took 190 ms, against
#: 57 ms now (``benchmarks/gc_pause.py``).
Entry = EntryValue  # what replay yields per key, kept as it is
SLOT: Final = 0
CHECKSUM: Final = 1
TAG: Final = 2


@dataclass(slots=True)
class Reservation:
    """Slots handed to one write batch.

    ``slots`` are ascending (adjacent slots make one vectored I/O).
    ``evicted`` lists the blocks evicted to make room: the caller journals and
    reports them. ``ready_seq`` is the journal sequence number that must be
    durable before any of these slots is overwritten.
    """

    slots: list[int] = field(default_factory=list)
    evicted: list[tuple[OffloadKey, Entry]] = field(default_factory=list)
    ready_seq: int = 0


class SlotIndex:
    """Keys to slots for ``capacity_slots`` slots, with ``policy`` choosing eviction victims."""

    def __init__(self, capacity_slots: int, policy: EvictionPolicy[OffloadKey]) -> None:
        if capacity_slots <= 0:
            raise ValueError(f"capacity_slots must be positive, got {capacity_slots}")
        self._usable = capacity_slots
        self._policy = policy
        self._entries: dict[OffloadKey, Entry] = {}
        self._owner: dict[int, OffloadKey] = {}
        self._free: deque[tuple[int, int]] = deque()
        self._reserved: dict[int, int] = {}
        self._pins: dict[int, int] = {}
        self._zombies: dict[int, int] = {}
        self._next_fresh = 0

    @classmethod
    def restore(
        cls,
        capacity_slots: int,
        policy: EvictionPolicy[OffloadKey],
        entries: Mapping[bytes, tuple[int, int] | tuple[int, int, bytes | None]],
    ) -> SlotIndex:
        """An index holding ``entries`` (``key -> (slot, checksum[, tag])``, oldest first).

        Raises ValueError for a slot outside the capacity or claimed twice.
        """
        index = cls(capacity_slots, policy)
        # Built whole, checked after (a tier restores millions of entries at start): the
        # index is thrown away if a check fails.
        table: dict[OffloadKey, Entry] = {
            OffloadKey(key): value if len(value) == 3 else (value[0], value[1], None)
            for key, value in entries.items()
        }
        owner = {entry[SLOT]: key for key, entry in table.items()}
        if len(owner) != len(table):
            seen: set[int] = set()
            for slot in (entry[SLOT] for entry in table.values()):
                if slot in seen:
                    raise ValueError(f"slot {slot} claimed twice")
                seen.add(slot)
        if owner and not 0 <= min(owner) <= max(owner) < capacity_slots:
            slot = next(s for s in owner if not 0 <= s < capacity_slots)
            raise ValueError(f"slot {slot} outside capacity {capacity_slots}")
        insert = policy.insert
        for key in table:
            insert(key)
        index._entries, index._owner = table, owner
        index._next_fresh = max(owner, default=-1) + 1
        index._free.extend((s, 0) for s in range(index._next_fresh) if s not in owner)
        return index

    # -- queries ------------------------------------------------------------------------

    @property
    def capacity_slots(self) -> int:
        return self._usable

    @property
    def policy(self) -> EvictionPolicy[OffloadKey]:
        return self._policy

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def get(self, key: OffloadKey) -> Entry | None:
        return self._entries.get(key)

    def keys(self) -> list[OffloadKey]:
        return list(self._entries)

    def items(self) -> list[tuple[OffloadKey, Entry]]:
        """A snapshot of the visible entries, oldest first (for compaction)."""
        return list(self._entries.items())

    def views(self) -> tuple[KeysView[OffloadKey], ValuesView[Entry]]:
        """The visible keys and their entries, oldest first, live: the owner copies them."""
        return self._entries.keys(), self._entries.values()

    def reserved_count(self) -> int:
        return len(self._reserved)

    def available(self) -> int:
        """Slots a reservation could get right now: free, never used, or evictable."""
        pinned_live = sum(1 for slot in self._pins if slot in self._owner)
        fresh = max(0, self._usable - self._next_fresh)
        return len(self._free) + fresh + len(self._entries) - pinned_live

    def high_water(self) -> int:
        """One past the highest slot ever handed out (slots at or above are untouched)."""
        return self._next_fresh

    # -- readers ------------------------------------------------------------------------

    def pin(self, key: OffloadKey) -> Entry | None:
        """Pin ``key``'s slot for a read (None if absent). Pair with :meth:`unpin`."""
        entry = self._entries.get(key)
        if entry is not None:
            slot = entry[SLOT]
            self._pins[slot] = self._pins.get(slot, 0) + 1
        return entry

    def unpin(self, slot: int) -> None:
        count = self._pins[slot] - 1
        if count:
            self._pins[slot] = count
            return
        del self._pins[slot]
        ready_seq = self._zombies.pop(slot, None)
        if ready_seq is not None:
            self._release_slot(slot, ready_seq)

    def access(self, key: OffloadKey) -> None:
        self._policy.access(key)

    # -- writers ------------------------------------------------------------------------

    def reserve(self, n: int, durable_seq: int, evict_seq: int) -> Reservation:
        """Reserve up to ``n`` slots, evicting unpinned blocks when nothing is free.

        Free slots already reusable come first, then never-used slots, then
        free slots still waiting for their journal record, then evictions
        (whose slots become reusable once ``evict_seq`` is durable). Returns
        fewer slots only when every other slot is reserved or being read.
        """
        out = Reservation()
        need = n
        ready_seq = 0
        free = self._free
        while need and free and free[0][1] <= durable_seq:
            slot, seq = free.popleft()
            self._reserved[slot] = seq
            out.slots.append(slot)
            need -= 1
        while need and self._next_fresh < self._usable:
            slot = self._next_fresh
            self._next_fresh += 1
            self._reserved[slot] = 0
            out.slots.append(slot)
            need -= 1
        while need and free:
            slot, seq = free.popleft()
            self._reserved[slot] = seq
            ready_seq = max(ready_seq, seq)
            out.slots.append(slot)
            need -= 1
        if need:
            for key in self._policy.evict(need, self._evictable):
                entry = self._entries.pop(key)
                slot = entry[SLOT]
                del self._owner[slot]
                self._reserved[slot] = evict_seq
                out.slots.append(slot)
                out.evicted.append((key, entry))
            if out.evicted:
                ready_seq = max(ready_seq, evict_seq)
        out.slots.sort()
        out.ready_seq = ready_seq
        return out

    def _evictable(self, key: OffloadKey) -> bool:
        return self._entries[key][SLOT] not in self._pins

    def release(self, slots: Iterable[int]) -> None:
        """Give back reserved slots whose write failed or was abandoned."""
        for slot in slots:
            self._release_slot(slot, self._reserved.pop(slot))

    def commit(
        self, key: OffloadKey, slot: int, checksum: int, seq: int, tag: bytes | None = None
    ) -> Entry | None:
        """Make reserved ``slot`` visible as ``key`` (its journal record ``seq`` is durable).

        Returns the entry it replaced, whose slot is freed (after its readers).
        """
        del self._reserved[slot]
        old = self._entries.get(key)
        if old is not None:
            del self._owner[old[SLOT]]
            self._free_or_zombie(old[SLOT], seq)
            self._policy.access(key)
        else:
            self._policy.insert(key)
        self._entries[key] = (slot, checksum, tag)
        self._owner[slot] = key
        return old

    def commit_many(
        self, items: Iterable[tuple[OffloadKey, int, int, bytes | None]], seq: int
    ) -> None:
        """:meth:`commit` for ``(key, slot, checksum, tag)`` items of one durable record ``seq``."""
        reserved, entries, owner, policy = self._reserved, self._entries, self._owner, self._policy
        for key, slot, checksum, tag in items:
            del reserved[slot]
            old = entries.get(key)
            if old is not None:
                del owner[old[SLOT]]
                self._free_or_zombie(old[SLOT], seq)
                policy.access(key)
            else:
                policy.insert(key)
            entries[key] = (slot, checksum, tag)
            owner[slot] = key

    def remove(self, key: OffloadKey, seq: int) -> Entry | None:
        """Drop ``key`` (its DEL record is journal ``seq``); None if it was absent."""
        entry = self._entries.pop(key, None)
        if entry is None:
            return None
        del self._owner[entry[SLOT]]
        self._policy.remove(key)
        self._free_or_zombie(entry[SLOT], seq)
        return entry

    def limit_capacity(self, usable_slots: int) -> None:
        """Never hand out slots at or above ``usable_slots`` again (the disk is full).

        Only never-written slots may be cut (the caller passes the number of
        slots backed by slab files, and every written slot is backed). Slots
        still reserved above the limit are dropped when released.
        """
        if usable_slots >= self._usable:
            return
        if any(s >= usable_slots for s in self._owner):
            raise ValueError(f"cannot limit capacity to {usable_slots}: a live block is above it")
        self._usable = usable_slots
        self._next_fresh = min(self._next_fresh, usable_slots)
        self._free = deque((s, seq) for s, seq in self._free if s < usable_slots)

    def _free_or_zombie(self, slot: int, seq: int) -> None:
        if slot in self._pins:
            self._zombies[slot] = seq
        else:
            self._release_slot(slot, seq)

    def _release_slot(self, slot: int, seq: int) -> None:
        if slot < self._usable:
            self._free.append((slot, seq))

    # -- checks -------------------------------------------------------------------------

    def check_invariants(self) -> None:
        """Raise AssertionError if any slot is in no state or in two."""
        live = set(self._owner)
        free = [s for s, _ in self._free]
        reserved = set(self._reserved)
        zombies = set(self._zombies)
        assert len(free) == len(set(free)), "a slot is free twice"
        free_set = set(free)
        groups = (live, free_set, reserved, zombies)
        for i, a in enumerate(groups):
            for b in groups[i + 1 :]:
                assert not (a & b), f"slots in two states: {sorted(a & b)}"
        union = live | free_set | reserved | zombies
        kept = live | free_set | zombies
        assert all(0 <= s < self._next_fresh for s in kept), "slot above the high-water mark"
        assert all(s < self._next_fresh or s >= self._usable for s in reserved)
        expected = set(range(min(self._next_fresh, self._usable)))
        assert expected <= union, f"slots in no state: {sorted(expected - union)[:10]}"
        assert len(live) + len(free_set) + len(zombies) <= self._usable
        assert set(self._pins) <= live | zombies, "a pinned slot is neither live nor zombie"
        assert all(count > 0 for count in self._pins.values())
        assert len(self._entries) == len(self._owner) == len(self._policy)
        for key, entry in self._entries.items():
            assert self._owner[entry[SLOT]] == key
            assert key in self._policy
        self._policy.check_invariants()
