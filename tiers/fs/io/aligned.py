"""Memory alignment for O_DIRECT: checks and a pool of page-aligned bounce buffers.

O_DIRECT needs buffer addresses, lengths and file offsets aligned to the
device's logical block size. Primary-buffer rows are page-aligned whenever the
block size is a multiple of 4 KiB, so they go to the disk as they are; any
other view (an odd block size, a bytes object, a misaligned slice) is copied
through a bounce buffer instead.
"""

from __future__ import annotations

import ctypes
import mmap

import numpy as np

from tiers.fs.layout import ALIGNMENT


def address_of(view: memoryview) -> int:
    """The address of ``view``'s first byte (works for read-only views too)."""
    if not view.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(view))
    return int(np.frombuffer(view, dtype=np.uint8).ctypes.data)


def is_aligned(view: memoryview, alignment: int = ALIGNMENT) -> bool:
    """Whether ``view`` can be used for O_DIRECT as it is."""
    return view.nbytes % alignment == 0 and address_of(view) % alignment == 0


class BouncePool:
    """Reusable page-aligned buffers of ``buffer_bytes`` each (anonymous mmap).

    ``take`` never waits: it allocates when the pool is empty. ``give`` keeps
    at most ``keep`` buffers for reuse (fresh memory is slow to fault in on a
    VM) and drops the rest.
    """

    def __init__(self, buffer_bytes: int, keep: int) -> None:
        if buffer_bytes <= 0 or buffer_bytes % mmap.PAGESIZE:
            raise ValueError(f"buffer_bytes must be a positive multiple of {mmap.PAGESIZE}")
        self.buffer_bytes = buffer_bytes
        self._keep = keep
        self._idle: list[tuple[mmap.mmap, memoryview]] = []
        self._busy: dict[int, mmap.mmap] = {}

    def take(self) -> memoryview:
        if self._idle:
            region, view = self._idle.pop()
        else:
            region = mmap.mmap(-1, self.buffer_bytes)
            view = memoryview(region)
        self._busy[id(view)] = region
        return view

    def give(self, view: memoryview) -> None:
        region = self._busy.pop(id(view))
        if len(self._idle) < self._keep:
            self._idle.append((region, view))
        # Otherwise dropped: the mapping goes once nothing (an io_uring Iovec may
        # hold it a little longer) refers to it.

    def close(self) -> None:
        """Drop the idle buffers (busy ones are dropped when given back)."""
        self._keep = 0
        self._idle.clear()
