"""``FileSystemTier``: KV blocks in preallocated slab files, checksummed, crash-consistent.

This module owns the tier's lifecycle (its config, ``open``, ``aclose``) and
its public calls, and holds the :class:`~tiers.fs.state.OpenState` of an open
tier; the calls hand that state to the read path (:mod:`tiers.fs.reads`), the
write path (:mod:`tiers.fs.writes`) and the background upkeep
(:mod:`tiers.fs.upkeep`); :mod:`tiers.fs.lifecycle` starts and stops that state.

A write reserves slots (evicting if full), writes the bytes (O_DIRECT from the
caller's buffer where aligned), then appends a PUT record (key, slot,
xxh3_128 of the bytes) to the index journal; the block becomes visible only
once that record is durable. A read verifies the checksum of every block; a
mismatch, short read or I/O error fails the read and drops the entry. After
a restart, even after ``kill -9`` in the middle of writes, the journal gives
back every block whose write completed (see docs/fs-tier.md).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Iterable, Mapping, Sequence

from tiering.core.errors import ConfigError, PartialBatchError, TierClosedError
from tiering.core.keys import OffloadKey
from tiering.tier import AsyncTier, TierContext
from tiers.fs.config import DEFAULT_MAX_IO_BYTES, DEFAULT_SLAB_BYTES, FsTierConfig
from tiers.fs.io import IoBackend, make_backend
from tiers.fs.lifecycle import plan_geometry, start_open_state, stop_open_state
from tiers.fs.opening import Prepared, close_prepared_when_done, prepare_root
from tiers.fs.reads import read_blocks
from tiers.fs.records import encode_del
from tiers.fs.state import FsTierStats, OpenState, notify_room
from tiers.fs.writes import write_blocks

# FsTierStats is defined in tiers.fs.state and importable from here as before.
__all__ = ["MAX_BLOCKS_PER_CALL", "FileSystemTier", "FsTierStats"]

logger = logging.getLogger(__name__)

#: ``max_concurrency``: blocks the framework may have in this tier's calls at once.
MAX_BLOCKS_PER_CALL = 1024


class FileSystemTier(AsyncTier):
    """A bounded, persistent secondary tier on a local filesystem.

    Keyword arguments are the tier's config keys (see :class:`FsTierConfig`
    and docs/fs-tier.md); every value is checked here, at construction.
    """

    shared = False
    verifies_reads = True  # every slot carries an xxh3-128 checksum, checked on each read

    def __init__(
        self,
        *,
        root_dir: str | os.PathLike[str],
        capacity_bytes: int | str | None = None,
        capacity_blocks: int | None = None,
        n_read_threads: int = 8,
        n_write_threads: int = 4,
        io_backend: str = "auto",
        direct_io: bool | str | None = "auto",
        durability: str = "periodic",
        sync_interval_s: float = 1.0,
        eviction_policy: object = "lru",
        slab_bytes: int | str = DEFAULT_SLAB_BYTES,
        queue_depth: int = 32,
        max_io_bytes: int | str = DEFAULT_MAX_IO_BYTES,
        on_layout_mismatch: str = "reset",
        preallocate: bool = True,
        create_root_dir: bool = True,
        auth_key_file: str | None = None,
        auth_key_env: str | None = None,
        auth_mac: str | None = None,
    ) -> None:
        # This signature is the one list of the tier's keys and defaults (the registry
        # reads it to reject unknown keys); FsTierConfig checks the values.
        options = dict(locals())
        del options["self"]
        self.config = FsTierConfig.from_options(options)
        self.check_options({"io_backend": self.config.io_backend})
        # Blocks the framework may hand over at once. Queued blocks cost nothing here (the
        # backend keeps ``queue_depth`` ops in the kernel), and whole jobs in one call
        # coalesce into large vectored I/Os, so take a whole job or several.
        self.max_concurrency = MAX_BLOCKS_PER_CALL
        self.stats = FsTierStats()
        self._open_state: OpenState | None = None
        self._closed = False
        self._direct_io = False

    @classmethod
    def check_options(cls, options: Mapping[str, object]) -> None:
        """``io_backend: "uring"`` where io_uring failed its probe is a ConfigError now."""
        if options.get("io_backend") == "uring":
            from tiers.fs.io import uring_unavailable_reason

            reason = uring_unavailable_reason()
            if reason is not None:
                raise ConfigError(f"fs tier: io_backend='uring' is not available here: {reason}")

    # -- lifecycle ----------------------------------------------------------------------

    async def open(self, context: TierContext) -> None:
        """Lock ``root_dir``, check its header, replay the journal, open the slab files.

        A cache written for another block size or layout fingerprint is reset
        (or refused, with ``on_layout_mismatch="error"``). Cancellation: what
        was opened is closed again before the cancellation propagates.
        """
        if self._open_state is not None or self._closed:
            raise RuntimeError("FileSystemTier.open may be called only once")
        await super().open(context)
        cfg = self.config
        geometry = plan_geometry(cfg, context.block_bytes)
        job = asyncio.ensure_future(
            asyncio.to_thread(prepare_root, cfg, geometry, context.layout_fingerprint)
        )
        try:
            prepared = await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(close_prepared_when_done)
            raise
        try:
            self._open_state = self._start(prepared)
        except BaseException:
            prepared.close()
            raise
        stats = self.stats
        stats.recovered_blocks = len(prepared.entries)
        stats.dropped_on_recovery = prepared.dropped
        stats.notes = prepared.notes
        stats.io_backend = self._open_state.backend.name
        stats.direct_io = prepared.slabs.direct
        stats.capacity_slots = prepared.geometry.capacity_slots
        logger.info(
            "fs tier %s: %s, %d slots of %d bytes, %d blocks recovered, backend=%s, direct_io=%s",
            context.name,
            cfg.root_dir,
            prepared.geometry.capacity_slots,
            prepared.geometry.slot_bytes,
            len(prepared.entries),
            stats.io_backend,
            stats.direct_io,
        )

    def _start(self, prepared: Prepared) -> OpenState:
        self._direct_io = prepared.slabs.direct
        return start_open_state(
            prepared,
            self.config,
            name=self.context.name,
            fingerprint=self.context.layout_fingerprint,
            stats=self.stats,
            make_backend=self._make_backend,
            report_removed=self.report_removed,
            on_deletion_noticed=self._count_deletion,
            task_tag=id(self),
        )

    def _count_deletion(self) -> None:
        self.stats.deletions_noticed += 1

    def _make_backend(self, loop: asyncio.AbstractEventLoop) -> IoBackend:
        """The I/O backend the config asks for (tests override this to inject faults)."""
        cfg = self.config
        return make_backend(
            cfg.io_backend,
            loop,
            queue_depth=cfg.queue_depth,
            n_read_threads=cfg.n_read_threads,
            n_write_threads=cfg.n_write_threads,
            direct_io=self._direct_io,
        )

    async def aclose(self) -> None:
        """Flush the journal (fdatasync unless durability is "none"), stop tasks, close files.

        Idempotent. Cancellation: files, threads and the root lock are still
        released; records not yet written are dropped (never acknowledged).
        """
        if self._closed:
            return
        self._closed = True
        state, self._open_state = self._open_state, None
        if state is None:
            return
        state.closed = True
        notify_room(state)  # writes waiting for room see the tier closed and fail
        await stop_open_state(state, durable=self.config.durability != "none")

    def _state(self) -> OpenState:
        state = self._open_state
        if state is None:
            if self._closed:
                raise TierClosedError("fs tier is closed")
            raise RuntimeError("fs tier is not open yet")
        return state

    # -- lookups ------------------------------------------------------------------------

    async def contains(self, key: OffloadKey) -> bool:
        """Whether ``key``'s block is visible. Cancellation: no side effects."""
        return key in self._state().index

    async def contains_many(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """``contains`` for each key, from the in-memory index. Cancellation: no side effects."""
        index = self._state().index
        return [key in index for key in keys]

    async def list_keys(self) -> Iterable[OffloadKey]:
        """Every visible key (after :meth:`open`: the blocks recovered from disk).

        Cancellation: no side effects.
        """
        return self._state().index.keys()

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark blocks recently used for eviction. Cancellation: no side effects."""
        index = self._state().index
        for key in keys:
            index.access(key)

    @property
    def capacity_blocks(self) -> int | None:
        """How many blocks fit (None before open); the runtime shows it in its stats."""
        return self.stats.capacity_slots or None

    def num_blocks(self) -> int:
        """Number of visible blocks (loop thread)."""
        state = self._open_state
        return len(state.index) if state is not None else 0

    # -- delete -------------------------------------------------------------------------

    async def delete(self, key: OffloadKey) -> None:
        """Drop ``key``'s block (no error if absent); waits for its DEL record.

        Cancellation: the block is already gone from lookups; the record is
        still written.
        """
        state = self._state()
        if key not in state.index:
            return
        seq = state.journal.next_seq
        state.index.remove(key, seq)
        state.journal.append(encode_del([key], state.seed), retry=True)
        notify_room(state)
        await state.journal.wait_durable(seq)

    # -- reads --------------------------------------------------------------------------

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        """Copy ``key``'s verified block into ``into``.

        Raises BlockNotFound, CorruptBlock (checksum or short read; the entry
        is dropped) or OSError (the entry is dropped). Cancellation: waits for
        I/O already in the kernel (it writes into ``into``), then propagates;
        ``into`` may be partly written.
        """
        errors = await read_blocks(self._state(), [key], [into])
        if errors:
            raise errors[key]

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        """Read several blocks with vectored I/O (adjacent slots make one op).

        Raises PartialBatchError naming the keys that failed. Cancellation: as
        for :meth:`read`.
        """
        errors = await read_blocks(self._state(), keys, into)
        if errors:
            raise PartialBatchError([k for k in keys if k not in errors], errors)

    # -- writes -------------------------------------------------------------------------

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """Store ``data`` as ``key``'s block (replacing any previous one), evicting if full.

        Returns once the block is visible (its data written and its index
        record durable per the durability policy). Raises TierFullError or
        OSError. Cancellation: waits for I/O already in the kernel, then
        propagates; the block is then either absent or complete.
        """
        errors = await write_blocks(self._state(), [key], [data])
        if errors:
            raise errors[key]

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        """Store several blocks: adjacent slots, vectored writes, one journal commit.

        Raises PartialBatchError naming the keys that failed. Cancellation: as
        for :meth:`write`, per block.
        """
        errors = await write_blocks(self._state(), keys, data)
        if errors:
            raise PartialBatchError([k for k in keys if k not in errors], errors)
