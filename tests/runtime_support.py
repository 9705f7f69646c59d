"""Helpers shared by the runtime tests: primary buffers, jobs, instrumented tiers."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import pytest

from tiering.core.errors import BlockNotFound, TierClosedError
from tiering.core.jobs import JobMetadata, JobResult
from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.runtime import AsyncTierManager
from tiering.tier import AsyncTier
from tiers.memory import MemoryTier

BLOCK = 4096


def primary(rows: int = 32, block: int = BLOCK) -> np.ndarray:
    """A zeroed primary buffer of ``rows`` blocks."""
    return np.zeros((rows, block), dtype=np.uint8)


def fill(buffer: np.ndarray, row: int) -> bytes:
    """Put random bytes in ``row``; return them."""
    data = os.urandom(buffer.shape[1])
    buffer[row] = np.frombuffer(data, dtype=np.uint8)
    return data


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), group)


def store(job_id: int, keys: Sequence[OffloadKey], rows: Sequence[int]) -> JobMetadata:
    return JobMetadata(job_id, tuple(keys), np.array(rows, dtype=np.int64), is_promotion=False)


def load(job_id: int, keys: Sequence[OffloadKey], rows: Sequence[int]) -> JobMetadata:
    return JobMetadata(job_id, tuple(keys), np.array(rows, dtype=np.int64), is_promotion=True)


@dataclass
class LooseJob:
    """A duck-typed job that skips JobMetadata's own validation (to test the facade's)."""

    job_id: int
    keys: tuple[OffloadKey, ...]
    block_ids: list[int]
    is_promotion: bool = False


def results(manager: AsyncTierManager, timeout_s: float = 20.0) -> dict[int, JobResult]:
    """Wait for every submitted job and return the results by job id."""
    manager.drain(timeout_s)
    return {r.job_id: r for r in manager.get_finished()}


def one_result(manager: AsyncTierManager, timeout_s: float = 20.0) -> JobResult:
    (result,) = results(manager, timeout_s).values()
    return result


def wait_until(predicate: object, timeout_s: float = 10.0) -> None:
    """Poll ``predicate()`` until true (for state the loop thread publishes asynchronously)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout_s} s")
        time.sleep(0.002)


class SlowTier(MemoryTier):
    """A memory tier whose operations take ``delay_s`` and record their concurrency.

    ``peak`` is the most operations seen at once; ``same_key_overlaps`` counts
    operations started on a key another operation was still working on.
    """

    max_concurrency = 4

    def __init__(self, delay_s: float = 0.002, **kwargs: object) -> None:
        super().__init__(**kwargs)  # type: ignore[arg-type]
        self.delay_s = delay_s
        self.active = 0
        self.peak = 0
        self.busy_keys: Counter[OffloadKey] = Counter()
        self.same_key_overlaps = 0
        self.calls: Counter[str] = Counter()

    async def _op(self, name: str, key: OffloadKey) -> None:
        self.calls[name] += 1
        self.active += 1
        self.peak = max(self.peak, self.active)
        if self.busy_keys[key]:
            self.same_key_overlaps += 1
        self.busy_keys[key] += 1

    def _done(self, key: OffloadKey) -> None:
        self.active -= 1
        self.busy_keys[key] -= 1

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        await self._op("read", key)
        try:
            await asyncio.sleep(self.delay_s)
            await super().read(key, into)
        finally:
            self._done(key)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        await self._op("write", key)
        try:
            await asyncio.sleep(self.delay_s)
            await super().write(key, data)
        finally:
            self._done(key)

    # The per-key defaults, so every block goes through read()/write() above.
    read_many = AsyncTier.read_many
    write_many = AsyncTier.write_many


class SharedStore:
    """The medium several :class:`SharedTier` instances share (think: one Redis)."""

    def __init__(self) -> None:
        self.blocks: dict[OffloadKey, bytes] = {}


class SharedTier(AsyncTier):
    """A tier over a :class:`SharedStore` that others change behind its back (``shared = True``)."""

    shared = True
    max_concurrency = 8

    def __init__(self, store: SharedStore, gate: threading.Event | None = None) -> None:
        self.store = store
        self.contains_calls: list[list[OffloadKey]] = []
        #: While set up and not yet set, membership checks do not finish (the test decides).
        self.gate = gate

    async def contains(self, key: OffloadKey) -> bool:
        return key in self.store.blocks

    async def contains_many(self, keys: Sequence[OffloadKey]) -> list[bool]:
        self.contains_calls.append(list(keys))
        await asyncio.sleep(0.001)
        if self.gate is not None:
            await asyncio.to_thread(self.gate.wait, 30)  # bounded: a failing test still ends
        return [k in self.store.blocks for k in keys]

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        block = self.store.blocks.get(key)
        if block is None:
            raise BlockNotFound(key)
        into[:] = block

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        self.store.blocks[key] = bytes(data)

    async def list_keys(self) -> Iterable[OffloadKey]:
        return ()


def assert_every_call_refused_after_shutdown(manager: AsyncTierManager) -> None:
    """Every scheduler-facing call of a shut-down manager raises ``TierClosedError``."""
    for call in (
        lambda: manager.lookup(key(1), NO_CONTEXT),
        lambda: manager.lookup_state(key(1)),
        lambda: manager.submit_store(store(1, [key(1)], [0])),
        lambda: manager.submit_load(load(1, [key(1)], [0])),
        lambda: manager.get_finished(),
        lambda: manager.drain(1),
        lambda: manager.touch([key(1)], NO_CONTEXT),
        lambda: manager.get_num_blocks(),
        lambda: manager.take_events(),
    ):
        with pytest.raises(TierClosedError):
            call()
    assert manager.stats().closed


def assert_store_load_lookup(manager: AsyncTierManager, rows: np.ndarray) -> None:
    """Row 0 stored as key 1, loaded back into row 1 byte for byte, then looked up."""
    data = fill(rows, 0)
    manager.submit_store(store(1, [key(1)], [0]))
    assert one_result(manager).success
    manager.submit_load(load(2, [key(1)], [1]))
    assert one_result(manager).success and bytes(rows[1]) == data
    assert manager.lookup(key(1), NO_CONTEXT) is True
