"""``StoredDigests``: the checksums of the blocks this process stored (verify mode).

A key's checksum is what this process knows its block must hold. It is kept
through everything that happens to the key in the tier - eviction, a failed
read, a checksum mismatch, another engine's rewrite - and replaced only when
this process stores the key again: forgetting it would let a later load of the
same key be served unverified (a forger's value survives one mismatch, so the
next load would return it). Loop-thread state of one tier service.
"""

from __future__ import annotations

from collections import OrderedDict

import xxhash

from tiering.copy.caches import evict_block
from tiering.core.keys import OffloadKey


def block_checksum(block: memoryview) -> int:
    """xxh3-64 of a block (xxhash releases the GIL while hashing large buffers).

    The block's lines are evicted from the CPU caches once hashed: the caller
    is done reading it (:mod:`tiering.copy.caches`).
    """
    digest = xxhash.xxh3_64_intdigest(block)
    evict_block(block)
    return digest


class StoredDigests:
    """Checksum by key, at most ``max_keys`` of them (the oldest stores are forgotten first).

    ``max_keys`` None: unbounded (a private tier, whose keys leave through
    :meth:`forget` when the tier reports them removed).
    """

    def __init__(self, max_keys: int | None = None) -> None:
        if max_keys is not None and max_keys < 1:
            raise ValueError(f"max_keys must be positive, got {max_keys}")
        self.max_keys = max_keys
        self._by_key: OrderedDict[OffloadKey, int] = OrderedDict()

    def __len__(self) -> int:
        return len(self._by_key)

    def get(self, key: OffloadKey) -> int | None:
        return self._by_key.get(key)

    def record(self, keys: list[OffloadKey], rows: list[memoryview]) -> None:
        """Remember the checksums of blocks being stored now (replacing older ones)."""
        by_key = self._by_key
        for key, row in zip(keys, rows, strict=True):
            by_key[key] = block_checksum(row)
            by_key.move_to_end(key)
        if self.max_keys is not None:
            while len(by_key) > self.max_keys:
                by_key.popitem(last=False)

    def forget(self, key: OffloadKey) -> None:
        """Drop ``key``'s checksum (only where no other process can write the key)."""
        self._by_key.pop(key, None)
