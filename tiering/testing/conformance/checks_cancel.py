"""The checks of cancellation and buffer lifetime: nothing partial, nothing late.

A tier operation may be cancelled at any await (deadline, shutdown). These
checks cancel writes and reads at a range of points and then check that no
partial block is readable, that a cancelled read leaves the stored block
intact, and that no buffer is touched once its operation has ended (a thread
or the kernel still copying into a primary-tier row that now holds another
block). Buffers are watched together for ``late_write_window_s`` after the
last operation ended, long enough for a thread pool under load.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable

from tiering.core.errors import BlockNotFound
from tiering.core.keys import OffloadKey
from tiering.testing.conformance.checks_data import with_tier
from tiering.testing.conformance.kit import Kit, TrackedTier, show_key

#: Cancel points: loop turns, then a little wall time (for tiers doing real I/O).
CANCEL_POINTS = [(s, 0.0) for s in range(8)] + [(0, 0.0005), (0, 0.002), (1, 0.005)]


async def cancel_after(operation: Awaitable[None], steps: int, wall_s: float) -> bool:
    """Run ``operation`` as a task, cancel it after ``steps`` loop turns plus ``wall_s``.

    Returns whether the operation was really cancelled (False: it had finished).
    """
    task = asyncio.ensure_future(operation)
    for _ in range(steps):
        await asyncio.sleep(0)
    if wall_s:
        await asyncio.sleep(wall_s)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


def _where(steps: int, wall_s: float) -> str:
    return f"(cancelled after {steps} loop turns + {wall_s * 1e3:.1f} ms)"


@with_tier
async def cancelled_write(kit: Kit, tier: TrackedTier) -> None:
    """A cancelled write leaves the block absent or complete; an overwrite old or new."""
    for steps, wall_s in CANCEL_POINTS:
        key = kit.key()
        data = kit.data(key)
        where = _where(steps, wall_s)
        cancelled = await cancel_after(tier.write(key, memoryview(data)), steps, wall_s)
        try:
            got = await kit.read_back(tier, key)
        except BlockNotFound:
            pass
        else:
            if got != data:
                what = (
                    f"a cancelled write left a partial block: read() {where}"
                    if cancelled
                    else f"read() after a write that finished before its cancellation {where}"
                )
                raise kit.mismatch(key, data, got, what)
        # A cancelled overwrite: the old bytes or the new ones, nothing else.
        old, new = kit.data(key, 1), kit.data(key, 2)
        await tier.write(key, memoryview(old))
        cancelled = await cancel_after(tier.write(key, memoryview(new)), steps, wall_s)
        try:
            got = await kit.read_back(tier, key)
        except BlockNotFound:
            continue  # dropping the block is allowed; serving mixed bytes is not
        if got not in (old, new):
            what = (
                f"a cancelled overwrite left mixed bytes (partial): read() {where}"
                if cancelled
                else f"read() after an overwrite that finished before its cancellation {where}"
            )
            raise kit.mismatch(key, new, got, what)


@with_tier
async def cancelled_read(kit: Kit, tier: TrackedTier) -> None:
    """A cancelled read leaves the block intact and never writes its buffer afterwards."""
    key = kit.key()
    data = kit.data(key)
    await tier.write(key, memoryview(data))
    sentinel = b"\xa5" * kit.options.block_bytes
    watched: list[tuple[bytearray, str]] = []
    for steps, wall_s in CANCEL_POINTS:
        into = bytearray(kit.options.block_bytes)
        await cancel_after(tier.read(key, memoryview(into)), steps, wall_s)
        # The buffer is the caller's again: nothing (a thread, the kernel) may write it now.
        into[:] = sentinel
        watched.append((into, _where(steps, wall_s)))
    await asyncio.sleep(kit.options.late_write_window_s)
    for into, where in watched:
        if into != sentinel:
            raise kit.fail(
                f"key {show_key(key)}: a cancelled read wrote into its buffer after it ended "
                f"{where}; seen within {kit.options.late_write_window_s:g} s "
                "(wait for threads or the kernel before returning: tiering.tier.run_in_thread)"
            )
    await kit.expect(tier, key, data, "read() after cancelled reads")


@with_tier
async def buffers_released_after_write(kit: Kit, tier: TrackedTier) -> None:
    """A write's source buffer is the caller's once the write returns or is cancelled."""
    written: list[tuple[OffloadKey, int | None]] = []
    for steps, wall_s in [(0, 0.0), (2, 0.0), (0, 0.002), (None, 0.0)]:
        key = kit.key()
        source = kit.data(key)
        if steps is None:
            await tier.write(key, memoryview(source))
        else:
            await cancel_after(tier.write(key, memoryview(source)), steps, wall_s)
        source[:] = b"\x5a" * kit.options.block_bytes  # reused for another block at once
        written.append((key, steps))
    await asyncio.sleep(kit.options.late_write_window_s)
    for key, steps in written:
        data = kit.data(key)
        try:
            got = await kit.read_back(tier, key)
        except BlockNotFound:
            if steps is None and bytes(key) not in kit.removed:
                raise kit.fail(f"key {show_key(key)}: a completed write is not readable") from None
            continue
        if got != data:
            # Bytes of the reused buffer (0x5a) where the block differs: the tier read it late.
            late = all(a == b or b == 0x5A for a, b in zip(data, got, strict=True))
            what = (
                "the tier read a write's buffer after the write ended; read()" if late else "read()"
            )
            raise kit.mismatch(key, data, got, what)
