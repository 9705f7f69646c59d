"""Upkeep of an open tier: syncing slab files, and verifying blocks after a damaged journal.

:func:`sync_data` fdatasyncs the slab files written since the last sync (at
close, before each journal flush under ``durability="fsync"``, and every
``sync_interval_s`` from :func:`periodic_sync` under ``"periodic"``).
:func:`verify_recovered` reads back every block recovered from a journal
with damage in the middle, so the read path drops the stale ones.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import mmap

from tiering.core.keys import OffloadKey
from tiers.fs.io import IoOp, OpKind
from tiers.fs.planning import IOV_MAX
from tiers.fs.reads import read_blocks
from tiers.fs.state import OpenState

logger = logging.getLogger(__name__)


async def sync_data(state: OpenState, strict: bool) -> None:
    """fdatasync the slab files written since the last sync.

    A failure raises OSError when ``strict``, and is logged otherwise.
    """
    fds = state.slabs.take_dirty_fds()
    if not fds:
        return
    ops = [IoOp(OpKind.FSYNC, fd) for fd in fds]
    await state.backend.run(ops)
    failed = [op.error for op in ops if op.error is not None]
    if failed:
        if strict:
            raise OSError(errno.EIO, f"fdatasync of slab files failed: {failed[0]}")
        logger.error("fs tier %s: slab fdatasync failed: %s", state.name, failed[0])


async def periodic_sync(state: OpenState) -> None:
    """Every ``sync_interval_s``: sync the slab files, then ask the journal to sync."""
    interval = state.config.sync_interval_s
    while True:
        await asyncio.sleep(interval)
        await sync_data(state, strict=False)
        state.journal.request_sync()


async def verify_recovered(state: OpenState, keys: list[OffloadKey]) -> None:
    """Read every recovered block once, in recovery order; the reads drop stale ones.

    Runs after a journal with damage in the middle was replayed: a lost DEL, or
    a lost record of a slot's reuse, leaves an entry whose bytes changed. Each
    failing block is dropped and reported removed by the read path (a miss,
    never wrong bytes), before a load finds it. Reading in recovery order keeps
    the eviction order. Cancellation (the tier closing): stops at once.
    """
    batch = max(1, min(IOV_MAX, state.config.max_io_bytes // state.geometry.slot_bytes))
    size = state.geometry.block_bytes
    # Page-aligned, so O_DIRECT reads use it as is; unmapped when this task ends.
    view = memoryview(mmap.mmap(-1, batch * size))
    rows = [view[i * size : (i + 1) * size] for i in range(batch)]
    stats = state.stats
    for start in range(0, len(keys), batch):
        chunk = [k for k in keys[start : start + batch] if k in state.index]
        if chunk:
            await read_blocks(state, chunk, rows[: len(chunk)])
            stats.verified_after_damage += len(chunk)
    logger.info(
        "fs tier %s: verified the %d blocks recovered from a damaged journal; %d kept",
        state.name,
        stats.verified_after_damage,
        len(state.index),
    )
