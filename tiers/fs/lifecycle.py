"""Starting and stopping an open tier: its geometry, its open state, its background tasks.

:func:`plan_geometry` turns the config and the block size into the slot
layout to open; :func:`start_open_state` assembles an :class:`OpenState`
from the root that :func:`~tiers.fs.opening.prepare_root` opened (index,
journal writer, deletion watch) and starts its background tasks;
:func:`stop_open_state` stops them, syncs and closes everything in order;
:func:`record_open` counts and logs what the roots that opened hold.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import Callable, Sequence
from typing import cast

from tiering.core.errors import ConfigError
from tiering.core.keys import OffloadKey
from tiering.policies import EvictionPolicy
from tiering.runtime.gil_breaks import list_in_turns
from tiers.fs.config import FsTierConfig, check_capacity_fits
from tiers.fs.deletion import DeletionWatch
from tiers.fs.index import SlotIndex
from tiers.fs.io import IoBackend
from tiers.fs.io.aligned import BouncePool
from tiers.fs.journal import JournalWriter
from tiers.fs.journal_file import Snapshot
from tiers.fs.layout import ALIGNMENT, Geometry, round_up
from tiers.fs.opening import Prepared
from tiers.fs.state import FsTierStats, OpenState
from tiers.fs.upkeep import periodic_sync, sync_data, verify_recovered

logger = logging.getLogger(__name__)


def plan_geometry(cfg: FsTierConfig, block_bytes: int) -> Geometry:
    """The slot layout for blocks of ``block_bytes`` (ConfigError if not even one fits)."""
    if block_bytes <= 0:
        raise ConfigError(f"fs tier: block_bytes must be positive, got {block_bytes}")
    capacity_bytes = cfg.capacity_bytes
    if cfg.capacity_blocks is not None:
        capacity_bytes = cfg.capacity_blocks * round_up(block_bytes, ALIGNMENT)
        check_capacity_fits(
            cfg.root_dir, capacity_bytes, f"capacity_blocks={cfg.capacity_blocks} blocks"
        )
    geometry = Geometry.plan(block_bytes, capacity_bytes, cfg.slab_bytes)
    if geometry.capacity_slots < 1:
        raise ConfigError(
            f"fs tier: capacity_bytes={capacity_bytes} cannot hold one block of "
            f"{block_bytes} bytes ({geometry.slot_bytes} bytes on disk)"
        )
    return geometry


def start_open_state(
    prepared: Prepared,
    cfg: FsTierConfig,
    *,
    name: str,
    fingerprint: str,
    stats: FsTierStats,
    make_backend: Callable[[asyncio.AbstractEventLoop], IoBackend],
    report_removed: Callable[[Sequence[OffloadKey]], None],
    on_deletion_noticed: Callable[[], None],
    task_tag: int,
) -> OpenState:
    """The open state over ``prepared``, its journal, watch and sync tasks started.

    ``task_tag`` ends the background tasks' names (the tier passes its id).
    """
    loop = asyncio.get_running_loop()
    geometry = prepared.geometry
    policy = cast("EvictionPolicy[OffloadKey]", cfg.policy.build(geometry.capacity_slots))
    index = SlotIndex.restore(geometry.capacity_slots, policy, prepared.entries)
    backend = make_backend(loop)
    state: OpenState | None = None

    async def sync_data_strict() -> None:
        assert state is not None
        await sync_data(state, strict=True)

    journal = JournalWriter(
        prepared.root,
        prepared.header,
        prepared.journal_fd,
        prepared.journal_size,
        backend,
        sync_each_flush=cfg.durability == "fsync",
        before_flush=sync_data_strict if cfg.durability == "fsync" else None,
        snapshot=functools.partial(snapshot_in_turns, index),
        live_count=index.__len__,
    )
    state = OpenState(
        prepared=prepared,
        geometry=geometry,
        slabs=prepared.slabs,
        index=index,
        backend=backend,
        journal=journal,
        bounce=BouncePool(geometry.slot_bytes, keep=cfg.queue_depth),
        seed=journal.seed,
        pad=bytes(geometry.slot_bytes - geometry.block_bytes),
        auth=cfg.authenticator,
        fingerprint=fingerprint.encode(),
        watch=DeletionWatch(
            name,
            prepared.root,
            prepared.header,
            prepared.slabs,
            journal,
            index,
            report_removed,
            on_noticed=on_deletion_noticed,
        ),
        name=name,
        config=cfg,
        stats=stats,
        report_removed=report_removed,
    )
    state.tasks.append(loop.create_task(journal.run(), name=f"fs-tier-journal-{task_tag}"))
    state.tasks.append(
        loop.create_task(state.watch.run(), name=f"fs-tier-deletion-watch-{task_tag}")
    )
    if prepared.verify_recovered:
        keys = [OffloadKey(k) for k in prepared.entries]
        state.tasks.append(
            loop.create_task(verify_recovered(state, keys), name=f"fs-verify-{task_tag}")
        )
    if cfg.durability == "periodic":
        state.tasks.append(loop.create_task(periodic_sync(state), name=f"fs-tier-sync-{task_tag}"))
    return state


async def stop_open_state(state: OpenState, durable: bool) -> None:
    """Stop the background tasks, sync (when ``durable``), close the journal, then the files.

    Cancellation: files, threads and the root lock are still released.
    """
    try:  # tasks[0] is the journal's: it writes what is left, then stops, in close()
        for task in state.tasks[1:]:
            task.cancel()
        for task in state.tasks[1:]:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if durable:
            await sync_data(state, strict=False)
        await state.journal.close(state.tasks[0], sync=durable)
    finally:
        try:
            await state.backend.aclose()
        finally:
            state.bounce.close()
            state.prepared.close()


def record_open(stats: FsTierStats, cfg: FsTierConfig, name: str, opened: list[Prepared]) -> None:
    """Count what the roots that opened hold, and log each (and a changed set of roots)."""
    stats.recovered_blocks = sum(len(p.entries) for p in opened)
    stats.dropped_on_recovery = sum(p.dropped for p in opened)
    stats.notes = [note for p in opened for note in p.notes]
    stats.direct_io = all(p.slabs.direct for p in opened)
    stats.capacity_slots = sum(p.geometry.capacity_slots for p in opened)
    changed = [p.previous_root_set for p in opened if p.previous_root_set is not None]
    if changed:
        before = set(changed[0])
        now = set(cfg.root_set) or {str(cfg.root_dir)}
        note = (
            f"root_dirs changed: {len(before - now)} left {sorted(before - now)}, "
            f"{len(now - before)} joined {sorted(now - before)}; the roots that stay keep "
            "their blocks"
        )
        stats.notes.append(note)
        logger.warning("fs tier %s: %s", name, note)
    for prepared in opened:
        logger.info(
            "fs tier %s: %s, %d slots of %d bytes, %d blocks recovered, backend=%s, direct_io=%s",
            name,
            prepared.root.path,
            prepared.geometry.capacity_slots,
            prepared.geometry.slot_bytes,
            len(prepared.entries),
            stats.io_backend,
            prepared.slabs.direct,
        )


def snapshot_in_turns(index: SlotIndex) -> Snapshot:
    """The index's keys and entries, copied on the loop thread with GIL hand-offs between
    chunks (a million blocks is 40-90 ms of C otherwise; ``docs/runtime.md``)."""
    keys, values = index.views()
    return list_in_turns(keys), list_in_turns(values)
