"""I/O operations, their completion, and the priority order in which backends run them.

An :class:`IoOp` is one vectored read or write at a file offset (several
adjacent slots become one op) or an fdatasync. Backends fill in ``done`` (bytes
moved) and ``error``; they retry short transfers themselves, so an op ends
either complete, at end of file (a short read), or with an error.
"""

from __future__ import annotations

import asyncio
import enum
import errno
import logging
from collections import deque
from collections.abc import Callable, Sequence

logger = logging.getLogger(__name__)


class OpKind(enum.IntEnum):
    READ = 0
    WRITE = 1
    FSYNC = 2


class Priority(enum.IntEnum):
    """Dispatch order: journal and sync first, then reads (loads), then writes (stores)."""

    URGENT = 0
    READ = 1
    WRITE = 2


class IoBatch:
    """Completion of a group of ops: ``future`` resolves once every op has finished."""

    __slots__ = ("future", "pending")

    def __init__(self, loop: asyncio.AbstractEventLoop, count: int) -> None:
        self.pending = count
        self.future: asyncio.Future[None] = loop.create_future()
        if count == 0:
            self.future.set_result(None)

    def op_finished(self) -> None:
        self.pending -= 1
        if self.pending == 0 and not self.future.done():
            self.future.set_result(None)


class IoOp:
    """One read, write or fdatasync. ``buffers`` are moved in order starting at ``offset``."""

    __slots__ = (
        "addresses",
        "batch",
        "buffers",
        "done",
        "error",
        "fd",
        "kind",
        "nbytes",
        "offset",
        "on_done",
        "priority",
        "started",
        "withdrawn",
    )

    def __init__(
        self,
        kind: OpKind,
        fd: int,
        offset: int = 0,
        buffers: Sequence[memoryview] = (),
        priority: Priority | None = None,
        addresses: list[int] | None = None,
    ) -> None:
        self.kind = kind
        self.fd = fd
        self.offset = offset
        self.buffers = list(buffers)
        #: The buffers' addresses when the caller already knows them (saves io_uring a lookup).
        self.addresses = addresses
        #: Runs on the loop as soon as this op is over (e.g. to verify its blocks while the
        #: rest of the batch is still in flight).
        self.on_done: Callable[[IoOp], None] | None = None
        self.nbytes = sum(b.nbytes for b in self.buffers)
        self.priority = priority if priority is not None else _DEFAULT_PRIORITY[kind]
        self.done = 0
        self.error: BaseException | None = None
        self.batch: IoBatch | None = None
        self.started = False
        self.withdrawn = False

    @property
    def ok(self) -> bool:
        """Finished without error and moved every byte."""
        return self.error is None and self.done == self.nbytes

    def remaining(self) -> list[memoryview]:
        """The buffers still to move after ``done`` bytes (for a short transfer's retry)."""
        skip = self.done
        if not skip:
            return self.buffers
        out: list[memoryview] = []
        for buf in self.buffers:
            size = buf.nbytes
            if skip >= size:
                skip -= size
                continue
            out.append(buf[skip:] if skip else buf)
            skip = 0
        return out

    def remaining_spans(self) -> list[tuple[int, int]]:
        """``(address, length)`` of what is still to move (needs ``addresses``)."""
        assert self.addresses is not None
        skip = self.done
        out: list[tuple[int, int]] = []
        for buf, address in zip(self.buffers, self.addresses, strict=True):
            size = buf.nbytes
            if skip >= size:
                skip -= size
                continue
            out.append((address + skip, size - skip))
            skip = 0
        return out

    def finish(self) -> None:
        """Called once by the backend, on the loop thread, when the op is over."""
        if self.on_done is not None:
            try:
                self.on_done(self)
            except Exception:  # a bug in the hook must not wedge the batch
                logger.exception("I/O completion hook failed for %r", self)
                if self.error is None:
                    self.error = OSError(errno.EIO, "completion hook failed")
        if self.batch is not None:
            self.batch.op_finished()

    def __repr__(self) -> str:
        return (
            f"IoOp({self.kind.name}, fd={self.fd}, offset={self.offset}, "
            f"nbytes={self.nbytes}, done={self.done}, error={self.error!r})"
        )


_DEFAULT_PRIORITY = {
    OpKind.READ: Priority.READ,
    OpKind.WRITE: Priority.WRITE,
    OpKind.FSYNC: Priority.URGENT,
}


class Dispatcher:
    """Queues of waiting ops and the rule for which runs next (pure, not thread-safe).

    Urgent ops always go first. With no preference, reads go before writes
    but a write is taken after ``read_burst`` reads in a row while writes
    wait, so reads take priority without starving writes. A thread that
    prefers one kind takes the other when its own queue is empty.
    """

    def __init__(self, read_burst: int = 3) -> None:
        if read_burst <= 0:
            raise ValueError(f"read_burst must be positive, got {read_burst}")
        self._queues: tuple[deque[IoOp], deque[IoOp], deque[IoOp]] = (deque(), deque(), deque())
        self._read_burst = read_burst
        self._reads_in_row = 0
        self._waiting = 0

    def __len__(self) -> int:
        return self._waiting

    def push(self, op: IoOp) -> None:
        self._queues[op.priority].append(op)
        self._waiting += 1

    def push_front(self, op: IoOp) -> None:
        self._queues[op.priority].appendleft(op)
        self._waiting += 1

    def pop(self, prefer: Priority | None = None, writes_allowed: bool = True) -> IoOp | None:
        """The next op to run, or None. ``writes_allowed=False`` holds plain writes back."""
        urgent, reads, writes = self._queues
        if urgent:
            return self._take(urgent)
        if not writes_allowed:
            return self._take_read(reads) if reads else None
        if prefer is Priority.WRITE:
            order = (writes, reads)
        elif prefer is Priority.READ:
            order = (reads, writes)
        elif reads and writes and self._reads_in_row >= self._read_burst:
            order = (writes, reads)
        else:
            order = (reads, writes)
        for queue in order:
            if queue:
                return self._take_read(queue) if queue is reads else self._take_write(queue)
        return None

    def _take_read(self, queue: deque[IoOp]) -> IoOp:
        self._reads_in_row += 1
        return self._take(queue)

    def _take_write(self, queue: deque[IoOp]) -> IoOp:
        self._reads_in_row = 0
        return self._take(queue)

    def _take(self, queue: deque[IoOp]) -> IoOp:
        self._waiting -= 1
        op = queue.popleft()
        op.started = True
        return op

    def waiting(self) -> list[IoOp]:
        """Every queued op, in no particular order."""
        return [op for queue in self._queues for op in queue]

    def withdraw(self, ops: Sequence[IoOp]) -> list[IoOp]:
        """Mark the given ops that have not started as withdrawn; returns them."""
        out = [op for op in ops if not op.started and not op.withdrawn]
        for op in out:
            op.withdrawn = True
        if out:
            for queue in self._queues:
                kept = [op for op in queue if not op.withdrawn]
                self._waiting -= len(queue) - len(kept)
                queue.clear()
                queue.extend(kept)
        return out
