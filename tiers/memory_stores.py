"""Where the memory tier keeps its blocks' bytes, and how they are copied in and out.

:class:`HeapStore` (an unbounded tier: one numpy array per block) and
:class:`ArenaStore` (a bounded tier: fixed slots of one private anonymous
mapping, reused after eviction) map keys to block addresses. Neither copies
at once: each queues its copies by address (:class:`CopyQueue`) and runs
them all in one :func:`tiering.copy.bulk.copy_regions` call on ``flush``,
which releases the GIL. Which blocks to keep is the tier's business
(:mod:`tiers.memory`); these stores only hold what they are given.
"""

from __future__ import annotations

import mmap
from typing import Any

import numpy as np

from tiering.copy.bulk import copy_regions
from tiering.core.errors import TierClosedError
from tiering.core.keys import OffloadKey
from tiering.primary.mappings import private_anonymous


class CopyQueue:
    """Copies of whole blocks, queued by address and run in one bulk call by ``flush``."""

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self._src: list[int] = []
        self._dst: list[int] = []
        # What the queued addresses point into, kept alive until the copies ran.
        self._holds: list[object] = []

    def add(self, src: int, dst: int, hold: object) -> None:
        self._src.append(src)
        self._dst.append(dst)
        if hold is not None:
            self._holds.append(hold)

    def flush(self) -> None:
        if not self._src:
            return
        src, dst, self._src, self._dst = self._src, self._dst, [], []
        try:
            copy_regions(src, dst, self.block_bytes)
        finally:
            self._holds.clear()


class HeapStore(CopyQueue):
    """Unbounded: one numpy array per block (allocated uninitialised, then copied into)."""

    def __init__(self, block_bytes: int = 0) -> None:
        super().__init__(block_bytes)
        self.blocks: dict[OffloadKey, tuple[np.ndarray[Any, np.dtype[np.uint8]], int]] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self) -> list[OffloadKey]:
        return list(self.blocks)

    def copy_out(self, key: OffloadKey, into: int) -> bool:
        held = self.blocks.get(key)
        if held is None:
            return False
        self.add(held[1], into, held[0])
        return True

    def put(self, key: OffloadKey, source: int, data: memoryview) -> None:
        # A fresh array even when overwriting: a reader queued before keeps the old bytes.
        block = np.empty(self.block_bytes, dtype=np.uint8)
        address = int(block.ctypes.data)
        self.blocks[key] = (block, address)
        self.add(source, address, (block, data))

    def drop(self, key: OffloadKey) -> bool:
        return self.blocks.pop(key, None) is not None

    def close(self) -> None:
        self.blocks.clear()


class ArenaStore(CopyQueue):
    """Bounded: ``capacity`` fixed slots of one private anonymous mapping (huge pages where
    allowed), reused after eviction."""

    def __init__(self, capacity: int, block_bytes: int) -> None:
        super().__init__(block_bytes)
        self._map: mmap.mmap | None = private_anonymous(capacity * block_bytes)
        self._arena: np.ndarray[Any, np.dtype[np.uint8]] | None = np.frombuffer(
            self._map, dtype=np.uint8
        )
        self._base = int(self._arena.ctypes.data)
        self._capacity = capacity
        self._slots: dict[OffloadKey, int] = {}
        self._free: list[int] = []
        self._never_used = 0  # slots [_never_used, capacity) were never handed out

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def keys(self) -> list[OffloadKey]:
        return list(self._slots)

    def copy_out(self, key: OffloadKey, into: int) -> bool:
        slot = self._slots.get(key)
        if slot is None:
            return False
        self.add(self._base + slot * self.block_bytes, into, None)
        return True

    def put(self, key: OffloadKey, source: int, data: memoryview) -> None:
        if self._map is None:  # closed: the arena is unmapped, a copy into it would crash
            raise TierClosedError("memory tier is closed")
        slot = self._slots.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._never_used < self._capacity:
                slot, self._never_used = self._never_used, self._never_used + 1
            else:
                raise RuntimeError("memory tier arena is full (evict before storing)")
        # Copies run in queue order, so a slot evicted and reused within one
        # batch ends up holding the later block.
        self.add(source, self._base + slot * self.block_bytes, data)
        self._slots[key] = slot

    def drop(self, key: OffloadKey) -> bool:
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        self._free.append(slot)
        return True

    def close(self) -> None:
        self._slots.clear()
        self._free.clear()
        if self._map is not None:
            self._arena = None  # drop the array's export of the mapping first
            self._map.close()
            self._map = None
