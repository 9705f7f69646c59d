"""The hashing threads: per-block tag/checksum/copy work of a batch, off the tier's loop.

A few process-wide daemon threads (:class:`_HashThreads`, started on first
use) run the items of an :class:`OffLoopWork`, which one event loop's thread
submits and awaits. The rule for when a batch goes there at all
(:func:`tiering.tier.auth.offload_pays`) and the MACs themselves live in
:mod:`tiering.tier.auth`, which re-exports what is here.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["OffLoopWork", "slices", "usable_cpus"]

logger = logging.getLogger("tiering.tier.auth")


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask where the OS has one)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


class _HashThreads:
    """Process-wide daemon threads that run :class:`OffLoopWork` items, started on first use.

    As many as the CPUs this process may use (at most 4): BLAKE3, xxhash, OpenSSL's
    HMAC and the bulk copy release the GIL, so they hash on other cores while the
    loops and the scheduler keep theirs. Idle threads block on a queue.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._queue: queue.SimpleQueue[Callable[[], None]] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []

    def submit(self, item: Callable[[], None]) -> None:
        if not self._threads:
            self._start()
        self._queue.put(item)

    def _start(self) -> None:
        with self._lock:
            if self._threads:
                return
            cpus = usable_cpus()
            threads = [
                threading.Thread(target=self._work, name=f"kv-tiering-hash-{i}", daemon=True)
                for i in range(max(1, min(4, cpus)))
            ]
            for thread in threads:
                thread.start()
            self._threads = threads

    def _work(self) -> None:
        get = self._queue.get
        while True:
            get()()  # items never raise (OffLoopWork._run catches everything)

    def _after_fork(self) -> None:
        """In a forked child: no thread survived the fork; start afresh on first use."""
        self._lock = threading.Lock()
        self._queue = queue.SimpleQueue()
        self._threads = []


_HASH_THREADS = _HashThreads()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_HASH_THREADS._after_fork)


class OffLoopWork:
    """Items of one batch run on the hashing threads, and the loop's wait for all of them.

    Created and driven on one event loop's thread: :meth:`submit` items (plain
    callables that read or write buffers the caller keeps alive), then
    :meth:`wait`. Items run concurrently and in any order; each must only touch
    its own blocks. An item that raises is logged and its exception kept in
    :attr:`failure` (the first one): callers set each block's outcome to a
    failure before submitting it and let the item clear it, so work that did not
    run to its end never counts as a success. One loop wake-up per wait,
    whatever the number of items.

    ``wait(help=True)`` runs the items no thread has started yet on the
    waiting (loop) thread itself first: for a caller with nothing else to do
    meanwhile, the batch never takes longer than inline, however busy the
    other cores are, and the hashing threads share it when they can.
    """

    __slots__ = ("_done", "_items", "_lock", "_loop", "_pending", "failure")

    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop if loop is not None else asyncio.get_running_loop()
        self._lock = threading.Lock()
        self._items: collections.deque[Callable[[], None]] = collections.deque()
        self._pending = 0
        self._done: asyncio.Future[None] | None = None
        self.failure: BaseException | None = None

    @property
    def pending(self) -> int:
        """Items submitted and not finished yet."""
        with self._lock:
            return self._pending

    def submit(self, item: Callable[[], None]) -> None:
        """Queue ``item()`` for a hashing thread (loop thread; never blocks)."""
        with self._lock:
            self._pending += 1
            self._items.append(item)
        try:
            _HASH_THREADS.submit(self._run_next)
        except BaseException:
            with self._lock:
                self._items.remove(item)
                self._pending -= 1
            raise

    def _run_next(self) -> None:
        """Run the oldest item nobody has started (none: the loop helped itself to it)."""
        with self._lock:
            if not self._items:
                return
            item = self._items.popleft()
        self._run(item)

    def _run(self, item: Callable[[], None]) -> None:
        try:
            item()
        except BaseException as exc:  # kept for the loop; the thread lives on
            logger.exception("authentication work off the loop failed")
            with self._lock:
                if self.failure is None:
                    self.failure = exc
        finally:
            with self._lock:
                self._pending -= 1
                done = self._done if self._pending == 0 else None
            if done is not None:
                # A closed loop (RuntimeError) has nobody waiting any more.
                with contextlib.suppress(RuntimeError):
                    self._loop.call_soon_threadsafe(_resolve, done)

    async def wait(self, help: bool = False) -> None:
        """Return once every item submitted so far has finished (with ``help``, running
        those not started yet on this thread first).

        Cancellation: ignored until then (the items still read or write the
        caller's buffers), after which ``CancelledError`` propagates; the wait
        itself never takes longer than the hashing of what was submitted.
        """
        if help:
            while True:
                with self._lock:
                    if not self._items:
                        break
                    item = self._items.popleft()
                self._run(item)
        cancelled: asyncio.CancelledError | None = None
        while True:
            with self._lock:
                if self._pending == 0:
                    break
                if self._done is None or self._done.done():
                    self._done = self._loop.create_future()
                done = self._done
            try:
                await done
            except asyncio.CancelledError as exc:
                cancelled = exc
        if cancelled is not None:
            raise cancelled


def _resolve(done: asyncio.Future[None]) -> None:
    if not done.done():
        done.set_result(None)


def slices(sizes: list[int], slice_bytes: int) -> list[tuple[int, int]]:
    """``[lo, hi)`` runs of consecutive items of about ``slice_bytes`` together (at least one
    item each), to hand to the hashing threads."""
    out: list[tuple[int, int]] = []
    lo = total = 0
    for i, size in enumerate(sizes):
        total += size
        if total >= slice_bytes:
            out.append((lo, i + 1))
            lo, total = i + 1, 0
    if lo < len(sizes):
        out.append((lo, len(sizes)))
    return out
