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

With ``root_dirs`` the tier stripes its blocks over several directories (one
per drive), each opened as a tier of one root is; :mod:`tiers.fs.roots` says
where each block goes and what happens when a drive fails.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import logging
import os
from collections.abc import Iterable, Mapping, Sequence

from tiering.core.errors import ConfigError, PartialBatchError, TierClosedError
from tiering.core.keys import OffloadKey
from tiering.tier import AsyncTier, TierContext
from tiers.fs.config import DEFAULT_MAX_IO_BYTES, DEFAULT_SLAB_BYTES, FsTierConfig
from tiers.fs.io import IoBackend, make_backend
from tiers.fs.layout import Geometry
from tiers.fs.lifecycle import plan_geometry, record_open, start_open_state, stop_open_state
from tiers.fs.opening import Prepared, close_prepared_when_done, prepare_root
from tiers.fs.reads import read_blocks
from tiers.fs.records import encode_del
from tiers.fs.roots import CHECK_INTERVAL_S, PROBE_INTERVAL_S, Root, RootSet
from tiers.fs.state import FsTierStats, OpenState, notify_room
from tiers.fs.striping import read_striped, write_striped
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
        root_dir: str | os.PathLike[str] | None = None,
        root_dirs: Sequence[str | os.PathLike[str]] | None = None,
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
        self.check_options({"root_dir": self.config.root_dir, "io_backend": self.config.io_backend})
        # Blocks the framework may hand over at once. Queued blocks cost nothing here (the
        # backend keeps ``queue_depth`` ops in the kernel), and whole jobs in one call
        # coalesce into large vectored I/Os, so take a whole job or several.
        self.max_concurrency = MAX_BLOCKS_PER_CALL
        self.stats = FsTierStats()
        self._roots = RootSet(
            self.config,
            name=lambda: self.context.name,
            stats=self.stats,
            report_removed=self.report_removed,
        )
        self._open_state: OpenState | None = None  # a tier of one root: its state
        self._closed = False
        self._watching: asyncio.Task[None] | None = None
        self._is_open = False

    @classmethod
    def check_options(cls, options: Mapping[str, object]) -> None:
        """No root, or ``io_backend: "uring"`` where io_uring failed its probe: ConfigError now."""
        if options.get("root_dir") is None and options.get("root_dirs") is None:
            raise ConfigError("fs tier: root_dir (or root_dirs, a list of directories) is required")
        if options.get("io_backend") == "uring":
            from tiers.fs.io import uring_unavailable_reason

            reason = uring_unavailable_reason()
            if reason is not None:
                raise ConfigError(f"fs tier: io_backend='uring' is not available here: {reason}")

    # -- lifecycle ----------------------------------------------------------------------

    async def open(self, context: TierContext) -> None:
        """Lock each root, check its header, replay its journal, open its slab files.

        A cache written for another block size or layout fingerprint is reset
        (or refused, with ``on_layout_mismatch="error"``). A root of a striped
        tier that fails with an I/O error starts out of service (the others
        serve); any other failure, or every root failing, fails the open.
        Cancellation: what was opened is closed again before the cancellation
        propagates.
        """
        if self._open_state is not None or self._closed or self._roots.in_service():
            raise RuntimeError("FileSystemTier.open may be called only once")
        await super().open(context)
        cfg = self.config
        roots = self._roots.roots

        async def prepare(root: Root) -> Prepared:
            # Inside each root's own attempt: sizing by capacity_blocks reads the free space
            # of its drive, which fails like any other I/O on a dead one.
            geometry = plan_geometry(root.config, context.block_bytes)
            root.weight = float(geometry.capacity_slots)
            return await self._prepare(root.config, geometry)

        results = await asyncio.gather(*(prepare(r) for r in roots), return_exceptions=True)
        opened = [(r, p) for r, p in zip(roots, results, strict=True) if isinstance(p, Prepared)]
        failed = [
            (r, e) for r, e in zip(roots, results, strict=True) if isinstance(e, BaseException)
        ]
        fatal = [e for _, e in failed if not (cfg.striped and isinstance(e, OSError))]
        if fatal or not opened:
            for _, prepared in opened:
                prepared.close()
            raise (fatal or [e for _, e in failed])[0]
        try:
            for root, prepared in opened:
                root.state = self._start(root, prepared)
        except BaseException:
            for root, prepared in opened:
                if root.state is None:
                    prepared.close()
            await self._stop_all()
            raise
        for root, error in failed:
            self._roots.start_out(root, error)
        self._open_state = roots[0].state if not cfg.striped else None
        self.stats.io_backend = opened[0][0].state.backend.name  # type: ignore[union-attr]
        record_open(self.stats, cfg, self.context.name, [p for _, p in opened])
        if cfg.striped:
            self._roots.drop_duplicates()
        self._is_open = True
        if cfg.striped:
            self._watching = asyncio.get_running_loop().create_task(
                self._watch_roots(), name=f"fs-tier-roots-{id(self)}"
            )

    async def _prepare(self, config: FsTierConfig, geometry: Geometry, **options: bool) -> Prepared:
        """:func:`prepare_root` in a worker thread; what it opened is closed if cancelled."""
        root_set, fingerprint = self.config.root_set, self.context.layout_fingerprint
        prepare = functools.partial(prepare_root, config, geometry, fingerprint, root_set)
        job = asyncio.ensure_future(asyncio.to_thread(prepare, **options))
        try:
            return await asyncio.shield(job)
        except asyncio.CancelledError:
            job.add_done_callback(close_prepared_when_done)
            raise

    def _start(self, root: Root, prepared: Prepared) -> OpenState:
        direct = prepared.slabs.direct
        return start_open_state(
            prepared,
            root.config,
            name=self.context.name,
            fingerprint=self.context.layout_fingerprint,
            stats=self.stats,
            make_backend=lambda loop: self._make_backend(loop, direct_io=direct),
            report_removed=self.report_removed,
            on_deletion_noticed=self.stats.count_deletion,
            task_tag=id(self) + root.index,
        )

    async def _watch_roots(self) -> None:
        """Check the roots every CHECK_INTERVAL_S and probe those out of service.

        Cancellation (the tier closing): stops at once; a probe's open is closed when it ends.
        """
        every = round(PROBE_INTERVAL_S / CHECK_INTERVAL_S)
        for tick in itertools.count(1):  # each root's own watch checks its files meanwhile
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check_roots(probe=tick % every == 0, check_files=False)

    async def check_roots(self, probe: bool = True, check_files: bool = True) -> None:
        """Take out roots whose deletion watch refuses stores; with ``probe``, try the others.

        A root out of service is opened again only if its own cache is still
        there (its header names this layout): a bare directory, such as the
        mount point of an unmounted drive, is never filled. Cancellation: an
        open in progress is closed again when its thread ends.
        """
        roots = self._roots
        for root in roots.in_service() if check_files else ():  # files checked now
            await root.state.watch.check()  # type: ignore[union-attr]
        for root in roots.refusing_roots():
            refusing = root.state.watch.refusing  # type: ignore[union-attr]
            roots.take_out(root, refusing or "", logging.WARNING)  # the watch logged the ERROR
        if not probe or self._closed:
            return
        for root in roots.waiting_for_probe():
            try:  # its blocks were reported removed: it comes back empty
                geometry = plan_geometry(root.config, self.context.block_bytes)
                prepared = await self._prepare(
                    root.config, geometry, forget_blocks=True, must_exist=True
                )
            except Exception as exc:
                logger.debug("fs tier %s: probe of %r: %s", self.context.name, root.path, exc)
                continue
            if self.closed:  # aclose ran while the root was being opened
                prepared.close()
                return
            root.weight = float(geometry.capacity_slots)
            try:
                state = self._start(root, prepared)
            except BaseException:
                prepared.close()
                raise
            roots.bring_back(root, state)

    def _make_backend(self, loop: asyncio.AbstractEventLoop, *, direct_io: bool) -> IoBackend:
        """The I/O backend the config asks for, one per root (tests override this)."""
        cfg = self.config
        return make_backend(
            cfg.io_backend,
            loop,
            queue_depth=cfg.queue_depth,
            n_read_threads=cfg.n_read_threads,
            n_write_threads=cfg.n_write_threads,
            direct_io=direct_io,
        )

    async def aclose(self) -> None:
        """Flush the journal (fdatasync unless durability is "none"), stop tasks, close files.

        Idempotent. Cancellation: files, threads and the root lock are still
        released; records not yet written are dropped (never acknowledged).
        """
        if self._closed:
            return
        self._closed = True
        self._open_state = None
        if self._watching is not None:
            self._watching.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watching
        await self._stop_all()

    async def _stop_all(self) -> None:
        states = await self._roots.close()
        for state in states:
            state.closed = True
            notify_room(state)  # writes waiting for room see the tier closed and fail
        durable = self.config.durability != "none"
        errors = []
        for state in states:
            try:
                await stop_open_state(state, durable=durable)
            except BaseException as exc:  # stop every root before raising
                errors.append(exc)
        if errors:
            raise errors[0]

    @property
    def closed(self) -> bool:
        """Whether :meth:`aclose` was called."""
        return self._closed

    def _state(self) -> OpenState:
        """The open state of a tier of one root."""
        state = self._open_state
        if state is None:
            if self._closed:
                raise TierClosedError("fs tier is closed")
            raise RuntimeError("fs tier is not open yet")
        return state

    def _check_open(self) -> RootSet:
        """The roots of a striped tier, once it is open and until it closes."""
        if self._closed:
            raise TierClosedError("fs tier is closed")
        if not self._is_open:
            raise RuntimeError("fs tier is not open yet")
        return self._roots

    # -- lookups ------------------------------------------------------------------------

    async def contains(self, key: OffloadKey) -> bool:
        """Whether ``key``'s block is visible. Cancellation: no side effects."""
        if not self.config.striped:
            return key in self._state().index
        return self._check_open().holder(key) is not None

    async def contains_many(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """``contains`` for each key, from the in-memory indexes. Cancellation: no side effects."""
        if not self.config.striped:
            index = self._state().index
            return [key in index for key in keys]
        roots = self._check_open()
        return [roots.holder(key) is not None for key in keys]

    async def list_keys(self) -> Iterable[OffloadKey]:
        """Every visible key (after :meth:`open`: the blocks recovered from disk).

        Cancellation: no side effects.
        """
        if not self.config.striped:
            return self._state().index.keys()
        roots = self._check_open().in_service()
        states = [root.state for root in roots if root.state is not None]
        return [key for state in states for key in state.index.keys()]  # noqa: SIM118

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark blocks recently used for eviction. Cancellation: no side effects."""
        if not self.config.striped:
            index = self._state().index
            for key in keys:
                index.access(key)
            return
        roots = self._check_open()
        for key in keys:
            root = roots.holder(key)
            if root is not None:
                root.state.index.access(key)  # type: ignore[union-attr]

    @property
    def parts_out_of_service(self) -> int:
        """Roots out of service now (the runtime's statistics and metrics report it)."""
        return self.stats.roots_out_of_service

    @property
    def capacity_blocks(self) -> int | None:
        """How many blocks fit in the roots in service (None before open)."""
        return self.stats.capacity_slots or None

    def num_blocks(self) -> int:
        """Number of visible blocks (loop thread)."""
        states = [root.state for root in self._roots.in_service()]
        return sum(len(state.index) for state in states if state is not None)

    # -- delete -------------------------------------------------------------------------

    async def delete(self, key: OffloadKey) -> None:
        """Drop ``key``'s block (no error if absent); waits for its DEL record.

        Cancellation: the block is already gone from lookups; the record is
        still written.
        """
        # Striped: every root holding it (one, once open dropped the duplicates).
        held = [self._state()] if not self.config.striped else self._check_open().states_of(key)
        pending = [(state, state.journal.next_seq) for state in held if key in state.index]
        for state, seq in pending:
            state.index.remove(key, seq)
            state.journal.append(encode_del([key], state.seed), retry=True)
            notify_room(state)
        for state, seq in pending:
            await state.journal.wait_durable(seq)

    # -- reads --------------------------------------------------------------------------

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        """Copy ``key``'s verified block into ``into``.

        Raises BlockNotFound, CorruptBlock (checksum or short read; the entry
        is dropped) or OSError (the entry is dropped). Cancellation: waits for
        I/O already in the kernel (it writes into ``into``), then propagates;
        ``into`` may be partly written.
        """
        errors = await self._read(list([key]), [into])
        if errors:
            raise errors[key]

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        """Read several blocks with vectored I/O (adjacent slots make one op).

        Raises PartialBatchError naming the keys that failed. Cancellation: as
        for :meth:`read`.
        """
        errors = await self._read(keys, into)
        if errors:
            raise PartialBatchError([k for k in keys if k not in errors], errors)

    async def _read(
        self, keys: Sequence[OffloadKey], into: Sequence[memoryview]
    ) -> dict[bytes, BaseException]:
        if not self.config.striped:
            return await read_blocks(self._state(), keys, into)
        return await read_striped(self._check_open(), keys, into)

    # -- writes -------------------------------------------------------------------------

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """Store ``data`` as ``key``'s block (replacing any previous one), evicting if full.

        Returns once the block is visible (its data written and its index
        record durable per the durability policy). Raises TierFullError or
        OSError. Cancellation: waits for I/O already in the kernel, then
        propagates; the block is then either absent or complete.
        """
        errors = await self._write([key], [data])
        if errors:
            raise errors[key]

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        """Store several blocks: adjacent slots, vectored writes, one journal commit per root.

        Raises PartialBatchError naming the keys that failed. Cancellation: as
        for :meth:`write`, per block.
        """
        errors = await self._write(keys, data)
        if errors:
            raise PartialBatchError([k for k in keys if k not in errors], errors)

    async def _write(
        self, keys: Sequence[OffloadKey], data: Sequence[memoryview]
    ) -> dict[bytes, BaseException]:
        if not self.config.striped:
            return await write_blocks(self._state(), keys, data)
        return await write_striped(self._check_open(), keys, data)
