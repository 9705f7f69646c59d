"""io_uring backend (PyPI ``liburing``): submissions and completions on the event loop.

Completions are signalled through an eventfd registered on the ring and
watched with ``loop.add_reader``, and drained with ``io_uring_peek_cqe``. The
binding's blocking waits (``io_uring_wait_cqe``, ``submit_and_wait``) hold
the GIL and would freeze every other thread, so they are never called.

At most ``queue_depth`` ops are in the kernel at once; plain writes may
occupy at most three quarters of them, so a load always finds room.
"""

from __future__ import annotations

import asyncio
import ctypes
import errno
import logging
import os
from collections.abc import Sequence
from typing import Any

from tiers.fs.io.aligned import address_of
from tiers.fs.io.backend import EventFd, IoBackend, wait_uncancelled
from tiers.fs.io.ops import Dispatcher, IoOp, OpKind, Priority

logger = logging.getLogger(__name__)

try:
    import liburing as _uring
except ImportError:  # optional dependency: the thread backend is used instead
    _uring = None

# The binding's ``Iovec(list)`` takes a buffer export of every memoryview it is given and
# never releases it (nor the reference): each op would leak a view and pin the primary
# buffer forever. So iovecs are built from placeholder bytearrays (handled without the
# buffer protocol) and their C array is then filled with the real addresses. The layout
# (PyObject header, then ``usize len``, then ``struct iovec *``) is checked once at import.
_PLACEHOLDER = bytearray()
_IOVEC_ARRAY_OFFSET = 3  # in 8-byte words from the object's start: refcnt, type, len, array


def _iovec_array(iov: object, count: int) -> Any:
    words = (ctypes.c_uint64 * 4).from_address(id(iov))
    if words[2] != count:
        raise RuntimeError("unexpected liburing Iovec layout")
    return (ctypes.c_uint64 * (2 * count)).from_address(words[_IOVEC_ARRAY_OFFSET])


def make_iovec(buffers: Sequence[memoryview]) -> object:
    """A liburing ``Iovec`` over ``buffers`` that holds no export of them (keep them alive)."""
    return iovec_from_spans([(address_of(buf), buf.nbytes) for buf in buffers])


def iovec_from_spans(spans: Sequence[tuple[int, int]]) -> object:
    """A liburing ``Iovec`` over ``(address, length)`` spans (the memory must stay alive)."""
    assert _uring is not None
    count = len(spans)
    iov = _uring.Iovec([_PLACEHOLDER] * count)
    _iovec_array(iov, count)[:] = [field for span in spans for field in span]
    return iov


def _iovec_layout_problem() -> str | None:
    """Why :func:`make_iovec` would be unsafe with this liburing build (None: it is safe)."""
    probe = bytearray(b"probe")
    try:
        iov = _uring.Iovec([probe])
        fields = _iovec_array(iov, 1)
        expected = [ctypes.addressof((ctypes.c_char * 5).from_buffer(probe)), 5]
    except Exception as exc:
        return f"unrecognised liburing Iovec layout ({exc})"
    if list(fields) != expected:
        return "unrecognised liburing Iovec layout"
    return None


def uring_unavailable_reason() -> str | None:
    """Why io_uring cannot be used here (None when it can): missing package, kernel, seccomp."""
    if _uring is None:
        return "the 'liburing' package is not installed (pip install liburing)"
    layout = _iovec_layout_problem()
    if layout is not None:
        return layout
    ring = _uring.Ring()
    try:
        _uring.io_uring_queue_init(4, ring, 0)
    except OSError as exc:
        return f"io_uring_setup failed: {exc.strerror or exc}"
    except Exception as exc:  # the binding raises its own types for some failures
        return f"io_uring_setup failed: {exc}"
    _uring.io_uring_queue_exit(ring)
    return None


class UringBackend(IoBackend):
    """One ring per tier, driven entirely from the tier's event-loop thread."""

    name = "uring"

    def __init__(self, loop: asyncio.AbstractEventLoop, queue_depth: int) -> None:
        super().__init__(loop)
        if _uring is None:
            raise RuntimeError(uring_unavailable_reason())
        self._lib: Any = _uring
        self._depth = queue_depth
        self._write_cap = max(1, queue_depth - max(1, queue_depth // 4))
        entries = 1
        while entries < 2 * queue_depth:
            entries *= 2
        self._ring = self._lib.Ring()
        self._cqe = self._lib.Cqe()
        self._lib.io_uring_queue_init(entries, self._ring, 0)
        self._wakeup = EventFd()
        try:
            self._lib.io_uring_register_eventfd(self._ring, self._wakeup.fd)
        except BaseException:
            self._lib.io_uring_queue_exit(self._ring)
            self._wakeup.close()
            raise
        self._dispatch = Dispatcher()
        # user_data -> (op, iovec kept alive until the kernel is done with it)
        self._inflight: dict[int, tuple[IoOp, object]] = {}
        self._inflight_writes = 0
        self._next_id = 1
        self._unsubmitted = 0
        loop.add_reader(self._wakeup.fd, self._on_ready)

    # -- dispatch -----------------------------------------------------------------------

    def _enqueue(self, ops: Sequence[IoOp]) -> None:
        for op in ops:
            self._dispatch.push(op)
        self._pump()

    def _withdraw(self, ops: Sequence[IoOp]) -> list[IoOp]:
        return self._dispatch.withdraw(ops)

    def _pump(self) -> None:
        """Move queued ops into the ring while there is room, then submit them."""
        while len(self._inflight) < self._depth:
            op = self._dispatch.pop(writes_allowed=self._inflight_writes < self._write_cap)
            if op is None:
                break
            self._prepare_or_fail(op)
        self._submit()

    def _prepare_or_fail(self, op: IoOp) -> bool:
        """Put ``op`` in the ring; if that fails, finish it with the error (never lose it)."""
        try:
            self._prepare(op)
        except Exception as exc:
            op.error = exc if isinstance(exc, OSError) else OSError(errno.EIO, repr(exc))
            op.finish()
            return False
        return True

    def _prepare(self, op: IoOp) -> None:
        lib = self._lib
        sqe = lib.io_uring_get_sqe(self._ring)
        if sqe is None:  # submission queue full: flush it and retry once
            self._submit()
            sqe = lib.io_uring_get_sqe(self._ring)
            if sqe is None:
                raise RuntimeError("io_uring submission queue is full")
        iov: object = None
        if op.kind is OpKind.FSYNC:
            lib.io_uring_prep_fsync(sqe, op.fd, lib.IORING_FSYNC_DATASYNC)
        else:
            if op.addresses is not None:
                iov = iovec_from_spans(op.remaining_spans())
            else:
                iov = make_iovec(op.remaining())
            prep = lib.io_uring_prep_readv if op.kind is OpKind.READ else lib.io_uring_prep_writev
            prep(sqe, op.fd, iov, op.offset + op.done)
        user_data = self._next_id
        self._next_id += 1
        sqe.user_data = user_data
        self._inflight[user_data] = (op, iov)
        if op.priority is Priority.WRITE:
            self._inflight_writes += 1
        self._unsubmitted += 1

    def _submit(self) -> None:
        if not self._unsubmitted:
            return
        try:
            self._lib.io_uring_submit(self._ring)
        except OSError as exc:
            # EAGAIN/EBUSY (no room for completions yet): the entries stay queued in
            # the ring and the next completion's pump submits them again.
            if exc.errno not in (errno.EAGAIN, errno.EBUSY, errno.EINTR) or not self._inflight:
                raise
            return
        self._unsubmitted = 0

    # -- completion ---------------------------------------------------------------------

    def _on_ready(self) -> None:
        self._wakeup.drain()
        lib, ring, cqe = self._lib, self._ring, self._cqe
        finished: list[IoOp] = []
        while True:
            try:
                lib.io_uring_peek_cqe(ring, cqe)
            except BlockingIOError:
                break
            completion = cqe[0]
            user_data = completion.user_data
            try:
                res = completion.res
            except OSError as exc:  # the binding raises for a negative result
                res = -(exc.errno or errno.EIO)
            lib.io_uring_cqe_seen(ring, completion)
            entry = self._inflight.pop(user_data, None)
            if entry is None:
                continue
            op = entry[0]
            if op.priority is Priority.WRITE:
                self._inflight_writes -= 1
            if self._complete(op, res):
                finished.append(op)
        # Refill the ring first: completion hooks (checksums) then run while the device
        # works. The collected ops finish even if refilling fails.
        try:
            self._pump()
        finally:
            for op in finished:
                op.finish()

    def _complete(self, op: IoOp, res: int) -> bool:
        """Record a completion; False when the op was resubmitted (short or interrupted)."""
        if res < 0:
            code = -res
            if code in (errno.EINTR, errno.EAGAIN):
                # transient: resubmit the same remainder (a failed resubmission finishes it)
                self._prepare_or_fail(op)
                return False
            op.error = OSError(code, os.strerror(code))
        elif op.kind is not OpKind.FSYNC:
            op.done += res
            if res > 0 and op.done < op.nbytes:
                self._prepare_or_fail(op)  # short transfer: submit the remainder
                return False
            if res == 0 and op.kind is OpKind.WRITE and op.done < op.nbytes:
                op.error = OSError(errno.EIO, f"write moved nothing at offset {op.offset}")
        return True

    async def aclose(self) -> None:
        """Wait for ops in the ring, then tear the ring down. Idempotent.

        Cancellation: in-flight ops are still waited for (the kernel may write
        into their buffers) before the ring is released.
        """
        if self._closed:
            return
        self._closed = True
        for op in self._dispatch.withdraw(self._dispatch.waiting()):
            op.error = asyncio.CancelledError()
            op.finish()
        batches = {id(op.batch): op.batch for op, _ in self._inflight.values() if op.batch}
        for batch in batches.values():
            await wait_uncancelled(batch.future)
        self._loop.remove_reader(self._wakeup.fd)
        self._lib.io_uring_queue_exit(self._ring)
        self._wakeup.close()
