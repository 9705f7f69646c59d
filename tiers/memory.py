"""The in-memory tier: the seed's example tier made real, and the reference implementation.

It keeps each block's bytes in a dict, optionally bounded by a number of
blocks or bytes, evicting with one of the framework's policies (``"lru"`` or
``"arc"``) and reporting evictions through :meth:`AsyncTier.report_removed`.
Every operation completes without awaiting anything, so it is trivially
cancellation-safe: a write either happened entirely or not at all.

Config (``secondary_tiers`` entry)::

    {"type": "memory", "capacity_bytes": 8 << 30, "eviction_policy": "arc"}
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Hashable, Iterable, Sequence
from typing import cast

from tiering.errors import BlockNotFound, ConfigError, PartialBatchError
from tiering.keys import OffloadKey
from tiering.policies import POLICY_NAMES, EvictionPolicy, make_policy
from tiering.tier import AsyncTier, TierContext

logger = logging.getLogger(__name__)

#: Batch forms yield to the event loop after copying this many bytes, so a
#: large batch never holds the loop for more than a few milliseconds.
_YIELD_EVERY_BYTES = 8 << 20


class MemoryTier(AsyncTier):
    """Blocks held in this process's memory, optionally bounded with eviction.

    ``capacity_blocks`` or ``capacity_bytes`` (not both) bounds the tier; the
    byte bound is turned into whole blocks at :meth:`open`. Unbounded when
    neither is given. ``eviction_policy`` names the policy choosing victims.
    Reads and writes count as uses for the policy; :meth:`touch` too.
    """

    max_concurrency = 64

    def __init__(
        self,
        *,
        capacity_blocks: int | None = None,
        capacity_bytes: int | None = None,
        eviction_policy: str = "lru",
    ) -> None:
        if capacity_blocks is not None and capacity_bytes is not None:
            raise ConfigError("give capacity_blocks or capacity_bytes, not both")
        for name, value in (
            ("capacity_blocks", capacity_blocks),
            ("capacity_bytes", capacity_bytes),
        ):
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
        self._blocks: dict[OffloadKey, bytes] = {}

    async def open(self, context: TierContext) -> None:
        """Size the bound in blocks and build the eviction policy.

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
        if self.capacity_blocks is not None:
            self._policy = make_policy(self._policy_name, self.capacity_blocks)

    @property
    def num_blocks(self) -> int:
        """Blocks held now."""
        return len(self._blocks)

    async def contains(self, key: OffloadKey) -> bool:
        """Whether ``key`` is held. Cancellation: no side effects."""
        return key in self._blocks

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
        if self._blocks.pop(key, None) is not None and self._policy is not None:
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
        return list(self._blocks)

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        """``read`` of each key in turn (no task per key). Cancellation: per block atomic."""
        await self._batch(keys, into, self._read_now)

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        """``write`` of each key in turn (no task per key). Cancellation: per block atomic."""
        await self._batch(keys, data, self._write_now)

    async def aclose(self) -> None:
        """Drop every block. Idempotent. Cancellation: atomic."""
        self._blocks.clear()
        if self._policy is not None and self.capacity_blocks is not None:
            self._policy = make_policy(self._policy_name, self.capacity_blocks)

    # -- synchronous cores ------------------------------------------------------------------

    def _check_size(self, buffer: memoryview) -> None:
        if buffer.nbytes != self.block_bytes:
            raise ValueError(f"buffer of {buffer.nbytes} bytes; blocks are {self.block_bytes}")

    def _read_now(self, key: OffloadKey, into: memoryview) -> None:
        self._check_size(into)
        block = self._blocks.get(key)
        if block is None:
            raise BlockNotFound(key)
        into[:] = block
        if self._policy is not None:
            self._policy.access(key)

    def _write_now(self, key: OffloadKey, data: memoryview) -> None:
        self._check_size(data)
        block = bytes(data)
        policy = self._policy
        if key in self._blocks:
            self._blocks[key] = block
            if policy is not None:
                policy.access(key)
            return
        if policy is not None and len(self._blocks) >= policy.capacity:
            victims = [
                cast(OffloadKey, v)
                for v in policy.evict(len(self._blocks) - policy.capacity + 1, _any_key)
            ]
            for victim in victims:
                del self._blocks[victim]
            self.report_removed(victims)
        self._blocks[key] = block
        if policy is not None:
            policy.insert(key)

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
        for key, buffer in zip(keys, buffers, strict=True):
            if copied >= _YIELD_EVERY_BYTES:
                copied = 0
                await asyncio.sleep(0)
            try:
                operation(key, buffer)
            except Exception as exc:
                errors[key] = exc
            else:
                succeeded.append(key)
                copied += buffer.nbytes
        if errors:
            raise PartialBatchError(succeeded, errors)


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
