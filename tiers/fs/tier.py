"""``FileSystemTier``: KV blocks in preallocated slab files, checksummed, crash-consistent.

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
import contextlib
import errno
import functools
import logging
import mmap
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import cast

import xxhash

from tiering.auth import BlockAuthenticator
from tiering.errors import (
    BlockNotFound,
    ConfigError,
    CorruptBlock,
    PartialBatchError,
    TierClosedError,
)
from tiering.keys import OffloadKey
from tiering.policies import EvictionPolicy
from tiering.tier import AsyncTier, TierContext
from tiers.fs.config import (
    DEFAULT_MAX_IO_BYTES,
    DEFAULT_SLAB_BYTES,
    FsTierConfig,
    check_capacity_fits,
)
from tiers.fs.deletion import DeletionWatch, FilesDeletedError
from tiers.fs.errors import TierFullError
from tiers.fs.files import UnsafeFileError
from tiers.fs.index import Entry, SlotIndex
from tiers.fs.io import IoBackend, IoOp, OpKind, make_backend
from tiers.fs.io.aligned import BouncePool, address_of
from tiers.fs.journal import JournalWriter
from tiers.fs.layout import (
    ALIGNMENT,
    Geometry,
    round_up,
)
from tiers.fs.opening import Prepared, close_prepared_when_done, prepare_root
from tiers.fs.records import encode_del, encode_put, encode_put_tagged
from tiers.fs.slabs import SlabFiles

logger = logging.getLogger(__name__)

_checksum = xxhash.xxh3_128_intdigest
#: ``max_concurrency``: blocks the framework may have in this tier's calls at once.
MAX_BLOCKS_PER_CALL = 1024
#: Most buffers in one vectored op (Linux's IOV_MAX).
_IOV_MAX = 1024
#: Hash this many bytes on the loop between yields, so completions keep flowing.
_HASH_SLICE_BYTES = 4 * 1024 * 1024


@dataclass(slots=True)
class FsTierStats:
    """Counters of one tier since it was opened (read on the tier's loop thread)."""

    blocks_read: int = 0
    blocks_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_failures: int = 0
    write_failures: int = 0
    corrupt_blocks: int = 0
    auth_failures: int = 0
    deletions_noticed: int = 0
    evictions: int = 0
    recovered_blocks: int = 0
    dropped_on_recovery: int = 0
    #: Recovered blocks read back and verified after a damaged journal (see docs/fs-tier.md).
    verified_after_damage: int = 0
    io_backend: str = ""
    direct_io: bool = False
    capacity_slots: int = 0
    notes: list[str] = field(default_factory=list)


class _Block:
    """One block of a batch on its way through planning, I/O and settling."""

    __slots__ = ("bounce", "checksum", "entry", "error", "key", "slot", "tag", "view")

    def __init__(self, key: OffloadKey, view: memoryview, slot: int, entry: Entry | None) -> None:
        self.key = key
        self.view = view
        self.slot = slot
        self.entry = entry
        self.bounce: memoryview | None = None
        self.checksum = 0
        self.tag: bytes | None = None
        self.error: BaseException | None = None


@dataclass(slots=True)
class _Open:
    """Everything that exists while the tier is open (owned by its loop thread)."""

    prepared: Prepared
    geometry: Geometry
    slabs: SlabFiles
    index: SlotIndex
    backend: IoBackend
    journal: JournalWriter
    bounce: BouncePool
    seed: int
    pad: bytes
    auth: BlockAuthenticator | None
    fingerprint: bytes
    watch: DeletionWatch
    tasks: list[asyncio.Task[None]] = field(default_factory=list)
    room_waiters: list[asyncio.Future[None]] = field(default_factory=list)


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
        self._open_state: _Open | None = None
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
        if context.block_bytes <= 0:
            raise ConfigError(f"fs tier: block_bytes must be positive, got {context.block_bytes}")
        cfg = self.config
        capacity_bytes = cfg.capacity_bytes
        if cfg.capacity_blocks is not None:
            capacity_bytes = cfg.capacity_blocks * round_up(context.block_bytes, ALIGNMENT)
            check_capacity_fits(
                cfg.root_dir, capacity_bytes, f"capacity_blocks={cfg.capacity_blocks} blocks"
            )
        geometry = Geometry.plan(context.block_bytes, capacity_bytes, cfg.slab_bytes)
        if geometry.capacity_slots < 1:
            raise ConfigError(
                f"fs tier: capacity_bytes={capacity_bytes} cannot hold one block of "
                f"{context.block_bytes} bytes ({geometry.slot_bytes} bytes on disk)"
            )
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

    def _start(self, prepared: Prepared) -> _Open:
        cfg = self.config
        loop = asyncio.get_running_loop()
        geometry = prepared.geometry
        self._direct_io = prepared.slabs.direct
        policy = cast("EvictionPolicy[OffloadKey]", cfg.policy.build(geometry.capacity_slots))
        index = SlotIndex.restore(geometry.capacity_slots, policy, prepared.entries)
        backend = self._make_backend(loop)
        state: _Open | None = None

        async def sync_data_strict() -> None:
            assert state is not None
            await self._sync_data(state, strict=True)

        journal = JournalWriter(
            prepared.root,
            prepared.header,
            prepared.journal_fd,
            prepared.journal_size,
            backend,
            sync_each_flush=cfg.durability == "fsync",
            before_flush=sync_data_strict if cfg.durability == "fsync" else None,
            snapshot=lambda: [(k, e.slot, e.checksum, e.tag) for k, e in index.items()],
            live_count=index.__len__,
        )
        state = _Open(
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
            fingerprint=self.context.layout_fingerprint.encode(),
            watch=DeletionWatch(
                self.context.name,
                prepared.root,
                prepared.header,
                prepared.slabs,
                journal,
                index,
                self.report_removed,
                on_noticed=self._count_deletion,
            ),
        )
        state.tasks.append(loop.create_task(journal.run(), name=f"fs-tier-journal-{id(self)}"))
        state.tasks.append(
            loop.create_task(state.watch.run(), name=f"fs-tier-deletion-watch-{id(self)}")
        )
        if prepared.verify_recovered:
            keys = [OffloadKey(k) for k in prepared.entries]
            state.tasks.append(
                loop.create_task(self._verify_recovered(state, keys), name=f"fs-verify-{id(self)}")
            )
        if cfg.durability == "periodic":
            state.tasks.append(
                loop.create_task(self._periodic_sync(state), name=f"fs-tier-sync-{id(self)}")
            )
        return state

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
        self._notify_room(state)  # writes waiting for room see the tier closed and fail
        durable = self.config.durability != "none"
        try:
            for task in state.tasks[1:]:
                task.cancel()
            for task in state.tasks[1:]:
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            if durable:
                await self._sync_data(state, strict=False)
            await state.journal.close(state.tasks[0], sync=durable)
        finally:
            try:
                await state.backend.aclose()
            finally:
                state.bounce.close()
                state.prepared.close()

    def _state(self) -> _Open:
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
        self._notify_room(state)
        await state.journal.wait_durable(seq)

    # -- reads --------------------------------------------------------------------------

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        """Copy ``key``'s verified block into ``into``.

        Raises BlockNotFound, CorruptBlock (checksum or short read; the entry
        is dropped) or OSError (the entry is dropped). Cancellation: waits for
        I/O already in the kernel (it writes into ``into``), then propagates;
        ``into`` may be partly written.
        """
        errors = await self._read_blocks([key], [into])
        if errors:
            raise errors[key]

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        """Read several blocks with vectored I/O (adjacent slots make one op).

        Raises PartialBatchError naming the keys that failed. Cancellation: as
        for :meth:`read`.
        """
        errors = await self._read_blocks(keys, into)
        if errors:
            raise PartialBatchError([k for k in keys if k not in errors], errors)

    async def _read_blocks(
        self, keys: Sequence[OffloadKey], views: Sequence[memoryview]
    ) -> dict[bytes, BaseException]:
        state = self._state()
        if len(keys) != len(views):
            raise ValueError(f"{len(keys)} keys but {len(views)} buffers")
        block_views = self._block_views(views, writable=True)
        errors: dict[bytes, BaseException] = {}
        blocks: list[_Block] = []
        index = state.index
        for key, view in zip(keys, block_views, strict=True):
            entry = index.pin(key)
            if entry is None:
                errors[key] = BlockNotFound(key)
            else:
                blocks.append(_Block(key, view, entry.slot, entry))
        if not blocks:
            return errors
        try:
            plan = self._plan(state, blocks, OpKind.READ)
            for op, group in plan:  # verify each op's blocks as soon as it completes
                op.on_done = functools.partial(self._settle_read, state, group=group)
            await state.backend.run([op for op, _ in plan])
        finally:
            for block in blocks:
                index.unpin(block.slot)
                if block.bounce is not None:
                    state.bounce.give(block.bounce)
                    block.bounce = None
            self._notify_room(state)
        stats = self.stats
        block_bytes = state.geometry.block_bytes
        for block in blocks:
            if block.error is None:
                index.access(block.key)
                stats.blocks_read += 1
                stats.bytes_read += block_bytes
            else:
                errors[block.key] = block.error
                stats.read_failures += 1
                assert block.entry is not None
                self._drop(state, block.key, block.entry, block.error)
        return errors

    def _settle_read(self, state: _Open, op: IoOp, *, group: list[_Block]) -> None:
        block_bytes = state.geometry.block_bytes
        io_len = op.nbytes // len(group)
        for i, block in enumerate(group):
            if op.done < (i + 1) * io_len:
                if op.error is not None:
                    block.error = op.error
                else:
                    got = max(0, op.done - i * io_len)
                    block.error = CorruptBlock(block.key, f"short read: {got} of {io_len} bytes")
                continue
            if block.bounce is not None:
                block.view[:] = block.bounce[:block_bytes]
            entry = block.entry
            assert entry is not None
            if _checksum(block.view) != entry.checksum:
                block.error = CorruptBlock(block.key, "checksum mismatch")
            elif state.auth is not None:
                block.error = _authentication_error(state, block.key, block.view, entry)

    def _drop(self, state: _Open, key: OffloadKey, entry: Entry, why: BaseException) -> None:
        """Forget a block that failed to read, so it is a miss from now on."""
        if state.index.get(key) is not entry:
            return
        stats = self.stats
        if isinstance(why, _AuthenticationFailed):
            stats.auth_failures += 1
            if stats.auth_failures == 1:  # once per tier: a forger must not flood the log
                logger.error(
                    "fs tier %s: block %s failed authentication (%s) and was deleted; someone "
                    "without the key wrote to %s. Further failures are only counted "
                    "(stats.auth_failures)",
                    self.context.name,
                    key.hex(),
                    why,
                    self.config.root_dir,
                )
        elif isinstance(why, CorruptBlock):
            stats.corrupt_blocks += 1
        seq = state.journal.next_seq
        state.index.remove(key, seq)
        with contextlib.suppress(RuntimeError):  # closing: the entry is gone from memory anyway
            state.journal.append(encode_del([key], state.seed), retry=True)
        self.report_removed([key])
        if not isinstance(why, _AuthenticationFailed):
            logger.warning("fs tier %s: dropped block %s: %s", self.context.name, key.hex(), why)

    # -- writes -------------------------------------------------------------------------

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """Store ``data`` as ``key``'s block (replacing any previous one), evicting if full.

        Returns once the block is visible (its data written and its index
        record durable per the durability policy). Raises TierFullError or
        OSError. Cancellation: waits for I/O already in the kernel, then
        propagates; the block is then either absent or complete.
        """
        errors = await self._write_blocks([key], [data])
        if errors:
            raise errors[key]

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        """Store several blocks: adjacent slots, vectored writes, one journal commit.

        Raises PartialBatchError naming the keys that failed. Cancellation: as
        for :meth:`write`, per block.
        """
        errors = await self._write_blocks(keys, data)
        if errors:
            raise PartialBatchError([k for k in keys if k not in errors], errors)

    async def _write_blocks(
        self, keys: Sequence[OffloadKey], datas: Sequence[memoryview]
    ) -> dict[bytes, BaseException]:
        state = self._state()
        if len(keys) != len(datas):
            raise ValueError(f"{len(keys)} keys but {len(datas)} buffers")
        if len(set(keys)) != len(keys):
            raise ValueError("a write batch names the same key twice")
        views = self._block_views(datas, writable=False)
        if state.watch.refusing is not None:
            raise FilesDeletedError(state.watch.refusing)
        index, journal = state.index, state.journal
        errors: dict[bytes, BaseException] = {}
        # All or nothing: a batch that fits waits while other writes and reads hold the
        # slots it needs (holding part of them while waiting could deadlock two batches).
        while len(keys) <= index.capacity_slots and index.available() < len(keys):
            await self._room_changed(state)
            if self._closed:
                raise TierClosedError("fs tier closed while a write waited for room")
        reservation = index.reserve(len(keys), journal.durable_seq, journal.next_seq)
        if reservation.evicted:
            journal.append(encode_del([k for k, _ in reservation.evicted], state.seed), retry=True)
            self.stats.evictions += len(reservation.evicted)
            self.report_removed([k for k, _ in reservation.evicted])
        blocks = [
            _Block(key, view, slot, None)
            for key, view, slot in zip(keys, views, reservation.slots, strict=False)
        ]
        for key in keys[len(blocks) :]:
            errors[key] = TierFullError(key, index.capacity_slots, len(keys))
        owned = {block.slot for block in blocks}  # released in `finally` unless handed on
        try:
            if blocks:
                await self._write_reserved(state, blocks, reservation.ready_seq, owned)
        finally:
            if owned:
                index.release(owned)
                self._notify_room(state)
            for block in blocks:
                if block.bounce is not None:
                    state.bounce.give(block.bounce)
                    block.bounce = None
        for block in blocks:
            if block.error is not None:
                errors[block.key] = block.error
        self.stats.write_failures += len(errors)
        return errors

    async def _write_reserved(
        self, state: _Open, blocks: list[_Block], ready_seq: int, owned: set[int]
    ) -> None:
        journal = state.journal
        await self._back_slots(state, blocks)
        live = [b for b in blocks if b.error is None]
        if not live:
            return
        if ready_seq > journal.durable_seq:
            try:
                await journal.wait_durable(ready_seq)
            except OSError as exc:
                for block in live:
                    block.error = exc
                return
        plan = self._plan(state, live, OpKind.WRITE)
        ops = [op for op, _ in plan]
        batch = state.backend.start(ops)
        try:
            await _seal_blocks(live, state.auth, state.fingerprint)
        except asyncio.CancelledError:
            await state.backend.abandon(batch, ops)
            raise
        await state.backend.wait(batch, ops)
        for op, group in plan:
            io_len = op.nbytes // len(group)
            for i, block in enumerate(group):
                if op.done < (i + 1) * io_len:
                    block.error = op.error or OSError(errno.EIO, "short write")
            state.slabs.mark_dirty(state.geometry.slab_of(group[0].slot))
        good = [b for b in live if b.error is None]
        if not good:
            return
        seq = journal.next_seq
        entries = [(b.key, b.slot, b.checksum, b.tag) for b in good]
        if state.auth is not None:
            payload = encode_put_tagged(
                [(b.key, b.slot, b.checksum, b.tag or b"") for b in good], state.seed
            )
        else:
            payload = encode_put([(b.key, b.slot, b.checksum) for b in good], state.seed)
        index = state.index
        stats = self.stats
        block_bytes = state.geometry.block_bytes

        def commit() -> None:
            index.commit_many(entries, seq)
            stats.blocks_written += len(good)
            stats.bytes_written += len(good) * block_bytes
            self._notify_room(state)

        def give_back() -> None:
            index.release(b.slot for b in good)
            self._notify_room(state)

        journal.append(payload, on_durable=commit, on_failed=give_back)
        owned.difference_update(b.slot for b in good)  # the journal's callbacks own them now
        try:
            await journal.wait_durable(seq)
        except OSError as exc:
            for block in good:
                block.error = exc
            return
        await self._refuse_ack_into_deleted_files(state, good, {op.fd for op in ops})

    async def _refuse_ack_into_deleted_files(
        self, state: _Open, blocks: list[_Block], fds: set[int]
    ) -> None:
        """Fail (and forget) committed blocks whose slab file was deleted under them.

        A deleted journal is written again first: it held their records.
        """
        watch, journal = state.watch, state.journal
        if journal.file_deleted():
            await watch.check()
        why = watch.unsafe_fds(list(fds))
        if why is None:
            return
        await watch.check()  # the slab is repaired (or stores refused) for the next writes
        seq = journal.next_seq
        gone = []
        for block in blocks:
            entry = state.index.get(block.key)
            if entry is not None and entry.slot == block.slot:
                state.index.remove(block.key, seq)
                gone.append(block.key)
            block.error = FilesDeletedError(f"block {block.key.hex()} not stored: {why}")
        if gone:
            with contextlib.suppress(RuntimeError):
                journal.append(encode_del(gone, state.seed), retry=True)
            self._notify_room(state)

    async def _back_slots(self, state: _Open, blocks: list[_Block]) -> None:
        """Create slab files for the blocks' slots; on ENOSPC, shrink capacity and fail those.

        A link planted where a slab is to be created is refused the same way
        (UnsafeFileError; the next open refuses the directory).
        """
        top = max(b.slot for b in blocks) + 1
        if top <= state.slabs.backed_slots:
            return
        try:
            await state.slabs.ensure(top)
        except (OSError, UnsafeFileError) as exc:
            backed = state.slabs.backed_slots
            if backed < state.index.capacity_slots:
                logger.warning(
                    "fs tier %s: cannot grow the slab files past %d slots (%s); "
                    "capacity lowered to what is allocated",
                    self.context.name,
                    backed,
                    exc,
                )
                state.index.limit_capacity(backed)
                self.stats.capacity_slots = state.index.capacity_slots
            for block in blocks:
                if block.slot >= backed:
                    block.error = exc

    async def _room_changed(self, state: _Open) -> None:
        """Wait until slots may have come free (a commit, release, unpin or delete)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        state.room_waiters.append(waiter)
        await waiter

    @staticmethod
    def _notify_room(state: _Open) -> None:
        waiters, state.room_waiters = state.room_waiters, []
        for waiter in waiters:
            if not waiter.done():
                waiter.set_result(None)

    # -- planning -----------------------------------------------------------------------

    def _plan(
        self, state: _Open, blocks: list[_Block], kind: OpKind
    ) -> list[tuple[IoOp, list[_Block]]]:
        """Group blocks into vectored ops: adjacent slots of one slab, up to ``max_io_bytes``.

        Blocks whose buffer O_DIRECT cannot use get a bounce buffer (filled
        here for writes).
        """
        geometry = state.geometry
        direct = state.slabs.direct
        block_bytes, slot_bytes = geometry.block_bytes, geometry.slot_bytes
        io_len = slot_bytes if direct else block_bytes
        contiguous = io_len == slot_bytes
        per_op = max(1, min(_IOV_MAX, self.config.max_io_bytes // io_len))
        slots_per_slab = geometry.slots_per_slab
        # O_DIRECT can use a buffer as it is only if it is aligned and fills the slot.
        odd_size = direct and (block_bytes != slot_bytes or block_bytes % ALIGNMENT != 0)
        plan: list[tuple[IoOp, list[_Block]]] = []
        group: list[_Block] = []
        buffers: list[memoryview] = []
        addresses: list[int] = []
        first_slot = prev_slot = -1
        blocks.sort(key=_slot_of)
        for block in blocks:
            buf = block.view
            address = address_of(buf)
            if direct and (odd_size or address % ALIGNMENT):
                bounce = state.bounce.take()
                block.bounce = bounce
                if kind is OpKind.WRITE:
                    bounce[:block_bytes] = buf
                    if state.pad:
                        bounce[block_bytes:] = state.pad
                buf = bounce
                address = address_of(bounce)
            slot = block.slot
            if (
                group
                and contiguous
                and slot == prev_slot + 1
                and slot // slots_per_slab == first_slot // slots_per_slab
                and len(group) < per_op
            ):
                group.append(block)
                buffers.append(buf)
                addresses.append(address)
            else:
                if group:
                    plan.append((self._make_op(state, kind, first_slot, buffers, addresses), group))
                group, buffers, addresses, first_slot = [block], [buf], [address], slot
            prev_slot = slot
        if group:
            plan.append((self._make_op(state, kind, first_slot, buffers, addresses), group))
        return plan

    @staticmethod
    def _make_op(
        state: _Open, kind: OpKind, slot: int, buffers: list[memoryview], addresses: list[int]
    ) -> IoOp:
        _, fd, offset = state.slabs.locate(slot)
        return IoOp(kind, fd, offset, buffers, addresses=addresses)

    def _block_views(self, buffers: Sequence[memoryview], writable: bool) -> list[memoryview]:
        """The buffers as flat byte views of exactly one block (raises ValueError otherwise)."""
        size = self.block_bytes
        out: list[memoryview] = []
        for buffer in buffers:
            view = buffer
            if type(view) is not memoryview or view.ndim != 1 or view.format != "B":
                view = memoryview(buffer)
                if view.format != "B" or view.ndim != 1:
                    view = view.cast("B")
            if view.nbytes != size:
                raise ValueError(f"a block buffer must be exactly {size} bytes, got {view.nbytes}")
            if writable and view.readonly:
                raise ValueError("read() needs a writable buffer")
            out.append(view)
        return out

    async def _verify_recovered(self, state: _Open, keys: list[OffloadKey]) -> None:
        """Read every recovered block once, in recovery order; the reads drop stale ones.

        Runs after a journal with damage in the middle was replayed: a lost DEL, or
        a lost record of a slot's reuse, leaves an entry whose bytes changed. Each
        failing block is dropped and reported removed by the read path (a miss,
        never wrong bytes), before a load finds it. Reading in recovery order keeps
        the eviction order. Cancellation (the tier closing): stops at once.
        """
        batch = max(1, min(_IOV_MAX, self.config.max_io_bytes // state.geometry.slot_bytes))
        size = state.geometry.block_bytes
        # Page-aligned, so O_DIRECT reads use it as is; unmapped when this task ends.
        view = memoryview(mmap.mmap(-1, batch * size))
        rows = [view[i * size : (i + 1) * size] for i in range(batch)]
        for start in range(0, len(keys), batch):
            chunk = [k for k in keys[start : start + batch] if k in state.index]
            if chunk:
                await self._read_blocks(chunk, rows[: len(chunk)])
                self.stats.verified_after_damage += len(chunk)
        logger.info(
            "fs tier %s: verified the %d blocks recovered from a damaged journal; %d kept",
            self.context.name,
            self.stats.verified_after_damage,
            len(state.index),
        )

    # -- durability ---------------------------------------------------------------------

    async def _sync_data(self, state: _Open, strict: bool) -> None:
        """fdatasync the slab files written since the last sync."""
        fds = state.slabs.take_dirty_fds()
        if not fds:
            return
        ops = [IoOp(OpKind.FSYNC, fd) for fd in fds]
        await state.backend.run(ops)
        failed = [op.error for op in ops if op.error is not None]
        if failed:
            if strict:
                raise OSError(errno.EIO, f"fdatasync of slab files failed: {failed[0]}")
            logger.error("fs tier %s: slab fdatasync failed: %s", self.context.name, failed[0])

    async def _periodic_sync(self, state: _Open) -> None:
        interval = self.config.sync_interval_s
        while True:
            await asyncio.sleep(interval)
            await self._sync_data(state, strict=False)
            state.journal.request_sync()


class _AuthenticationFailed(CorruptBlock):
    """A block whose MAC tag is missing or wrong: written by someone without the key."""


def _authentication_error(
    state: _Open, key: OffloadKey, data: memoryview, entry: Entry
) -> CorruptBlock | None:
    auth = state.auth
    assert auth is not None
    if entry.tag is None:
        return _AuthenticationFailed(key, "stored without an authentication tag")
    if not auth.verify(key, state.fingerprint, data, entry.tag):
        return _AuthenticationFailed(key, "authentication tag mismatch")
    return None


def _slot_of(block: _Block) -> int:
    return block.slot


async def _seal_blocks(
    blocks: list[_Block], auth: BlockAuthenticator | None, fingerprint: bytes
) -> None:
    """xxh3_128 (and, with a key, the MAC tag) of each block, yielding every few MiB.

    Runs on the tier's loop thread, never the scheduler's; hashlib releases
    the GIL while it hashes a block.
    """
    budget = _HASH_SLICE_BYTES
    for block in blocks:
        block.checksum = _checksum(block.view)
        if auth is not None:
            block.tag = auth.tag(block.key, fingerprint, block.view)
        budget -= block.view.nbytes
        if budget <= 0:
            budget = _HASH_SLICE_BYTES
            await asyncio.sleep(0)
