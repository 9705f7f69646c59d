"""The hand-off from the scheduler thread to a loop thread: a deque and coalesced wake-ups.

``post(fn, arg)`` appends to a ``collections.deque`` (thread-safe, ~0.1 us)
and wakes the loop only when no wake-up is already pending. While the loop is
busy, posts cost no system call at all; one wake-up drains everything posted
since. See ``docs/runtime.md`` for the measurements behind this choice
(``run_coroutine_threadsafe`` costs a concurrent Future, a Task and a
self-pipe write per job).

The wake-up is one byte written to a pipe the loop watches, **without
releasing the GIL** (libc's ``write`` through ``ctypes.PyDLL``; a non-blocking
pipe, so it never waits). Python's own writes (``call_soon_threadsafe``'s
``socket.send``) release the GIL for the system call: the loop thread, woken
by that very byte, takes the GIL, and the scheduler waits to get it back - a
millisecond or more in the middle of its step (``benchmarks/backpressure.py``
showed 200 us per send on average and the step p99 dominated by it). Holding
the GIL, the scheduler finishes its step; the loop thread runs when the
scheduler next releases the GIL (waiting for the GPU), or at Python's switch
interval (5 ms) at the latest. Where ``PyDLL`` is unavailable, ``os.write``.

Why no post is ever lost: the loop clears ``_wake_pending`` *before* it
empties the deque, and a poster appends *before* it reads the flag. A poster
that reads True therefore appended before the pending drain cleared the
flag, so that drain (which empties the deque after clearing) sees its item.
A poster that reads False writes a new wake-up byte. At worst a drain finds
the deque empty. This relies on the GIL making each deque operation and flag
read/write atomic (CPython with the GIL).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import logging
import os
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

_WAKE = b"\0"


def _gil_holding_write() -> Callable[[int], object]:
    """A one-byte write to a non-blocking fd that keeps the GIL (``os.write`` releases it)."""
    try:
        write = ctypes.PyDLL(None).write
    except (OSError, AttributeError):  # no symbol lookup in the process: the plain write
        return lambda fd: os.write(fd, _WAKE)
    write.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_size_t)
    write.restype = ctypes.c_ssize_t
    # A full pipe (EAGAIN) means unread wake-ups: the loop wakes anyway.
    return lambda fd: write(fd, _WAKE, 1)


_write_wake = _gil_holding_write()


class Mailbox:
    """Calls ``fn(arg)`` on ``loop``'s thread, in posting order, for each ``post(fn, arg)``.

    Built on any thread; the loop starts watching its pipe at its next turn
    (a post before then is drained then). :meth:`close` once the loop has stopped.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[Callable[[Any], object], Any]] = deque()
        self._wake_pending = False
        self._read_fd, self._write_fd = os.pipe()  # not inherited by children (PEP 446)
        os.set_blocking(self._read_fd, False)
        os.set_blocking(self._write_fd, False)
        loop.call_soon_threadsafe(loop.add_reader, self._read_fd, self._on_wake)

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        """Hand ``fn(arg)`` to the loop thread; returns at once (any thread)."""
        self._items.append((fn, arg))
        if not self._wake_pending:
            self._wake_pending = True
            _write_wake(self._write_fd)

    def __len__(self) -> int:
        return len(self._items)

    def close(self) -> None:
        """Close the pipe (after the loop stopped; posts after this are never run)."""
        for fd in (self._read_fd, self._write_fd):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _on_wake(self) -> None:
        with contextlib.suppress(BlockingIOError):
            while os.read(self._read_fd, 4096):
                pass
        self._drain()

    def _drain(self) -> None:
        self._wake_pending = False  # before emptying: see the module docstring
        items = self._items
        while items:
            fn, arg = items.popleft()
            try:
                fn(arg)
            except Exception:  # one bad item must not strand the ones behind it
                logger.exception("mailbox item %r failed on the loop thread", fn)
