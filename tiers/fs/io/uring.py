"""io_uring backend: submissions and completions on the tier's event loop.

The ring is driven through the kernel's interface directly
(:mod:`tiers.fs.io.kernel_ring`: no compiled binding, the GIL released for
every syscall). Completions are signalled through an eventfd registered on the
ring and watched with ``loop.add_reader``; nothing ever blocks the loop.

Before a ring is used in this process, :func:`uring_unavailable_reason` has
exercised the backend in a child process (:mod:`tiering.support.native_probe`), so a
machine where it would crash the interpreter only loses the fast path.

At most ``queue_depth`` ops are in the kernel at once; plain writes may
occupy at most three quarters of them, so a load always finds room.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import tempfile
from collections.abc import Sequence

from tiering.support.native_probe import probe_in_child
from tiers.fs.io.aligned import address_of
from tiers.fs.io.backend import EventFd, IoBackend, wait_uncancelled
from tiers.fs.io.kernel_ring import KernelRing, RingFull, ring_unsupported_reason
from tiers.fs.io.ops import Dispatcher, IoOp, OpKind, Priority

logger = logging.getLogger(__name__)

PROBE_NAME = "io_uring"


@functools.cache
def uring_unavailable_reason() -> str | None:
    """Why io_uring cannot be used in this process (None when it can).

    Three steps, each only if the previous passed: the platform (Linux,
    x86-64); the backend's whole read/write path run in a child process (a
    crash there, e.g. SIGILL, costs only the child; the verdict is cached per
    machine); a ring set up and torn down in this process (ENOSYS under an
    emulator, EPERM under a seccomp profile). Memoised for the process.
    """
    reason = ring_unsupported_reason()
    if reason is not None:
        return reason
    verdict = probe_in_child(PROBE_NAME, f"{__name__}:self_test")
    if not verdict.ok:
        return verdict.reason
    try:
        KernelRing(4).close()
    except OSError as exc:
        return f"io_uring_setup failed in this process: {exc.strerror or exc}"
    return None


def self_test() -> None:
    """Run the backend's exact I/O path once (in the probe's child process); raise on failure.

    Writes and reads one block with a single buffer and with several, and
    syncs, through :class:`UringBackend` on a private event loop, O_DIRECT where
    the temporary directory's filesystem takes it, and checks every byte.
    """
    import mmap

    block = 4096
    with tempfile.TemporaryDirectory(prefix="kv-tiering-uring-probe-") as tmp:
        path = os.path.join(tmp, "probe.bin")
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
        except OSError:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        source = mmap.mmap(-1, 3 * block)
        target = mmap.mmap(-1, 3 * block)
        try:
            os.ftruncate(fd, 3 * block)
            source[:] = os.urandom(3 * block)
            src, dst = memoryview(source), memoryview(target)

            async def exercise() -> None:
                backend = UringBackend(asyncio.get_running_loop(), queue_depth=4)
                try:
                    ops = [
                        IoOp(OpKind.WRITE, fd, 0, [src[:block]]),
                        IoOp(OpKind.WRITE, fd, block, [src[block : 2 * block], src[2 * block :]]),
                    ]
                    await backend.run(ops)
                    await backend.run([IoOp(OpKind.FSYNC, fd)])
                    reads = [
                        IoOp(OpKind.READ, fd, 0, [dst[:block]]),
                        IoOp(OpKind.READ, fd, block, [dst[block : 2 * block], dst[2 * block :]]),
                    ]
                    await backend.run(reads)
                    for op in ops + reads:
                        if not op.ok:
                            raise OSError(errno.EIO, f"probe op did not complete: {op!r}")
                finally:
                    await backend.aclose()

            asyncio.run(exercise())
            if dst != src:
                raise OSError(errno.EIO, "io_uring read back other bytes than it wrote")
            src.release()
            dst.release()
        finally:
            source.close()
            target.close()
            os.close(fd)


class UringBackend(IoBackend):
    """One ring per tier, driven entirely from the tier's event-loop thread."""

    name = "uring"

    def __init__(self, loop: asyncio.AbstractEventLoop, queue_depth: int) -> None:
        super().__init__(loop)
        self._depth = queue_depth
        self._write_cap = max(1, queue_depth - max(1, queue_depth // 4))
        entries = 1
        while entries < 2 * queue_depth:
            entries *= 2
        self._ring = KernelRing(entries)
        try:
            self._wakeup = EventFd()
        except BaseException:
            self._ring.close()
            raise
        try:
            self._ring.register_eventfd(self._wakeup.fd)
        except BaseException:
            self._ring.close()
            self._wakeup.close()
            raise
        self._dispatch = Dispatcher()
        # user_data -> (op, iovec array kept alive until the kernel is done with it)
        self._inflight: dict[int, tuple[IoOp, bytearray | None]] = {}
        self._inflight_writes = 0
        self._next_id = 1
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
        user_data = self._next_id
        try:
            iov = self._prepare_entry(op, user_data)
        except RingFull:  # submission queue full: hand it to the kernel and retry once
            self._submit()
            try:
                iov = self._prepare_entry(op, user_data)
            except RingFull:
                raise RuntimeError("io_uring submission queue is full") from None
        self._next_id += 1
        self._inflight[user_data] = (op, iov)
        if op.priority is Priority.WRITE:
            self._inflight_writes += 1

    def _prepare_entry(self, op: IoOp, user_data: int) -> bytearray | None:
        if op.kind is OpKind.FSYNC:
            self._ring.prepare_fdatasync(op.fd, user_data)
            return None
        if op.addresses is not None:
            spans = op.remaining_spans()
        else:
            spans = [(address_of(buf), buf.nbytes) for buf in op.remaining()]
        return self._ring.prepare_rw(
            op.kind is OpKind.WRITE, op.fd, op.offset + op.done, spans, user_data
        )

    def _submit(self) -> None:
        try:
            self._ring.submit()
        except OSError as exc:
            # EAGAIN/EBUSY (no room for completions yet): the entries stay queued in
            # the ring and the next completion's pump submits them again.
            if exc.errno not in (errno.EAGAIN, errno.EBUSY, errno.EINTR) or not self._inflight:
                raise

    # -- completion ---------------------------------------------------------------------

    def _on_ready(self) -> None:
        self._wakeup.drain()
        finished: list[IoOp] = []
        for user_data, res in self._ring.completions():
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
        self._ring.close()
        self._wakeup.close()
