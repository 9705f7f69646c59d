"""A weighted, first-come first-served limiter of block operations on one event loop.

``asyncio.Semaphore`` counts callers; a tier's ``max_concurrency`` counts
*block operations*, and one batch call (``write_many`` of 12 keys) is 12 of
them. This limiter grants ``n`` units at once, in arrival order, so a large
batch is not starved by a stream of small ones.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque


class BlockLimiter:
    """At most ``capacity`` units held at once; ``acquire(n)`` waits its turn (FIFO).

    Loop-thread only. ``n`` must be in ``[1, capacity]``.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be at least 1, got {capacity}")
        self.capacity = capacity
        self._available = capacity
        self._waiters: deque[tuple[int, asyncio.Future[None]]] = deque()

    @property
    def in_use(self) -> int:
        return self.capacity - self._available

    async def acquire(self, n: int) -> None:
        """Take ``n`` units, waiting behind earlier callers.

        Cancellation: a cancelled waiter takes nothing (units granted just
        before the cancellation are given back) and leaves the queue.
        """
        if not 1 <= n <= self.capacity:
            raise ValueError(f"cannot acquire {n} units of a limiter of {self.capacity}")
        if not self._waiters and self._available >= n:
            self._available -= n
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        entry = (n, waiter)
        self._waiters.append(entry)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(n)  # granted, then cancelled before we could use it
            else:
                with contextlib.suppress(ValueError):  # _wake may have dropped it already
                    self._waiters.remove(entry)
                self._wake()  # we may have been the head blocking smaller requests
            raise

    def release(self, n: int) -> None:
        """Give back ``n`` units and grant waiters in order while they fit."""
        self._available += n
        if self._available > self.capacity:
            raise RuntimeError(f"limiter released more than acquired ({self._available})")
        self._wake()

    def _wake(self) -> None:
        while self._waiters:
            n, waiter = self._waiters[0]
            if waiter.done():  # cancelled while queued; its acquire removes it
                self._waiters.popleft()
                continue
            if n > self._available:
                return
            self._waiters.popleft()
            self._available -= n
            waiter.set_result(None)
