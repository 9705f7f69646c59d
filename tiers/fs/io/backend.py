"""The interface of an I/O backend and the completion plumbing both backends share.

A backend runs :class:`~tiers.fs.io.ops.IoOp` batches for coroutines on one
event loop. Completions reach the loop through an eventfd watched with
``loop.add_reader``: no thread ever blocks the loop, and one wake-up drains
every completion that arrived meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from abc import ABC, abstractmethod
from collections.abc import Sequence

from tiers.fs.io.ops import IoBatch, IoOp


class IoBackend(ABC):
    """Runs reads, writes and fdatasyncs of one tier on its event loop."""

    #: Name shown in logs and statistics ("uring" or "threads").
    name: str = ""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._closed = False

    async def run(self, ops: Sequence[IoOp]) -> None:
        """Run ``ops`` (any order, concurrently) and return when all have finished.

        Each op's outcome is in its ``done``/``error``; this does not raise
        for I/O errors. Cancellation: ops not yet started are withdrawn; ops
        already handed to the kernel or a thread are waited for (they may still
        touch their buffers), then ``CancelledError`` propagates.
        """
        batch = self.start(ops)
        await self.wait(batch, ops)

    def start(self, ops: Sequence[IoOp]) -> IoBatch:
        """Queue ``ops`` now (the kernel or threads start on them at once); see :meth:`wait`."""
        if self._closed:
            raise RuntimeError(f"{self.name} I/O backend is closed")
        batch = IoBatch(self._loop, len(ops))
        for op in ops:
            op.batch = batch
        if ops:
            self._enqueue(ops)
        return batch

    async def wait(self, batch: IoBatch, ops: Sequence[IoOp]) -> None:
        """Wait for a batch from :meth:`start`. Cancellation: as for :meth:`run`."""
        try:
            await asyncio.shield(batch.future)
        except asyncio.CancelledError:
            await self.abandon(batch, ops)
            raise

    async def abandon(self, batch: IoBatch, ops: Sequence[IoOp]) -> None:
        """Withdraw the ops of a started batch that have not started; wait for the others.

        Cancellation: ignored until the started ops have finished (the kernel
        or a thread may still be using their buffers).
        """
        for op in self._withdraw(ops):
            op.error = asyncio.CancelledError()
            op.finish()
        await wait_uncancelled(batch.future)

    @abstractmethod
    def _enqueue(self, ops: Sequence[IoOp]) -> None:
        """Queue ops for dispatch (loop thread)."""

    @abstractmethod
    def _withdraw(self, ops: Sequence[IoOp]) -> list[IoOp]:
        """Remove the ops of ``ops`` that have not started; returns them (loop thread)."""

    @abstractmethod
    async def aclose(self) -> None:
        """Stop accepting ops, finish what is in flight and release threads/rings/fds.

        Idempotent. Cancellation: resources are released anyway (threads are
        still joined).
        """


async def wait_uncancelled(future: asyncio.Future[None]) -> None:
    """Wait for ``future`` even if cancelled meanwhile (kernel I/O cannot be abandoned).

    Bounded by the I/O in flight; the caller re-raises the first cancellation.
    """
    while not future.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(future)


class EventFd:
    """A non-blocking eventfd: threads or the kernel ``signal``, the loop ``drain``s."""

    def __init__(self) -> None:
        self.fd = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)

    def signal(self) -> None:
        os.eventfd_write(self.fd, 1)

    def drain(self) -> None:
        with contextlib.suppress(BlockingIOError):
            os.eventfd_read(self.fd)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1
