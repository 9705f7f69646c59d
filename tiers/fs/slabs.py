"""Slab files: created and preallocated as the cache fills, kept open, O_DIRECT where possible.

Slab ``i`` holds slots ``[i * slots_per_slab, (i + 1) * slots_per_slab)``.
Slabs are created in order, so the backed slots are always a prefix
``[0, backed_slots)``. Creating or growing a slab is blocking (fallocate) and
runs in a worker thread, one at a time. Every file is opened through the
:class:`~tiers.fs.files.RootDir` (``O_NOFOLLOW``, regular files only, 0600).

A slab file unlinked under the running tier (``st_nlink == 0``) is found by
:meth:`SlabFiles.deleted_slabs` and replaced by :meth:`SlabFiles.recreate`:
the old descriptor stays open until :meth:`SlabFiles.close` because I/O
already submitted may still use it.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os

from tiering.core.errors import ConfigError
from tiers.fs.config import DirectIo
from tiers.fs.files import RootDir, is_deleted
from tiers.fs.layout import ALIGNMENT, Geometry, parse_slab_name, slab_name

logger = logging.getLogger(__name__)


class SlabFiles:
    """The open slab files of one root directory (owned by the tier's loop thread)."""

    def __init__(self, root: RootDir, geometry: Geometry, direct_io: DirectIo, preallocate: bool):
        self._root = root
        self.geometry = geometry
        self._want_direct = direct_io
        self._preallocate = preallocate
        self.direct = False
        self._fds: list[int] = []
        self._sizes: list[int] = []
        self.backed_slots = 0
        self._dirty: set[int] = set()
        self._retired: list[int] = []  # descriptors of deleted slabs, closed with the others
        #: Slabs open_existing created because they were missing (deleted while the tier
        #: was closed): the journal's entries for their slots name bytes that are gone.
        self.recreated: set[int] = set()
        self._grow_lock = asyncio.Lock()

    # -- opening (blocking: run in a worker thread) ----------------------------------------

    def open_existing(self) -> None:
        """Open the slabs already on disk, trimming those beyond the capacity.

        Also creates slab 0 if missing and decides whether O_DIRECT works here
        (raises ConfigError if ``direct_io`` is "on" and it does not).
        """
        geometry = self.geometry
        root = self._root
        on_disk = sorted(
            (index, name) for name in root.names() if (index := parse_slab_name(name)) is not None
        )
        for index, name in on_disk:
            if index >= geometry.num_slabs:
                root.unlink(name)
                continue
            fd = root.open_file(name, os.O_RDWR)  # refuses a planted symlink or hard link
            try:
                if os.fstat(fd).st_size > geometry.slab_size(index):
                    os.ftruncate(fd, geometry.slab_size(index))
            finally:
                os.close(fd)
        self.direct = self._decide_direct()
        last = max((i for i, _ in on_disk if i < geometry.num_slabs), default=0)
        for index in range(geometry.num_slabs):
            name = slab_name(index)
            try:
                fd = self._open(name)
            except FileNotFoundError:
                if index > last:
                    break
                # Deleted while the tier was closed, with later slabs intact: made again,
                # empty, so that only its own blocks are lost.
                fd = self._open(name, create=True)
                try:
                    self._allocate(fd, geometry.slab_size(index))
                except BaseException:
                    os.close(fd)
                    raise
                self.recreated.add(index)
            self._fds.append(fd)
            size = os.fstat(fd).st_size
            self._sizes.append(size)
            full = geometry.slab_size(index)
            self.backed_slots += min(size, full) // geometry.slot_bytes
            if size < full:
                break  # a short slab is grown before its remaining slots are used

    def _decide_direct(self) -> bool:
        if self._want_direct == "off":
            return False
        name = slab_name(0)
        # Slab 0 must exist to probe; it is needed anyway. If it was missing (deleted while
        # the tier was closed), the entries the journal has for it name bytes that are gone.
        if not self._root.exists(name):
            self.recreated.add(0)
        fd = self._root.open_file(name, os.O_RDWR, create=True)
        try:
            self._allocate(fd, self.geometry.slab_size(0))
        finally:
            os.close(fd)
        reason = probe_direct_io(self._root, name)
        if reason is None:
            return True
        if self._want_direct == "on":
            raise ConfigError(f"fs tier: direct_io is on but O_DIRECT does not work: {reason}")
        logger.info(
            "fs tier: O_DIRECT unavailable under %s (%s); using buffered I/O",
            self._root.describe(name),
            reason,
        )
        return False

    def _open(self, name: str, *, create: bool = False) -> int:
        flags = os.O_RDWR | (os.O_DIRECT if self.direct else 0)
        return self._root.open_file(name, flags, create=create)

    # -- growing ----------------------------------------------------------------------------

    async def ensure(self, slots: int) -> None:
        """Make sure slots ``[0, slots)`` are backed by slab files; raises OSError (ENOSPC).

        Cancellation: a slab being created finishes in its thread; the next
        call sees it.
        """
        if slots <= self.backed_slots:
            return
        async with self._grow_lock:
            if slots > self.backed_slots:
                await asyncio.to_thread(self._grow_blocking, slots)

    def _grow_blocking(self, slots: int) -> None:
        geometry = self.geometry
        slots = min(slots, geometry.capacity_slots)
        while self.backed_slots < slots:
            index = geometry.slab_of(self.backed_slots)
            full = geometry.slab_size(index)
            if index < len(self._fds):
                fd = self._fds[index]
            else:
                fd = self._open(slab_name(index), create=True)
            try:
                self._allocate(fd, full)
            except OSError:
                if index >= len(self._fds):
                    # Keep a created-but-unallocated slab out of the way of the next try.
                    with contextlib.suppress(OSError):
                        os.ftruncate(fd, 0)
                    os.close(fd)
                raise
            if index >= len(self._fds):
                self._fds.append(fd)
                self._sizes.append(full)
            else:
                self._sizes[index] = full
            self.backed_slots = index * geometry.slots_per_slab + full // geometry.slot_bytes

    def _allocate(self, fd: int, size: int) -> None:
        current = os.fstat(fd).st_size
        if current >= size:
            return
        if self._preallocate:
            try:
                os.posix_fallocate(fd, current, size - current)
                return
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
        os.ftruncate(fd, size)

    # -- I/O helpers ---------------------------------------------------------------------------

    def locate(self, slot: int) -> tuple[int, int, int]:
        """``(slab index, fd, offset)`` of a backed slot."""
        geometry = self.geometry
        index = slot // geometry.slots_per_slab
        return index, self._fds[index], (slot % geometry.slots_per_slab) * geometry.slot_bytes

    def deleted_slabs(self) -> list[int]:
        """Indexes of open slabs whose file was unlinked (one fstat each; cheap)."""
        return [i for i, fd in enumerate(self._fds) if is_deleted(fd)]

    async def recreate(self, slabs: list[int]) -> None:
        """Replace deleted slab files with new, empty ones. Raises OSError if it cannot.

        Cancellation: a file being created finishes in its thread.
        """
        async with self._grow_lock:
            await asyncio.to_thread(self._recreate_blocking, slabs)

    def _recreate_blocking(self, slabs: list[int]) -> None:
        for index in slabs:
            name = slab_name(index)
            self._root.unlink(name)  # whatever took its name is not ours
            fd = self._open(name, create=True)
            try:
                self._allocate(fd, self._sizes[index])
            except BaseException:
                os.close(fd)
                raise
            self._retired.append(self._fds[index])
            self._fds[index] = fd
            self._dirty.discard(index)

    def mark_dirty(self, slab: int) -> None:
        self._dirty.add(slab)

    def take_dirty_fds(self) -> list[int]:
        """The fds written since the last call (to fdatasync)."""
        fds = [self._fds[i] for i in sorted(self._dirty)]
        self._dirty.clear()
        return fds

    @property
    def fds(self) -> list[int]:
        return list(self._fds)

    def close(self) -> None:
        for fd in self._fds + self._retired:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        self._retired.clear()


def probe_direct_io(root: RootDir, name: str) -> str | None:
    """Why O_DIRECT I/O on file ``name`` fails (None when it works). Blocking.

    Reads the first page and writes the same bytes back (the caller holds the
    root's lock, so nothing else writes there meanwhile).
    """
    try:
        fd = root.open_file(name, os.O_RDWR | os.O_DIRECT)
    except OSError as exc:
        return f"open(O_DIRECT): {exc.strerror or exc}"
    buf = mmap.mmap(-1, ALIGNMENT)
    step = "pread"
    try:
        if os.fstat(fd).st_size >= ALIGNMENT and os.preadv(fd, [buf], 0) == ALIGNMENT:
            step = "pwrite"
            os.pwritev(fd, [buf], 0)
    except OSError as exc:
        return f"{step}(O_DIRECT): {exc.strerror or exc}"
    finally:
        os.close(fd)
        buf.close()
    return None
