"""The in-memory tier: the seed's example tier made real, and the reference implementation.

It keeps each block's bytes in memory, optionally bounded by a number of
blocks or bytes (then in fixed slots of one preallocated mapping), evicting
with one of the framework's policies (``"lru"`` or ``"arc"``) and reporting
evictions through :meth:`AsyncTier.report_removed`.
Every operation completes without awaiting anything, so it is trivially
cancellation-safe: a write either happened entirely or not at all.

Block bytes move outside the GIL: a call's copies are gathered into one
table of addresses and moved by one :func:`tiering.copy.bulk.copy_regions`
(per 8 MiB in the batch forms), which releases the GIL for every copy of
16 KiB or more and between 16 KiB batches of smaller ones, so the scheduler
thread keeps running Python while this tier copies. The stores that hold
the bytes and queue those copies are :mod:`tiers.memory_stores`; this module
owns the tier's API, its bound and its eviction.

Config (``secondary_tiers`` entry)::

    {"type": "memory", "capacity_bytes": "8GiB", "eviction_policy": "arc"}
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Iterable, Mapping, Sequence
from typing import Any, cast

from tiering.copy.bulk import address_of
from tiering.core.errors import BlockNotFound, ConfigError, PartialBatchError
from tiering.core.keys import OffloadKey
from tiering.policies import EvictionPolicy, PolicyChoice, resolve_policy
from tiering.tier import AsyncTier, TierContext
from tiers.memory_stores import ArenaStore, HeapStore

logger = logging.getLogger(__name__)

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
    medium = "CPU"

    def __init__(
        self,
        *,
        capacity_blocks: int | None = None,
        capacity_bytes: int | str | None = None,
        eviction_policy: str | Mapping[str, Any] | PolicyChoice = "lru",
    ) -> None:
        if capacity_blocks is not None and capacity_bytes is not None:
            raise ConfigError("give capacity_blocks or capacity_bytes, not both")
        if capacity_bytes is not None:  # "8GiB" as well as bytes, as every size in our configs
            from tiering.support.units import config_bytes

            capacity_bytes = config_bytes("capacity_bytes", capacity_bytes)
        bounds = (("capacity_blocks", capacity_blocks), ("capacity_bytes", capacity_bytes))
        for name, value in bounds:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise ConfigError(f"{name} must be an integer, got {value!r}")
            if value is not None and value <= 0:
                raise ConfigError(f"{name} must be positive, got {value}")
        policy = resolve_policy(eviction_policy)  # ConfigError now, naming the key
        #: Most blocks held at once (None: unbounded). Reported in the runtime's stats.
        self.capacity_blocks: int | None = capacity_blocks
        self._capacity_bytes = capacity_bytes
        self._policy_choice: PolicyChoice = policy
        self._policy: EvictionPolicy[Hashable] | None = None
        self._store: HeapStore | ArenaStore = HeapStore()
        self._block_bytes = 0

    async def open(self, context: TierContext) -> None:
        """Size the bound in blocks, map the arena and build the eviction policy.

        Raises :class:`~tiering.core.errors.ConfigError` when ``capacity_bytes`` is
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
        self._store = HeapStore(context.block_bytes)
        if self.capacity_blocks is not None:
            self._policy = self._policy_choice.build(self.capacity_blocks)
            try:
                self._store = ArenaStore(self.capacity_blocks, context.block_bytes)
            except OverflowError:  # more bytes than any mapping can have
                raise ConfigError(
                    f"capacity_blocks={self.capacity_blocks} of {context.block_bytes} bytes is "
                    "more memory than this machine can map"
                ) from None

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
        self._flush_or_raise(key, writing=False)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """Keep a copy of ``data`` as ``key``'s block, evicting if full.

        Cancellation: the copy is atomic (the block is either absent or complete).
        """
        self._write_now(key, data)
        self._flush_or_raise(key, writing=True)

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
        """Queue the copy of ``key``'s block into ``into`` (done by the next ``flush``)."""
        if into.nbytes != self._block_bytes:
            self._check_size(into)
        if into.readonly:
            raise ValueError("cannot read a block into a read-only buffer")
        if not self._store.copy_out(key, address_of(into)):
            raise BlockNotFound(key)
        if self._policy is not None:
            self._policy.access(key)

    def _write_now(self, key: OffloadKey, data: memoryview) -> None:
        victims = self._put(key, data)
        if victims:
            self.report_removed(victims)

    def _put(self, key: OffloadKey, data: memoryview) -> list[OffloadKey]:
        """Store ``data`` as ``key``'s block; return the keys evicted to make room.

        The copy itself is queued: the caller flushes the store before it
        awaits anything or returns, so no other coroutine sees the key early.
        """
        if data.nbytes != self._block_bytes:
            self._check_size(data)
        source = address_of(data)
        store, policy = self._store, self._policy
        if key in store:
            store.put(key, source, data)
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
        store.put(key, source, data)
        if policy is not None:
            policy.insert(key)
        return victims

    def _flush(
        self, keys: list[OffloadKey], errors: dict[OffloadKey, BaseException], *, writing: bool
    ) -> None:
        """Run the queued copies of ``keys``; if they fail, those keys move to ``errors``.

        A failed write leaves its keys absent (dropped); a failed read changes nothing.
        """
        try:
            self._store.flush()
        except OSError as exc:
            for key in keys:
                errors[key] = exc
                if writing and self._store.drop(key) and self._policy is not None:
                    self._policy.remove(key)
            keys.clear()

    def _flush_or_raise(self, key: OffloadKey, *, writing: bool) -> None:
        errors: dict[OffloadKey, BaseException] = {}
        self._flush([key], errors, writing=writing)
        if errors:
            raise errors[key]

    async def _batch(
        self,
        keys: Sequence[OffloadKey],
        buffers: Sequence[memoryview],
        operation: Callable[[OffloadKey, memoryview], None],
    ) -> None:
        if len(keys) != len(buffers):
            raise ValueError(f"{len(keys)} keys but {len(buffers)} buffers")
        errors: dict[OffloadKey, BaseException] = {}
        succeeded: list[OffloadKey] = []
        queued: list[OffloadKey] = []  # keys whose copies wait for the next flush
        copied = 0
        writing = operation == self._write_now
        evicted = self._make_room(keys) if writing else []
        for key, buffer in zip(keys, buffers, strict=True):
            if copied >= _YIELD_EVERY_BYTES:
                copied = 0
                self._flush(queued, errors, writing=writing)
                succeeded.extend(queued)
                queued = []
                if evicted:  # report before yielding: lookups must not outlive the block
                    self._report_gone(evicted)
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
                queued.append(key)
                copied += buffer.nbytes
        self._flush(queued, errors, writing=writing)
        succeeded.extend(queued)
        if evicted:
            self._report_gone(evicted)
        if errors:
            raise PartialBatchError(succeeded, cast(dict[bytes, BaseException], errors))

    def _report_gone(self, evicted: list[OffloadKey]) -> None:
        """Report the victims no longer held: a batch over the capacity may have written a
        victim again after evicting it (that block is held, not removed)."""
        store = self._store
        gone = [key for key in dict.fromkeys(evicted) if key not in store]
        if gone:
            self.report_removed(gone)

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
