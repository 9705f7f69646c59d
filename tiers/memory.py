"""The in-memory tier: the seed's example tier made real, and the reference implementation.

It keeps each block's bytes in memory, optionally bounded by a number of
blocks or bytes (then in fixed slots of one preallocated mapping), evicting
with one of the framework's policies (``"lru"`` or ``"arc"``) and reporting
evictions through :meth:`AsyncTier.report_removed`.
Every operation completes without awaiting anything, so it is trivially
cancellation-safe: a write either happened entirely or not at all.

Config (``secondary_tiers`` entry)::

    {"type": "memory", "capacity_bytes": "8GiB", "eviction_policy": "arc"}
"""

from __future__ import annotations

import asyncio
import logging
import mmap
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import Any, cast

import numpy as np

from tiering.errors import BlockNotFound, ConfigError, PartialBatchError
from tiering.keys import OffloadKey
from tiering.policies import POLICY_NAMES, EvictionPolicy, make_policy
from tiering.tier import AsyncTier, TierContext

logger = logging.getLogger(__name__)

#: Blocks at least this large are copied by numpy with the GIL released.
_GIL_FREE_COPY_BYTES = 256 << 10

#: Batch forms yield to the event loop after copying this many bytes, so a
#: large batch never holds the loop for more than a few milliseconds.
_YIELD_EVERY_BYTES = 8 << 20


class MemoryTier(AsyncTier):
    """Blocks held in this process's memory, optionally bounded with eviction.

    ``capacity_blocks`` or ``capacity_bytes`` (not both) bounds the tier; the
    byte bound (bytes, or a size like ``"8GiB"``) is turned into whole blocks
    at :meth:`open`. A bounded tier keeps its blocks in fixed slots of one
    anonymous memory mapping (pages are touched on first use, and an evicted
    block's slot is reused, so a tier in steady state allocates nothing); an
    unbounded one keeps one ``bytes`` per block. ``eviction_policy`` names the
    policy choosing victims. Reads and
    writes count as uses for the policy; :meth:`touch` too.
    """

    max_concurrency = 64

    def __init__(
        self,
        *,
        capacity_blocks: int | None = None,
        capacity_bytes: int | str | None = None,
        eviction_policy: str = "lru",
    ) -> None:
        if capacity_blocks is not None and capacity_bytes is not None:
            raise ConfigError("give capacity_blocks or capacity_bytes, not both")
        if capacity_bytes is not None:  # "8GiB" as well as bytes, as every size in our configs
            from tiering.units import config_bytes

            capacity_bytes = config_bytes("capacity_bytes", capacity_bytes)
        bounds = (("capacity_blocks", capacity_blocks), ("capacity_bytes", capacity_bytes))
        for name, value in bounds:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        if eviction_policy not in POLICY_NAMES:
            raise ConfigError(
                f"eviction_policy must be one of {', '.join(POLICY_NAMES)}; got {eviction_policy!r}"
            )
        #: Most blocks held at once (None: unbounded). Reported in the runtime's stats.
        self.capacity_blocks: int | None = capacity_blocks
        self._capacity_bytes = capacity_bytes
        self._policy_name = eviction_policy
        self._policy: EvictionPolicy[Hashable] | None = None
        self._store: _HeapStore | _ArenaStore = _HeapStore()
        self._block_bytes = 0

    async def open(self, context: TierContext) -> None:
        """Size the bound in blocks, map the arena and build the eviction policy.

        Raises :class:`~tiering.errors.ConfigError` when ``capacity_bytes`` is
        smaller than one block. Cancellation: nothing to undo.
        """
        await super().open(context)
        if self._capacity_bytes is not None:
            blocks = self._capacity_bytes // context.block_bytes
            if blocks == 0:
                raise ConfigError(
                    f"capacity_bytes={self._capacity_bytes} holds no block of "
                    f"{context.block_bytes} bytes"
                )
            self.capacity_blocks = blocks
        self._block_bytes = context.block_bytes
        if self.capacity_blocks is not None:
            self._policy = make_policy(self._policy_name, self.capacity_blocks)
            self._store = _ArenaStore(self.capacity_blocks, context.block_bytes)

    @property
    def num_blocks(self) -> int:
        """Blocks held now."""
        return len(self._store)

    async def contains(self, key: OffloadKey) -> bool:
        """Whether ``key`` is held. Cancellation: no side effects."""
        return key in self._store

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        """Copy ``key``'s block into ``into``. Cancellation: the copy is atomic."""
        self._read_now(key, into)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """Keep a copy of ``data`` as ``key``'s block, evicting if full.

        Cancellation: the copy is atomic (the block is either absent or complete).
        """
        self._write_now(key, data)

    async def delete(self, key: OffloadKey) -> None:
        """Drop ``key``'s block if held. Cancellation: atomic."""
        if self._store.drop(key) and self._policy is not None:
            self._policy.remove(key)

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Record a use of each held key. Cancellation: atomic."""
        if self._policy is not None:
            for key in keys:
                self._policy.access(key)

    async def list_keys(self) -> Iterable[OffloadKey]:
        """The keys held now (none right after ``open``: memory does not persist).

        Cancellation: no side effects.
        """
        return self._store.keys()

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        """``read`` of each key in turn (no task per key). Cancellation: per block atomic."""
        await self._batch(keys, into, self._read_now)

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        """``write`` of each key in turn (no task per key). Cancellation: per block atomic."""
        await self._batch(keys, data, self._write_now)

    async def aclose(self) -> None:
        """Drop every block and unmap the arena. Idempotent. Cancellation: atomic."""
        self._store.close()

    # -- synchronous cores ------------------------------------------------------------------

    def _check_size(self, buffer: memoryview) -> None:
        if buffer.nbytes != self._block_bytes:
            raise ValueError(f"buffer of {buffer.nbytes} bytes; blocks are {self._block_bytes}")

    def _read_now(self, key: OffloadKey, into: memoryview) -> None:
        if into.nbytes != self._block_bytes:
            self._check_size(into)
        if not self._store.copy_out(key, into):
            raise BlockNotFound(key)
        if self._policy is not None:
            self._policy.access(key)

    def _write_now(self, key: OffloadKey, data: memoryview) -> None:
        victims = self._put(key, data)
        if victims:
            self.report_removed(victims)

    def _put(self, key: OffloadKey, data: memoryview) -> list[OffloadKey]:
        """Store ``data`` as ``key``'s block; return the keys evicted to make room."""
        if data.nbytes != self._block_bytes:
            self._check_size(data)
        store, policy = self._store, self._policy
        if key in store:
            store.put(key, data)
            if policy is not None:
                policy.access(key)
            return _NONE
        victims = _NONE
        if policy is not None and len(store) >= policy.capacity:
            victims = [
                cast(OffloadKey, v)
                for v in policy.evict(len(store) - policy.capacity + 1, _any_key)
            ]
            for victim in victims:
                store.drop(victim)
        store.put(key, data)
        if policy is not None:
            policy.insert(key)
        return victims

    async def _batch(
        self,
        keys: Sequence[OffloadKey],
        buffers: Sequence[memoryview],
        operation: Callable[[OffloadKey, memoryview], None],
    ) -> None:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        errors: dict[bytes, BaseException] = {}
        succeeded: list[bytes] = []
        copied = 0
        writing = operation == self._write_now
        evicted = self._make_room(keys) if writing else []
        for key, buffer in zip(keys, buffers, strict=True):
            if copied >= _YIELD_EVERY_BYTES:
                copied = 0
                if evicted:  # report before yielding: lookups must not outlive the block
                    self.report_removed(evicted)
                    evicted = []
                await asyncio.sleep(0)
            try:
                if writing:
                    evicted.extend(self._put(key, buffer))
                else:
                    operation(key, buffer)
            except Exception as exc:
                errors[key] = exc
            else:
                succeeded.append(key)
                copied += buffer.nbytes
        if evicted:
            self.report_removed(evicted)
        if errors:
            raise PartialBatchError(succeeded, errors)

    def _make_room(self, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
        """Evict, in one policy call, room for the new keys of a batch (not its own keys).

        Returns the victims. When the batch alone exceeds the capacity, makes
        no room: each write then evicts for itself.
        """
        policy, store = self._policy, self._store
        if policy is None:
            return []
        batch = set(keys)
        new = sum(1 for k in batch if k not in store)
        overflow = len(store) + new - policy.capacity
        if overflow <= 0 or new > policy.capacity:
            return []
        victims = [cast(OffloadKey, v) for v in policy.evict(overflow, lambda k: k not in batch)]
        for victim in victims:
            store.drop(victim)
        return victims


_NONE: list[OffloadKey] = []  # shared empty result (never mutated)


class _HeapStore:
    """Unbounded: one ``bytes`` object per block."""

    def __init__(self) -> None:
        self.blocks: dict[OffloadKey, bytes] = {}

    def __contains__(self, key: object) -> bool:
        return key in self.blocks

    def __len__(self) -> int:
        return len(self.blocks)

    def keys(self) -> list[OffloadKey]:
        return list(self.blocks)

    def copy_out(self, key: OffloadKey, into: memoryview) -> bool:
        block = self.blocks.get(key)
        if block is None:
            return False
        into[:] = block
        return True

    def put(self, key: OffloadKey, data: memoryview) -> None:
        self.blocks[key] = bytes(data)

    def drop(self, key: OffloadKey) -> bool:
        return self.blocks.pop(key, None) is not None

    def close(self) -> None:
        self.blocks.clear()


class _ArenaStore:
    """Bounded: ``capacity`` fixed slots of one anonymous mapping, reused after eviction.

    Blocks of at least :data:`_GIL_FREE_COPY_BYTES` are copied with numpy,
    which releases the GIL during the copy, so the scheduler thread keeps
    running Python meanwhile; smaller copies are cheaper than the GIL hand-off.
    """

    def __init__(self, capacity: int, block_bytes: int) -> None:
        self._map: mmap.mmap | None = mmap.mmap(-1, capacity * block_bytes)
        self._arena = memoryview(self._map)
        self._rows: np.ndarray[Any, np.dtype[np.uint8]] | None = None
        if block_bytes >= _GIL_FREE_COPY_BYTES:
            self._rows = np.frombuffer(self._map, dtype=np.uint8).reshape(capacity, block_bytes)
        self._block_bytes = block_bytes
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

    def copy_out(self, key: OffloadKey, into: memoryview) -> bool:
        slot = self._slots.get(key)
        if slot is None:
            return False
        if self._rows is not None:
            np.copyto(np.frombuffer(into, dtype=np.uint8), self._rows[slot])
        else:
            start = slot * self._block_bytes
            into[:] = self._arena[start : start + self._block_bytes]
        return True

    def put(self, key: OffloadKey, data: memoryview) -> None:
        slot = self._slots.get(key)
        if slot is None:
            if self._free:
                slot = self._free.pop()
            elif self._never_used < self._capacity:
                slot, self._never_used = self._never_used, self._never_used + 1
            else:
                raise RuntimeError("memory tier arena is full (evict before storing)")
        if self._rows is not None:
            np.copyto(self._rows[slot], np.frombuffer(data, dtype=np.uint8))
        else:
            start = slot * self._block_bytes
            self._arena[start : start + self._block_bytes] = data
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
            self._rows = None  # drop the array's export of the mapping first
            self._arena.release()
            self._map.close()
            self._map = None


class ExampleTier(MemoryTier):
    """The seed's ``example`` tier: :class:`MemoryTier` accepting the seed's ``custom_param``.

    ``custom_param`` exists so the seed's sample config
    ``{"type": "example", "custom_param": 67}`` works unchanged; it is logged
    and otherwise unused.
    """

    def __init__(
        self,
        *,
        custom_param: int = 0,
        capacity_blocks: int | None = None,
        capacity_bytes: int | None = None,
        eviction_policy: str = "lru",
    ) -> None:
        super().__init__(
            capacity_blocks=capacity_blocks,
            capacity_bytes=capacity_bytes,
            eviction_policy=eviction_policy,
        )
        self.custom_param = custom_param
        logger.info("example tier created with custom_param=%d", custom_param)


def _any_key(key: Hashable) -> bool:
    """Every block of the memory tier may be evicted (the framework pins nothing here)."""
    return True


__all__ = ["ExampleTier", "MemoryTier"]
