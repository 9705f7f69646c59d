"""Slab files: created and preallocated as the cache fills, kept open, O_DIRECT where possible.

Slab ``i`` holds slots ``[i * slots_per_slab, (i + 1) * slots_per_slab)``.
Slabs are created in order, so the backed slots are always a prefix
``[0, backed_slots)``. Creating or growing a slab is blocking (fallocate) and
runs in a worker thread, one at a time.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import mmap
import os
from pathlib import Path

from tiering.errors import ConfigError
from tiers.fs.config import DirectIo
from tiers.fs.layout import ALIGNMENT, Geometry, parse_slab_name, slab_name

logger = logging.getLogger(__name__)


class SlabFiles:
    """The open slab files of one root directory (owned by the tier's loop thread)."""

    def __init__(self, root: Path, geometry: Geometry, direct_io: DirectIo, preallocate: bool):
        self._root = root
        self.geometry = geometry
        self._want_direct = direct_io
        self._preallocate = preallocate
        self.direct = False
        self._fds: list[int] = []
        self._sizes: list[int] = []
        self.backed_slots = 0
        self._dirty: set[int] = set()
        self._grow_lock = asyncio.Lock()

    # -- opening (blocking: run in a worker thread) ----------------------------------------

    def open_existing(self) -> None:
        """Open the slabs already on disk, trimming those beyond the capacity.

        Also creates slab 0 if missing and decides whether O_DIRECT works here
        (raises ConfigError if ``direct_io`` is "on" and it does not).
        """
        geometry = self.geometry
        on_disk: dict[int, Path] = {}
        with os.scandir(self._root) as entries:
            for entry in entries:
                index = parse_slab_name(entry.name)
                if index is not None:
                    on_disk[index] = Path(entry.path)
        for index, path in sorted(on_disk.items()):
            if index >= geometry.num_slabs:
                path.unlink()
            elif path.stat().st_size > geometry.slab_size(index):
                os.truncate(path, geometry.slab_size(index))
        self.direct = self._decide_direct()
        for index in range(geometry.num_slabs):
            path = self._root / slab_name(index)
            if not path.exists():
                break
            fd = self._open(path)
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
        path = self._root / slab_name(0)
        if not path.exists():  # slab 0 must exist to probe; it is needed anyway
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
            try:
                self._allocate(fd, self.geometry.slab_size(0))
            finally:
                os.close(fd)
        reason = probe_direct_io(path)
        if reason is None:
            return True
        if self._want_direct == "on":
            raise ConfigError(f"fs tier: direct_io is on but O_DIRECT does not work: {reason}")
        logger.info("fs tier: O_DIRECT unavailable under %s (%s); using buffered I/O", path, reason)
        return False

    def _open(self, path: Path) -> int:
        flags = os.O_RDWR | os.O_CLOEXEC | (os.O_DIRECT if self.direct else 0)
        return os.open(path, flags)

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
            path = self._root / slab_name(index)
            if index < len(self._fds):
                fd = self._fds[index]
            else:
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
                if self.direct:
                    os.close(fd)
                    fd = self._open(path)
            try:
                self._allocate(fd, full)
            except OSError:
                if index >= len(self._fds):
                    os.close(fd)
                    # Keep a created-but-unallocated slab out of the way of the next try.
                    with contextlib.suppress(OSError):
                        os.truncate(path, 0)
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
        for fd in self._fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()


def probe_direct_io(path: Path) -> str | None:
    """Why O_DIRECT I/O on ``path`` fails (None when it works). Blocking.

    Reads the first page and writes the same bytes back (the caller holds the
    root's lock, so nothing else writes there meanwhile).
    """
    try:
        fd = os.open(path, os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
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
