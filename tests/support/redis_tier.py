"""Helpers for tests that drive a ``RedisTier`` directly (opened with a ``TierContext``)."""

from __future__ import annotations

import itertools
import os
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import numpy as np

from tiering.core.jobs import JobMetadata, JobResult
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.runtime import AsyncTierManager
from tiering.tier import TierContext
from tiers.redis import RedisTier

BLOCK_BYTES = 4096
FINGERPRINT = "test-model/fp16/16tok"


def new_keys(count: int) -> list[OffloadKey]:
    """Random keys no other test uses."""
    return [make_offload_key(os.urandom(16), i % 3) for i in range(count)]


def new_blocks(count: int, block_bytes: int = BLOCK_BYTES) -> list[bytearray]:
    return [bytearray(os.urandom(block_bytes)) for _ in range(count)]


def views(buffers: list[bytearray]) -> list[memoryview]:
    return [memoryview(b) for b in buffers]


def context(block_bytes: int = BLOCK_BYTES, fingerprint: str = FINGERPRINT) -> TierContext:
    return TierContext(block_bytes=block_bytes, layout_fingerprint=fingerprint, name="redis-test")


@asynccontextmanager
async def opened_tier(
    url: str,
    *,
    block_bytes: int = BLOCK_BYTES,
    fingerprint: str = FINGERPRINT,
    **settings: Any,
) -> AsyncIterator[RedisTier]:
    """A ``RedisTier`` opened on ``url`` for the duration of the block, always closed after."""
    settings.setdefault("namespace", "test-" + os.urandom(4).hex())
    tier = RedisTier(url=url, **settings)
    await tier.open(context(block_bytes, fingerprint))
    try:
        yield tier
    finally:
        await tier.aclose()


async def read_back(tier: RedisTier, key: OffloadKey) -> bytes:
    into = bytearray(tier.block_bytes)
    await tier.read(key, memoryview(into))
    return bytes(into)


def count_round_trips(tier: RedisTier) -> list[int]:
    """Spy on the tier's client: one entry (the command count) per pipeline executed."""
    client: Any = tier._round_trips.client
    real_pipeline = client.pipeline
    executed: list[int] = []

    def pipeline(*args: Any, **kwargs: Any) -> Any:
        pipe = real_pipeline(*args, **kwargs)
        real_execute = pipe.execute

        async def execute(*a: Any, **kw: Any) -> Any:
            executed.append(len(pipe))
            return await real_execute(*a, **kw)

        pipe.execute = execute
        return pipe

    client.pipeline = pipeline
    return executed


def collect_removed(tier: RedisTier) -> list[OffloadKey]:
    removed: list[OffloadKey] = []
    tier._bind_removed_sink(removed.extend)
    return removed


_job_ids = itertools.count(1)


def run_job(
    manager: AsyncTierManager,
    block_keys: list[OffloadKey],
    block_ids: list[int],
    *,
    load: bool,
    wait_s: float = 20.0,
) -> JobResult:
    """Submit one store (or load) job through the facade and return its result."""
    job = JobMetadata(next(_job_ids), tuple(block_keys), np.array(block_ids), is_promotion=load)
    if load:
        manager.submit_load(job)
    else:
        manager.submit_store(job)
    manager.drain(wait_s)
    (result,) = list(manager.get_finished())
    assert result.job_id == job.job_id
    return result
