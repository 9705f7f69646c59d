"""The checks of how a tier behaves inside the runtime: loop stalls and job deadlines.

``loop_not_blocked`` samples the event loop with a 1 ms ticker while the tier
serves one operation at a time, each kind (write, read, contains, the batch
forms) ``loop_samples`` times, each call after an idle control turn. It fails
when nearly all calls of one kind (80 %) stall the loop past
``max_loop_lag_s`` and far more often than the control turns do: a tier
blocking the loop stalls every call it blocks in, a busy machine stalls
control turns as often as operations.
``deadline_through_facade`` runs jobs through
:class:`~tiering.runtime.AsyncTierManager` and checks a hung job fails at its
deadline and the tier keeps working.
"""

from __future__ import annotations

import asyncio
import functools
import math
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from tiering.core.keys import OffloadKey
from tiering.testing.conformance.checks_data import with_tier
from tiering.testing.conformance.kit import Kit, TrackedTier

_TICK_S = 0.001


class LoopSampler:
    """A task ticking every millisecond; :attr:`worst` is the longest lateness since reset."""

    def __init__(self) -> None:
        self.worst = 0.0
        self._stopped = False
        self._task: asyncio.Task[None] | None = None

    async def _tick(self) -> None:
        while not self._stopped:
            before = time.perf_counter()
            await asyncio.sleep(_TICK_S)
            self.worst = max(self.worst, time.perf_counter() - before - _TICK_S)

    def start(self) -> None:
        self._task = asyncio.ensure_future(self._tick())

    async def stop(self) -> None:
        self._stopped = True
        if self._task is not None:
            await self._task

    async def measure(self, operation: Callable[[], Awaitable[Any]]) -> float:
        """The loop's worst stall while ``operation`` runs (and the ticker catches up)."""
        await asyncio.sleep(2 * _TICK_S)  # the ticker is between ticks, not mid-stall
        self.worst = 0.0
        await operation()
        await asyncio.sleep(3 * _TICK_S)  # the tick delayed by a stall lands
        return self.worst


#: A kind of operation fails when at least this share of its calls stalls the loop ...
_STALLED_SHARE = 0.8
#: ... and that share exceeds the share of stalled idle control turns by this much.
_OVER_CONTROL = 0.5


@with_tier
async def loop_not_blocked(kit: Kit, tier: TrackedTier) -> None:
    """The tier never holds the event loop past ``max_loop_lag_s`` in its operations.

    Each call is preceded by an idle control turn measured the same way, so a
    busy machine (which stalls both) is told apart from a tier that blocks
    (which stalls nearly every one of its calls, and only those).
    """
    limit = kit.options.max_loop_lag_s
    samples = kit.options.loop_samples
    must_stall = math.ceil(samples * _STALLED_SHARE)
    keys = kit.keys(kit.within_capacity(tier, samples * 3))
    pairs = [keys[i : i + 2] for i in range(samples, len(keys) - 1, 2)]
    blocks = {k: kit.data(k) for k in keys}
    buffers = [bytearray(kit.options.block_bytes) for _ in range(2)]
    stalls: dict[str, list[float]] = {}
    control: list[float] = []
    sampler = LoopSampler()
    sampler.start()

    def verdict() -> str | None:
        control_share = sum(s > limit for s in control) / max(1, len(control))
        for kind, seen in stalls.items():
            over = sum(s > limit for s in seen)
            if over >= must_stall and over / len(seen) - control_share >= _OVER_CONTROL:
                worst = ", ".join(f"{s * 1e3:.0f}" for s in sorted(seen, reverse=True)[:5])
                return (
                    f"{kind}() stalled the event loop past {limit * 1e3:.0f} ms "
                    f"(max_loop_lag_s) in {over} of {len(seen)} calls (worst {worst} ms), idle "
                    f"control turns in {control_share:.0%}: the tier blocks the loop "
                    "(use async I/O or tiering.tier.run_in_thread)"
                )
        return None

    try:
        for i in range(samples):
            key = keys[i % len(keys)]
            pair = pairs[i % len(pairs)] if pairs else [key]
            for kind, operation in _operations(tier, key, pair, blocks, buffers).items():
                control.append(await sampler.measure(functools.partial(asyncio.sleep, _TICK_S)))
                stalls.setdefault(kind, []).append(await sampler.measure(operation))
            failure = verdict()
            if failure:
                raise kit.fail(failure)
    finally:
        await sampler.stop()


def _operations(
    tier: TrackedTier,
    key: OffloadKey,
    pair: list[OffloadKey],
    blocks: dict[OffloadKey, bytearray],
    buffers: list[bytearray],
) -> dict[str, Callable[[], Awaitable[Any]]]:
    """One call of each kind ``loop_not_blocked`` samples."""
    views = [memoryview(blocks[k]) for k in pair]
    return {
        "write": functools.partial(tier.write, key, memoryview(blocks[key])),
        "read": functools.partial(tier.read, key, memoryview(buffers[0])),
        "contains": functools.partial(tier.contains, key),
        "write_many": functools.partial(tier.write_many, pair, views),
        "read_many": functools.partial(
            tier.read_many, pair, [memoryview(b) for b in buffers[: len(pair)]]
        ),
        "contains_many": functools.partial(tier.contains_many, pair),
    }


async def deadline_through_facade(kit: Kit) -> None:
    """Through the runtime, a hung job fails at its deadline and the next jobs still work."""
    # Imported here: the runtime imports this package's siblings, not the reverse.
    import numpy as np

    from tiering.core.jobs import JobMetadata
    from tiering.core.keys import NO_CONTEXT
    from tiering.runtime import AsyncTierManager
    from tiering.testing.faults import FaultPlan, FaultyTier

    def ids(*block_ids: int) -> Any:
        return np.array(block_ids, dtype=np.int64)

    hung_key = kit.key()
    tier = FaultyTier(
        await kit.new_raw_tier(),
        FaultPlan(hang_rate=1.0, keys={hung_key}, ops={"write", "read", "contains"}),
    )
    rows = np.zeros((4, kit.options.block_bytes), dtype=np.uint8)
    manager = await asyncio.to_thread(
        AsyncTierManager,
        tier,
        rows.data,
        "conformance",
        layout_fingerprint=kit.options.layout_fingerprint,
        job_timeout_s=kit.options.job_timeout_s,
    )
    try:
        rows[0] = np.frombuffer(os.urandom(kit.options.block_bytes), dtype=np.uint8)
        manager.submit_store(JobMetadata(1, (hung_key,), ids(0), is_promotion=False))
        await asyncio.to_thread(manager.drain, 30.0)
        (result,) = manager.get_finished()
        if result.success:
            raise kit.fail("a store whose write hangs did not fail at its deadline")
        if not result.error or "deadline" not in result.error:
            raise kit.fail(f"a hung store failed with {result.error!r}, not at its deadline")
        if manager.lookup(hung_key, NO_CONTEXT) is True:
            raise kit.fail("a key whose store timed out is a lookup hit")
        # The tier still works after a timed-out job.
        good_key = kit.key()
        rows[1] = np.frombuffer(bytes(kit.data(good_key)), dtype=np.uint8)
        manager.submit_store(JobMetadata(2, (good_key,), ids(1), is_promotion=False))
        await asyncio.to_thread(manager.drain, 30.0)
        (stored,) = manager.get_finished()
        if not stored.success:
            raise kit.fail(f"a store after a timed-out job failed: {stored.error}")
        manager.submit_load(JobMetadata(3, (good_key,), ids(2), is_promotion=True))
        await asyncio.to_thread(manager.drain, 30.0)
        (loaded,) = manager.get_finished()
        if not loaded.success:
            raise kit.fail(f"a load after a timed-out job failed: {loaded.error}")
        if bytes(rows[2]) != bytes(rows[1]):
            raise kit.mismatch(good_key, bytes(rows[1]), bytes(rows[2]), "a load via the runtime")
    finally:
        await asyncio.to_thread(manager.shutdown)
