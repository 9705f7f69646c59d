"""Shared helpers of the manager tests: a real stack (CPU primary tier, async facades over
in-memory tiers), deterministic block bytes, and a store/promote driver acting as the GPU side."""

from __future__ import annotations

import asyncio
import hashlib
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tiering.core.jobs import JobMetadata, JobResult, SecondaryTierManager
from tiering.core.keys import NO_CONTEXT, OffloadKey, ReqContext, make_offload_key
from tiering.core.specs import BlockIDsLoadStoreSpec, LoadStoreSpec
from tiering.manager import TieringOffloadingManager
from tiering.primary import CPUPrimaryTier
from tiering.runtime.facade import AsyncTierManager
from tiering.tier import AsyncTier
from tiers.memory import MemoryTier

BLOCK_BYTES = 64
WAIT_S = 20.0  # a hang guard, never a performance assertion


def key(i: int, group: int = 0) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), group)


def pattern(k: OffloadKey, block_bytes: int = BLOCK_BYTES) -> bytes:
    """The bytes the 'GPU' writes for block ``k``: distinct per key, deterministic."""
    seed = hashlib.blake2b(k, digest_size=32).digest()
    return (seed * (block_bytes // len(seed) + 1))[:block_bytes]


def rows_of(spec: LoadStoreSpec) -> list[int]:
    assert isinstance(spec, BlockIDsLoadStoreSpec)
    return [int(r) for r in spec.block_ids]


def make_primary(num_blocks: int = 8, **kwargs: Any) -> CPUPrimaryTier:
    return CPUPrimaryTier(num_blocks, BLOCK_BYTES, require_alignment=False, **kwargs)


def make_facade(
    tier: AsyncTier, primary: CPUPrimaryTier, tier_type: str = "memory"
) -> AsyncTierManager:
    return AsyncTierManager(tier, primary.kv_view, tier_type)


def write_row(primary: CPUPrimaryTier, row: int, data: bytes) -> None:
    primary.buffer.row(row)[:] = data


def read_row(primary: CPUPrimaryTier, row: int) -> bytes:
    return bytes(primary.buffer.row(row))


def store(
    manager: TieringOffloadingManager,
    keys: Sequence[OffloadKey],
    ctx: ReqContext = NO_CONTEXT,
    *,
    success: bool = True,
) -> list[OffloadKey]:
    """prepare_store, write each block's pattern into its row (the GPU's job), complete_store."""
    output = manager.prepare_store(keys, ctx)
    assert output is not None, "no room to store"
    primary = manager.primary
    assert isinstance(primary, CPUPrimaryTier)
    for k, row in zip(output.keys_to_store, rows_of(output.store_spec), strict=True):
        write_row(primary, row, pattern(k))
    manager.complete_store(output.keys_to_store, success)
    return list(output.keys_to_store)


def load_and_verify(
    manager: TieringOffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext = NO_CONTEXT
) -> None:
    """prepare_load, check every row holds its key's pattern, complete_load."""
    spec = manager.prepare_load(keys, ctx)
    primary = manager.primary
    assert isinstance(primary, CPUPrimaryTier)
    try:
        for k, row in zip(keys, rows_of(spec), strict=True):
            assert read_row(primary, row) == pattern(k), f"wrong bytes for {k.hex()}"
    finally:
        manager.complete_load(keys)


def step_until(
    manager: TieringOffloadingManager, done: Callable[[], bool], what: str = "condition"
) -> None:
    deadline = time.monotonic() + WAIT_S
    while not done():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}; stats: {manager.stats()}")
        manager.step()
        time.sleep(0.0005)


def settle(manager: TieringOffloadingManager) -> None:
    """Step (at least once: a step ends) until no job is staged or in flight."""
    manager.step()
    step_until(
        manager,
        lambda: manager.jobs_in_flight() == 0 and manager.stats().staged_promotions == 0,
        "jobs to finish",
    )


def promote(
    manager: TieringOffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext = NO_CONTEXT
) -> list[bool | None]:
    """Look keys up until each answers True or False; return the first answers."""
    first = [manager.lookup(k, ctx) for k in keys]
    answers: list[bool | None] = list(first)

    def resolved() -> bool:
        for i, k in enumerate(keys):
            if answers[i] is None:
                answers[i] = manager.lookup(k, ctx)
        return all(a is not None for a in answers)

    step_until(manager, resolved, "promotions to resolve")
    return first


class GatedMemoryTier(MemoryTier):
    """A memory tier whose writes and/or reads wait until the test opens a gate."""

    def __init__(self, *, gate_writes: bool = True, gate_reads: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.gate = threading.Event()
        self._gate_writes = gate_writes
        self._gate_reads = gate_reads

    async def _wait(self) -> None:
        # The gate is opened from the test's thread: a threading.Event, polled.
        while not self.gate.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.001)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        if self._gate_writes:
            await self._wait()
        await super().write(key, data)

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        if self._gate_reads:
            await self._wait()
        await super().read(key, into)

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        if self._gate_writes:
            await self._wait()
        await super().write_many(keys, data)

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        if self._gate_reads:
            await self._wait()
        await super().read_many(keys, into)


class RecordingTier(SecondaryTierManager):
    """Passes everything through to ``inner`` and records job ids submitted and results seen."""

    def __init__(self, inner: SecondaryTierManager) -> None:
        super().__init__(inner._primary_kv_view, inner.tier_type)
        self.inner = inner
        self.submitted: list[int] = []
        self.results: list[JobResult] = []
        self.loads = 0
        self.stores = 0
        self.touched: list[list[OffloadKey]] = []

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        return self.inner.lookup(key, req_context)

    def submit_store(self, job_metadata: JobMetadata) -> None:
        self.submitted.append(job_metadata.job_id)
        self.stores += 1
        self.inner.submit_store(job_metadata)

    def submit_load(self, job_metadata: JobMetadata) -> None:
        self.submitted.append(job_metadata.job_id)
        self.loads += 1
        self.inner.submit_load(job_metadata)

    def get_finished(self) -> Iterable[JobResult]:
        finished = list(self.inner.get_finished())
        self.results.extend(finished)
        return finished

    def touch(self, keys: Iterable[OffloadKey], req_context: ReqContext) -> None:  # type: ignore[override]
        self.touched.append(list(keys))
        self.inner.touch(list(keys), req_context)

    def get_num_blocks(self) -> int:
        return self.inner.get_num_blocks()

    def take_events(self) -> Iterable[tuple[list[OffloadKey], bool]]:
        return self.inner.take_events()

    def stats(self) -> object:
        return self.inner.stats() if isinstance(self.inner, AsyncTierManager) else None

    def drain(self, timeout_s: float) -> object:
        drain = getattr(self.inner, "drain", None)
        return drain(timeout_s) if callable(drain) else None

    def shutdown(self) -> None:
        self.inner.shutdown()

    def check_one_result_per_job(self) -> None:
        result_ids = [r.job_id for r in self.results]
        assert len(result_ids) == len(set(result_ids)), f"duplicate results: {result_ids}"
        assert sorted(result_ids) == sorted(self.submitted), (
            f"submitted {sorted(self.submitted)} but results for {sorted(result_ids)}"
        )


def leftover_threads(before: set[threading.Thread]) -> list[threading.Thread]:
    """Threads started since ``before`` that are still alive (give stragglers a moment)."""
    deadline = time.monotonic() + 5.0
    while True:
        extra = [t for t in threading.enumerate() if t not in before and t.is_alive()]
        if not extra or time.monotonic() > deadline:
            return extra
        time.sleep(0.01)
