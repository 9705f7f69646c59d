"""The index journal at run time: group commit, durability, compaction.

Records (see :mod:`tiers.fs.records`) are appended in memory and written by
one flusher task, in order, so the file is always a valid prefix followed by
at most one torn record. A caller waits for its record's sequence number to
be *durable*: written to the file (a process crash keeps it) and, under the
``fsync`` policy, fdatasync'ed after the data it describes.

Callbacks attached to a record run on the loop as soon as it is durable and
before any later snapshot is taken: that is where a PUT makes its block
visible, so a block is visible only once its record is in the journal and a
compaction never misses a visible block.

When the file grows past a threshold it is compacted: the visible entries are
written to a new journal, which atomically replaces the old one. Reading the
file at open and writing those snapshots is :mod:`tiers.fs.journal_file`. The
loop thread only copies the index's items (C speed: 0.09 s per million blocks,
against 0.23 s when it also reshaped each entry); encoding them, per entry, is
the worker thread's.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import itertools
import logging
import os
from collections.abc import Awaitable, Callable

from tiers.fs.files import RootDir, is_deleted
from tiers.fs.io import IoBackend, IoOp, OpKind, Priority
from tiers.fs.journal_file import Snapshot, write_snapshot_for_append
from tiers.fs.layout import Header

logger = logging.getLogger(__name__)

#: Compact once the file is this much larger than its live records (and at least MIN).
COMPACT_FACTOR = 4
COMPACT_MIN_BYTES = 8 * 1024 * 1024
#: A rough size of one PUT entry (36-byte keys), for the compaction threshold.
RECORD_ESTIMATE = 70


def compaction_limit(live_count: int) -> int:
    """The journal size past which it is compacted, for ``live_count`` visible blocks: the
    running tier's rule, and an open's (it rewrites an intact journal only past it)."""
    return max(COMPACT_MIN_BYTES, COMPACT_FACTOR * live_count * RECORD_ESTIMATE)


class JournalWriteError(OSError):
    """Writing the journal failed; the records are retried with the next flush."""


class JournalWriter:
    """Appends records with group commit; owned by the tier, driven by :meth:`run`.

    ``sync_each_flush`` (the ``fsync`` policy) fdatasyncs the journal after
    each write, and ``before_flush`` (fdatasync of the slab data) runs before
    it so a record never becomes durable ahead of its data.
    ``snapshot`` returns the visible entries for compaction and ``live_count``
    how many there are.
    """

    def __init__(
        self,
        root: RootDir,
        header: Header,
        fd: int,
        end_offset: int,
        backend: IoBackend,
        *,
        sync_each_flush: bool,
        before_flush: Callable[[], Awaitable[None]] | None,
        snapshot: Callable[[], Snapshot],
        live_count: Callable[[], int],
    ) -> None:
        self.seed = header.journal_seed
        self._root = root
        self._header = header
        self._fd = fd
        self._offset = end_offset
        self._backend = backend
        self._sync_each_flush = sync_each_flush
        self._before_flush = before_flush
        self._snapshot = snapshot
        self._live_count = live_count
        self._retry_compaction_at = 0
        self._pending: list[tuple[bytes, bool]] = []
        self._callbacks: list[tuple[Callable[[], None] | None, Callable[[], None] | None]] = []
        self._appended_seq = 0
        self._durable_seq = 0
        self._waiters: list[tuple[int, int, asyncio.Future[None]]] = []
        self._tiebreak = itertools.count()
        self._wakeup = asyncio.Event()
        self._sync_requested = False
        self._closing = False
        self._failure: OSError | None = None
        self._broken: BaseException | None = None
        self._rotation_waiters: list[asyncio.Future[bool]] = []
        self._replacing = False  # a compaction is renaming a new file over ours
        self.compactions = 0

    @property
    def durable_seq(self) -> int:
        return self._durable_seq

    @property
    def next_seq(self) -> int:
        """The sequence number the next :meth:`append` will return."""
        return self._appended_seq + 1

    @property
    def size(self) -> int:
        return self._offset

    def append(
        self,
        payload: bytes,
        on_durable: Callable[[], None] | None = None,
        on_failed: Callable[[], None] | None = None,
        *,
        retry: bool = False,
    ) -> int:
        """Queue encoded records; returns their sequence number. Never blocks.

        ``on_durable`` runs on the loop once they are durable; ``on_failed``
        instead if their write fails. Failed records are dropped, unless
        ``retry`` (DEL records: a freed slot must stay unusable until its
        DEL is in the file), which are written again with the next flush.
        """
        if self._closing or self._broken is not None:
            raise RuntimeError(f"journal is closed{f': {self._broken}' if self._broken else ''}")
        self._appended_seq += 1
        if payload:
            self._pending.append((payload, retry))
        if on_durable is not None or on_failed is not None:
            self._callbacks.append((on_durable, on_failed))
        self._wakeup.set()
        return self._appended_seq

    async def wait_durable(self, seq: int) -> None:
        """Return once records ``<= seq`` are durable; raises the flush's OSError if it failed.

        Cancellation: only the wait is abandoned; the records are still written.
        """
        if seq <= self._durable_seq:
            return
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (seq, next(self._tiebreak), future))
        self._wakeup.set()
        await future

    def file_deleted(self) -> bool:
        """Whether the journal file was unlinked under us (records written now would be lost).

        False while a compaction replaces it (the old file is unlinked on purpose).
        """
        return self._fd >= 0 and not self._replacing and is_deleted(self._fd)

    async def rotate(self) -> bool:
        """Write a fresh journal of the visible entries now (e.g. the file was deleted).

        Returns whether it worked. The new file holds every visible block, and
        records appended later go to it. Cancellation: only the wait is
        abandoned; the rotation still happens.
        """
        if self._closing or self._broken is not None:
            return False
        future: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._rotation_waiters.append(future)
        self._wakeup.set()
        return await future

    def request_sync(self) -> None:
        """Ask the flusher to fdatasync the journal at its next turn (periodic policy)."""
        self._sync_requested = True
        self._wakeup.set()

    async def run(self) -> None:
        """The flusher: write pending records in order until :meth:`close`.

        Cancellation: stops at once; records not yet written are lost (they
        were never acknowledged as durable), the file stays a valid prefix.
        """
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                if self._pending or self._appended_seq > self._durable_seq:
                    await self._flush_once()
                if self._sync_requested:
                    self._sync_requested = False
                    await self._sync_journal_quietly()
                if self._rotation_waiters:
                    waiters, self._rotation_waiters = self._rotation_waiters, []
                    done = await self._compact()
                    for future in waiters:
                        if not future.done():
                            future.set_result(done)
                elif self._failure is None and self._offset > self._compact_threshold():
                    await self._compact()
                if self._closing and (not self._pending or self._failure is not None):
                    return
        except Exception as exc:  # a bug: fail every waiter rather than hang them
            logger.exception("fs tier: journal flusher failed")
            self._broken = exc
            self._fail_waiters(self._appended_seq, exc)
            raise

    async def close(self, flusher: asyncio.Task[None] | None, sync: bool) -> None:
        """Write what is pending, fdatasync if ``sync``, stop the flusher, close the fd.

        Cancellation: the fd is closed anyway; unwritten records are dropped.
        """
        self._closing = True
        self._wakeup.set()
        try:
            if flusher is not None and not flusher.done():
                with contextlib.suppress(Exception):
                    await flusher
            if sync and self._broken is None:
                await self._sync_journal_quietly()
        finally:
            if self._fd >= 0:
                os.close(self._fd)
                self._fd = -1
            for _, _, future in self._waiters:
                if not future.done():
                    future.set_exception(RuntimeError("journal closed before the flush"))
            self._waiters.clear()
            for rotation in self._rotation_waiters:
                if not rotation.done():
                    rotation.set_result(False)
            self._rotation_waiters.clear()

    # -- internals ----------------------------------------------------------------------

    async def _flush_once(self) -> None:
        taken, self._pending = self._pending, []
        payload = b"".join(chunk for chunk, _ in taken)
        callbacks, self._callbacks = self._callbacks, []
        upto = self._appended_seq
        try:
            if self._before_flush is not None:
                await self._before_flush()
            if payload:
                op = IoOp(OpKind.WRITE, self._fd, self._offset, [memoryview(payload)])
                op.priority = Priority.URGENT
                await self._backend.run([op])
                if not op.ok:
                    raise JournalWriteError(
                        getattr(op.error, "errno", None) or 5,
                        f"journal write failed at offset {self._offset}: "
                        f"{op.error or 'short write'}",
                    )
            if self._sync_each_flush:
                await self._fsync_journal()
        except OSError as exc:
            # Cut whatever part of the write landed, so no record of it can be replayed;
            # DEL records are written again with the next flush, the others are dropped.
            with contextlib.suppress(OSError):
                os.ftruncate(self._fd, self._offset)
            self._pending[:0] = [(chunk, retry) for chunk, retry in taken if retry]
            self._failure = exc
            logger.error("fs tier: %s", exc)
            for _, on_failed in callbacks:
                if on_failed is not None:
                    on_failed()
            self._fail_waiters(upto, exc)
            return
        self._offset += len(payload)
        self._durable_seq = upto
        self._failure = None
        for on_durable, _ in callbacks:
            if on_durable is not None:
                on_durable()
        self._wake_waiters()

    async def _fsync_journal(self) -> None:
        op = IoOp(OpKind.FSYNC, self._fd)
        await self._backend.run([op])
        if op.error is not None:
            raise JournalWriteError(
                getattr(op.error, "errno", None) or 5, f"journal fdatasync failed: {op.error}"
            )

    async def _sync_journal_quietly(self) -> None:
        if self._fd < 0:
            return
        try:
            await self._fsync_journal()
        except OSError as exc:
            logger.error("fs tier: %s", exc)

    def _wake_waiters(self) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= self._durable_seq:
            _, _, future = heapq.heappop(waiters)
            if not future.done():
                future.set_result(None)

    def _fail_waiters(self, upto: int, exc: BaseException) -> None:
        waiters = self._waiters
        while waiters and waiters[0][0] <= upto:
            _, _, future = heapq.heappop(waiters)
            if not future.done():
                future.set_exception(exc)

    def _compact_threshold(self) -> int:
        return max(compaction_limit(self._live_count()), self._retry_compaction_at)

    async def _compact(self) -> bool:
        snapshot = self._snapshot()
        self._replacing = True
        try:
            new_fd, size = await asyncio.to_thread(self._write_and_open, snapshot)
        except OSError as exc:
            self._retry_compaction_at = 2 * self._offset
            logger.error("fs tier: journal compaction failed (will retry later): %s", exc)
            return False
        finally:
            self._replacing = False
        self._retry_compaction_at = 0
        old_fd, self._fd, self._offset = self._fd, new_fd, size
        with contextlib.suppress(OSError):
            os.close(old_fd)
        self.compactions += 1
        logger.debug(
            "fs tier: compacted the journal to %d entries (%d bytes)", len(snapshot[0]), size
        )
        return True

    def _write_and_open(self, snapshot: Snapshot) -> tuple[int, int]:
        """Write the snapshot, keeping it open for appending (blocking; a worker thread)."""
        return write_snapshot_for_append(self._root, self._header, snapshot)
