"""Thread-pool backend: ``os.preadv``/``os.pwritev`` on read- and write-priority threads.

The portable fallback where io_uring is unavailable. ``n_read_threads``
threads prefer reads and ``n_write_threads`` prefer writes; each takes the
other kind when its own queue is empty, so loads go first and stores are
never starved. The syscalls release the GIL. Finished ops are queued and the
loop is woken through an eventfd.
"""

from __future__ import annotations

import asyncio
import errno
import os
import threading
from collections import deque
from collections.abc import Sequence

from tiers.fs.io.backend import EventFd, IoBackend
from tiers.fs.io.ops import Dispatcher, IoOp, OpKind, Priority


def execute(op: IoOp) -> None:
    """Run ``op`` to completion on this thread, retrying short transfers (never raises)."""
    try:
        if op.kind is OpKind.FSYNC:
            os.fdatasync(op.fd)
            return
        call = os.preadv if op.kind is OpKind.READ else os.pwritev
        while op.done < op.nbytes:
            moved = call(op.fd, op.remaining(), op.offset + op.done)
            if moved <= 0:
                if op.kind is OpKind.WRITE:
                    raise OSError(
                        errno.EIO, f"pwritev wrote nothing at offset {op.offset + op.done}"
                    )
                return  # end of file: a short read, judged by the caller
            op.done += moved
    except OSError as exc:
        op.error = exc


class ThreadBackend(IoBackend):
    """``n_read_threads`` read-priority and ``n_write_threads`` write-priority threads."""

    name = "threads"

    def __init__(
        self, loop: asyncio.AbstractEventLoop, n_read_threads: int, n_write_threads: int
    ) -> None:
        super().__init__(loop)
        self._cond = threading.Condition(threading.Lock())
        self._dispatch = Dispatcher()
        self._finished: deque[IoOp] = deque()
        self._stopping = False
        self._wakeup = EventFd()
        loop.add_reader(self._wakeup.fd, self._on_wakeup)
        self._threads = [
            threading.Thread(
                target=self._work, args=(Priority.READ,), name=f"fs-tier-read-{i}", daemon=True
            )
            for i in range(n_read_threads)
        ] + [
            threading.Thread(
                target=self._work, args=(Priority.WRITE,), name=f"fs-tier-write-{i}", daemon=True
            )
            for i in range(n_write_threads)
        ]
        for thread in self._threads:
            thread.start()

    def _enqueue(self, ops: Sequence[IoOp]) -> None:
        with self._cond:
            for op in ops:
                self._dispatch.push(op)
            self._cond.notify(len(ops))

    def _withdraw(self, ops: Sequence[IoOp]) -> list[IoOp]:
        with self._cond:
            return self._dispatch.withdraw(ops)

    def _work(self, prefer: Priority) -> None:
        cond = self._cond
        while True:
            with cond:
                op = self._dispatch.pop(prefer)
                while op is None:
                    if self._stopping:
                        return
                    cond.wait()
                    op = self._dispatch.pop(prefer)
            execute(op)
            self._finished.append(op)
            try:
                self._wakeup.signal()
            except OSError:  # closed during shutdown: nobody is waiting any more
                return

    def _on_wakeup(self) -> None:
        self._wakeup.drain()
        finished = self._finished
        while finished:
            finished.popleft().finish()

    async def aclose(self) -> None:
        """Stop the threads once queued ops are done, join them, close the eventfd.

        Cancellation: the threads are still joined (in a worker thread) before
        the cancellation propagates.
        """
        if self._closed:
            return
        self._closed = True
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        threads = self._threads
        joiner = asyncio.ensure_future(asyncio.to_thread(_join_all, threads))
        try:
            await asyncio.shield(joiner)
        finally:
            if not joiner.done():
                _join_all(threads)
            self._loop.remove_reader(self._wakeup.fd)
            self._on_wakeup()
            self._wakeup.close()


def _join_all(threads: list[threading.Thread]) -> None:
    for thread in threads:
        thread.join()
