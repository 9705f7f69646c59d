"""SlotIndex invariants under random operation sequences (Hypothesis state machine)."""

from __future__ import annotations

import gc
from typing import cast

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from tiering.core.keys import OffloadKey
from tiering.policies import EvictionPolicy, make_policy
from tiers.fs.index import SLOT, Entry, SlotIndex

KEYS = [OffloadKey(bytes([i]) * 4) for i in range(24)]


def policy(name: str, capacity: int) -> EvictionPolicy[OffloadKey]:
    return cast("EvictionPolicy[OffloadKey]", make_policy(name, capacity))


class IndexMachine(RuleBasedStateMachine):
    """Drives a SlotIndex like the tier does, checking it against a simple model."""

    policy_name = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.capacity = 8
        self.index = SlotIndex(self.capacity, policy(self.policy_name, self.capacity))
        self.seq = 0  # last journal sequence number handed out
        self.durable = 0
        self.pending: list[tuple[list[int], list[OffloadKey]]] = []  # reserved, not committed
        self.pins: list[Entry] = []
        self.visible: dict[OffloadKey, Entry] = {}
        self.freed_at: dict[int, int] = {}  # slot -> seq that freed it

    def next_seq(self) -> int:
        self.seq += 1
        return self.seq

    @rule(keys=st.lists(st.sampled_from(KEYS), min_size=1, max_size=5, unique=True))
    def reserve(self, keys: list[OffloadKey]) -> None:
        evict_seq = self.seq + 1
        res = self.index.reserve(len(keys), self.durable, evict_seq)
        if res.evicted:
            assert self.next_seq() == evict_seq
        assert res.slots == sorted(res.slots)
        assert len(res.slots) <= len(keys)
        pinned = {e[SLOT] for e in self.pins}
        for key, entry in res.evicted:
            assert entry[SLOT] not in pinned, "evicted a block being read"
            assert self.visible.pop(key) == entry
            self.freed_at[entry[SLOT]] = evict_seq
        for slot in res.slots:
            # A reused slot waits for the record that freed it.
            assert max(res.ready_seq, self.durable) >= self.freed_at.get(slot, 0)
        self.pending.append((res.slots, keys[: len(res.slots)]))

    @precondition(lambda self: self.pending)
    @rule(data=st.data(), succeed=st.booleans())
    def finish_write(self, data: st.DataObject, succeed: bool) -> None:
        slots, keys = self.pending.pop(data.draw(st.integers(0, len(self.pending) - 1)))
        if not succeed:
            self.index.release(slots)
            return
        seq = self.next_seq()
        self.durable = seq
        for slot, key in zip(slots, keys, strict=False):
            old = self.index.commit(key, slot, checksum=slot * 1000 + seq, seq=seq)
            if old is not None:
                self.freed_at[old[SLOT]] = seq
            self.visible[key] = (slot, slot * 1000 + seq, None)
        self.index.release(slots[len(keys) :])

    @rule(key=st.sampled_from(KEYS))
    def pin(self, key: OffloadKey) -> None:
        entry = self.index.pin(key)
        assert entry == self.visible.get(key)
        if entry is not None:
            self.pins.append(entry)

    @precondition(lambda self: self.pins)
    @rule(data=st.data())
    def unpin(self, data: st.DataObject) -> None:
        entry = self.pins.pop(data.draw(st.integers(0, len(self.pins) - 1)))
        self.index.unpin(entry[SLOT])

    @rule(key=st.sampled_from(KEYS))
    def remove(self, key: OffloadKey) -> None:
        seq = self.next_seq()
        entry = self.index.remove(key, seq)
        assert entry == self.visible.pop(key, None)
        if entry is not None:
            self.freed_at[entry[SLOT]] = seq

    @rule()
    def journal_catches_up(self) -> None:
        self.durable = self.seq

    @rule(key=st.sampled_from(KEYS))
    def access(self, key: OffloadKey) -> None:
        self.index.access(key)

    @invariant()
    def consistent(self) -> None:
        self.index.check_invariants()
        assert {k: self.index.get(k) for k in self.visible} == self.visible
        assert len(self.index) == len(self.visible) <= self.capacity
        slots = [e[SLOT] for e in self.visible.values()]
        reserved = [s for batch, _ in self.pending for s in batch]
        assert len(set(slots + reserved)) == len(slots) + len(reserved), "slot given out twice"
        assert all(0 <= s < self.capacity for s in slots + reserved)


class ArcIndexMachine(IndexMachine):
    policy_name = "arc"


# A third of the profile's examples (60 under "ci"): the suite shares two small cores.
_budget = settings(
    max_examples=max(20, (settings.default.max_examples if settings.default else 60) // 3),
    stateful_step_count=40,
    deadline=None,
)
TestIndexMachine = IndexMachine.TestCase
TestIndexMachine.settings = _budget
TestArcIndexMachine = ArcIndexMachine.TestCase
TestArcIndexMachine.settings = _budget


def test_restore_rebuilds_free_slots_below_the_high_water_mark() -> None:
    entries: dict[bytes, tuple[int, int]] = {KEYS[0]: (5, 1), KEYS[1]: (2, 2)}
    index = SlotIndex.restore(8, policy("lru", 8), entries)
    index.check_invariants()
    assert index.high_water() == 6
    res = index.reserve(6, durable_seq=0, evict_seq=1)
    assert res.slots == [0, 1, 3, 4, 6, 7]
    assert res.evicted == [] and res.ready_seq == 0
    with pytest.raises(ValueError, match="twice"):
        SlotIndex.restore(8, policy("lru", 8), {KEYS[0]: (1, 0), KEYS[1]: (1, 0)})
    with pytest.raises(ValueError, match="outside"):
        SlotIndex.restore(8, policy("lru", 8), {KEYS[0]: (8, 0)})


def test_limit_capacity_cuts_only_never_written_slots() -> None:
    index = SlotIndex(10, policy("arc", 10))
    res = index.reserve(3, 0, 1)
    for i, slot in enumerate(res.slots):
        index.commit(KEYS[i], slot, 0, 1)
    doomed = index.reserve(4, 1, 2)
    index.limit_capacity(5)
    index.release(doomed.slots)  # slots 5 and 6 are retired, 3 and 4 come back
    index.check_invariants()
    assert index.capacity_slots == 5
    again = index.reserve(4, 1, 2)
    assert again.slots == [0, 3, 4] or len(again.evicted) == 2
    assert all(s < 5 for s in again.slots)


def test_entries_leave_the_garbage_collectors_lists() -> None:
    """A tier of millions of blocks must add nothing to a full collection (which holds the
    GIL): every entry, restored, committed one by one or in a batch, with or without a tag,
    is a plain tuple the collector stops tracking."""
    index = SlotIndex.restore(16, policy("lru", 16), {KEYS[0]: (0, 1 << 100)})
    res = index.reserve(6, durable_seq=0, evict_seq=1)
    index.commit(KEYS[1], res.slots[0], 7, seq=1)
    index.commit(KEYS[2], res.slots[1], 8, seq=1, tag=b"\x01" + bytes(32))
    index.commit_many([(KEYS[i], res.slots[i - 1], i, None) for i in range(3, 7)], seq=2)
    gc.collect()
    entries = [index.get(k) for k in KEYS[:7]]
    assert all(type(entry) is tuple for entry in entries)
    assert not any(gc.is_tracked(entry) for entry in entries)
    assert index.get(KEYS[2]) == (res.slots[1], 8, b"\x01" + bytes(32))
