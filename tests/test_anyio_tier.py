"""A tier written only against anyio passes the conformance kit, directly and through the facade.

``AnyioTier`` imports nothing from asyncio: its batch forms run in an anyio
task group under a ``CapacityLimiter``, its round trips are ``anyio.sleep``
under ``fail_after``, ``touch`` is best effort under ``move_on_after``, and
checksums run in worker threads through ``anyio.to_thread.run_sync`` with the
tier's own limiter. Threads only ever see immutable copies (``bytes``), and
the medium changes only on the loop after the last ``await``: the runtime
cancels a job with a plain ``Task.cancel()``, which anyio's shielding does
not hold back, so a thread may outlive a cancelled operation (see
``tiering.tier.run_in_thread`` for the buffer-sharing case).
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterable, Sequence

import anyio
import anyio.to_thread
import numpy as np

from tests.runtime_support import key, load, results, store
from tiering.core.errors import BlockNotFound, CorruptBlock, PartialBatchError
from tiering.core.keys import NO_CONTEXT, OffloadKey
from tiering.runtime import AsyncTierManager
from tiering.testing.conformance import conformance_tests
from tiering.tier import AsyncTier

_Operation = Callable[[OffloadKey, memoryview], Awaitable[None]]


def _digest(block: bytes) -> bytes:
    return hashlib.blake2b(block, digest_size=16).digest()  # releases the GIL for large blocks


class AnyioTier(AsyncTier):
    """Blocks behind a simulated remote store, with checksums computed in threads; LRU-bounded."""

    max_concurrency = 8
    max_threads = 4
    verifies_reads = True

    def __init__(
        self, round_trip_s: float = 0.0005, capacity_blocks: int = 4096, timeout_s: float = 5.0
    ) -> None:
        self.round_trip_s = round_trip_s
        self.capacity_blocks = capacity_blocks
        self.timeout_s = timeout_s
        self._blocks: OrderedDict[OffloadKey, tuple[bytes, bytes]] = OrderedDict()

    async def _round_trip(self) -> None:
        with anyio.fail_after(self.timeout_s):
            await anyio.sleep(self.round_trip_s)

    async def contains(self, key: OffloadKey) -> bool:
        await self._round_trip()
        return key in self._blocks

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        await self._round_trip()
        if key not in self._blocks:
            raise BlockNotFound(key)
        block, digest = self._blocks[key]
        if await anyio.to_thread.run_sync(_digest, block, limiter=self.thread_limiter) != digest:
            raise CorruptBlock(key, "checksum mismatch")
        into[:] = block  # on the loop, after the last await: a cancelled read never writes

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        block = bytes(data)  # copied now: ``data`` is ours only until we return
        digest = await anyio.to_thread.run_sync(_digest, block, limiter=self.thread_limiter)
        await self._round_trip()
        self._blocks[key] = (block, digest)  # published whole, after the last await
        self._blocks.move_to_end(key)
        evicted: list[OffloadKey] = []
        while len(self._blocks) > self.capacity_blocks:
            evicted.append(self._blocks.popitem(last=False)[0])
        self.report_removed(evicted)

    async def delete(self, key: OffloadKey) -> None:
        await self._round_trip()
        self._blocks.pop(key, None)

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        with anyio.move_on_after(self.timeout_s):  # recency is a hint: give up rather than wait
            await self._round_trip()
            for k in keys:
                if k in self._blocks:
                    self._blocks.move_to_end(k)

    async def list_keys(self) -> Iterable[OffloadKey]:
        return list(self._blocks)

    async def contains_many(self, keys: Sequence[OffloadKey]) -> list[bool]:
        await self._round_trip()  # one round trip for the whole batch
        return [k in self._blocks for k in keys]

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        await self._batch([(k, self.read, b) for k, b in zip(keys, into, strict=True)])

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        await self._batch([(k, self.write, d) for k, d in zip(keys, data, strict=True)])

    async def _batch(self, operations: list[tuple[OffloadKey, _Operation, memoryview]]) -> None:
        """Every operation in one task group, ``max_concurrency`` at once; errors collected."""
        limiter = anyio.CapacityLimiter(self.max_concurrency)
        errors: dict[bytes, BaseException] = {}
        succeeded: list[bytes] = []

        async def one(k: OffloadKey, operation: _Operation, buffer: memoryview) -> None:
            async with limiter:
                try:
                    await operation(k, buffer)
                except Exception as exc:  # one block's failure must not cancel the others
                    errors[k] = exc
                else:
                    succeeded.append(k)

        async with anyio.create_task_group() as group:
            for k, operation, buffer in operations:
                group.start_soon(one, k, operation, buffer)
        if errors:
            raise PartialBatchError(succeeded, errors)


globals().update(conformance_tests(AnyioTier, prefix="test_kit_", skip=("persistence",)))


def test_the_anyio_tier_round_trips_through_the_facade_and_evicts_with_reports() -> None:
    block_bytes = 4096
    rows = np.zeros((8, block_bytes), dtype=np.uint8)
    tier = AnyioTier(capacity_blocks=2)
    with AsyncTierManager(tier, rows.data, "anyio", name="anyio0") as manager:
        keys = [key(i) for i in range(3)]
        for i in range(3):  # one job each, in order: which block is oldest is known
            rows[i] = i + 1
            manager.submit_store(store(i + 1, [keys[i]], [i]))
            (stored,) = results(manager).values()
            assert stored.success
        # The oldest block was evicted by the write of the third: lookups know it at once.
        assert [manager.lookup(k, NO_CONTEXT) for k in keys] == [False, True, True]
        manager.submit_load(load(4, keys[1:], [5, 6]))
        (loaded,) = results(manager).values()
        assert loaded.success
        assert rows[5].tolist() == [2] * block_bytes and rows[6].tolist() == [3] * block_bytes
        assert manager.stats().blocks_removed == 1
