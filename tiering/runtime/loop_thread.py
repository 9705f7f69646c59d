"""A named thread running one event loop under anyio's blocking portal, and the ways in.

The thread and its loop are ``anyio.from_thread.start_blocking_portal()``:
the portal starts the named thread and runs the loop (``anyio.run`` on the
asyncio backend). :meth:`LoopThread.call` runs a coroutine there as the
portal's ``start_task_soon`` would (its exception re-raised with its own type;
cancelling the future cancels it), but hands it over with
``asyncio.run_coroutine_threadsafe``, which never waits for the loop: the
portal's spawn does, without a bound. This module adds only what a tier
runtime needs on top:

* a **deadline** on :meth:`LoopThread.call` that holds even when the loop is
  wedged (at ``timeout`` the call is cancelled and ``TimeoutError`` raised);
* the project's error types: :class:`WrongThreadError` (a blocking call from
  the loop thread itself, refused instead of deadlocking; the portal's own
  refusal is a bare ``RuntimeError``) and
  :class:`~tiering.core.errors.TierClosedError` once closed;
* **GIL hand-offs**: the loop's selector lets a thread waiting for the GIL
  (the scheduler) have it at least every ``max_gil_hold_s`` of continuous
  loop work (:mod:`tiering.runtime.gil_handoff`);
* a **bounded close**: tasks the tier created with ``loop.create_task``
  (outside the portal's task group) are cancelled and awaited, async
  generators and the default executor (``asyncio.to_thread``) are shut down,
  each within ``timeout_s``; then the portal stops, the thread is joined and
  so are anyio's worker threads of this loop (``anyio.to_thread``). The
  portal's own exit joins without a bound, so a loop wedged by a tier's
  blocking code is left as a daemon thread with an error logged instead.

:meth:`LoopThread.call_soon` (``loop.call_soon_threadsafe``) stays for the
non-blocking hot path; jobs use :class:`~tiering.runtime.mailbox.Mailbox` on
:attr:`LoopThread.loop`, because a portal call per job costs a blocking round
trip on the scheduler thread (``benchmarks/facade.py`` section 1 and
``docs/runtime.md``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Generator
from types import TracebackType
from typing import Any, TypeVar

import anyio.from_thread

from tiering.core.errors import TierClosedError, TieringError
from tiering.runtime.gil_handoff import (
    DEFAULT_MAX_GIL_HOLD_S,
    handoff_loop_factory,
    handoffs_of,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WrongThreadError(TieringError, RuntimeError):
    """A blocking call into an event-loop thread was made from that thread (it would deadlock)."""


class LoopThread:
    """One event loop on its own named thread (an anyio blocking portal); a context manager.

    Construction starts the thread and returns once the loop runs. The loop
    hands the GIL to waiting threads after ``max_gil_hold_s`` of continuous
    work (``None``: never; :mod:`tiering.runtime.gil_handoff`).
    :meth:`close` cancels what is left on the loop, shuts down its default
    executor, stops the portal, joins the thread (and anyio's worker threads)
    and leaves the loop closed. Idempotent.
    """

    def __init__(self, name: str, max_gil_hold_s: float | None = DEFAULT_MAX_GIL_HOLD_S) -> None:
        self.name = name
        self._close_lock = threading.Lock()
        self._closed = False
        self._portal_cm: contextlib.AbstractContextManager[anyio.from_thread.BlockingPortal] = (
            anyio.from_thread.start_blocking_portal(
                "asyncio",
                {"loop_factory": handoff_loop_factory(max_gil_hold_s)},
                name=name,
            )
        )
        self._portal = self._portal_cm.__enter__()
        self._loop, self._thread, self._portal_tasks = self._portal.call(_loop_facts)

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (schedule on it only through thread-safe calls from other threads)."""
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def portal(self) -> anyio.from_thread.BlockingPortal:
        """The anyio portal running the loop (for ``start_task_soon``, context managers...)."""
        return self._portal

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def gil_handoffs(self) -> int:
        """GIL hand-offs the loop has made so far (:mod:`tiering.runtime.gil_handoff`)."""
        return handoffs_of(self._loop)

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.get_ident() == self._thread.ident

    def call(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        timeout: float | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the loop (a portal task) and return its result; blocks.

        The coroutine's exception is re-raised with its own type. After
        ``timeout`` seconds the coroutine is cancelled and ``TimeoutError``
        raised, also when the loop is wedged and never starts it: the call is
        handed over with ``asyncio.run_coroutine_threadsafe``, which does not
        wait, because the portal's ``start_task_soon`` first waits for the
        loop without a bound (a tier blocking its loop would hang the engine's
        shutdown). Raises :class:`WrongThreadError` on the loop thread and
        :class:`~tiering.core.errors.TierClosedError` once closed.
        """
        self._check_callable_from_here("call")
        future = asyncio.run_coroutine_threadsafe(_awaited(fn, *args), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # cancels the coroutine's task on the loop
            raise TimeoutError(
                f"{getattr(fn, '__qualname__', fn)!s} did not finish within {timeout} s "
                f"on event-loop thread {self.name!r}"
            ) from None

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop and return at once (any thread).

        Raises :class:`~tiering.core.errors.TierClosedError` once closed.
        """
        if self._closed:
            raise TierClosedError(f"event-loop thread {self.name!r} is closed")
        self._loop.call_soon_threadsafe(fn, *args)

    def _check_callable_from_here(self, what: str) -> None:
        if self._closed:
            raise TierClosedError(f"event-loop thread {self.name!r} is closed")
        if self.in_loop_thread():
            raise WrongThreadError(
                f"LoopThread.{what}() was called on event-loop thread {self.name!r} itself; "
                "it blocks until the loop runs the call, so it would deadlock: await the "
                "coroutine directly instead"
            )

    def close(self, timeout_s: float = 10.0) -> None:
        """Cancel leftover tasks, shut down the executor, stop the portal and join. Idempotent.

        Waits at most about ``timeout_s`` in all. If the loop is wedged (a
        callback blocking it) the thread is left running as a daemon and an
        error is logged; nothing else can be done from outside.
        """
        with self._close_lock:
            if self._closed:
                return
            if self.in_loop_thread():
                raise WrongThreadError(
                    f"LoopThread.close() was called on event-loop thread {self.name!r} itself"
                )
            self._closed = True
        deadline = time.monotonic() + timeout_s
        # Plain asyncio hand-offs, not portal calls: the portal's spawn blocks without a
        # bound, and close must stay bounded even when a tier wedged the loop.
        finalized = asyncio.run_coroutine_threadsafe(self._finalize(timeout_s * 0.8), self._loop)
        try:
            finalized.result(timeout_s)
        except BaseException:
            logger.exception("event-loop thread %r: finalizing the loop failed", self.name)
        with contextlib.suppress(RuntimeError):  # the loop already stopped (it cannot, today)
            asyncio.run_coroutine_threadsafe(self._portal.stop(), self._loop)
        self._thread.join(max(0.0, deadline - time.monotonic()))
        if self._thread.is_alive():
            logger.error(
                "event-loop thread %r did not stop within %s s (something blocks the loop); "
                "leaving it as a daemon thread",
                self.name,
                timeout_s,
            )
            # The portal's exit joins the thread: run it only once the thread has ended,
            # from a daemon reaper. Left to the garbage collector it would run wherever
            # the last reference dies - in the loop thread itself ("cannot join current
            # thread"), or blocking another thread on the wedged loop.
            threading.Thread(target=self._reap, name=f"{self.name}-reaper", daemon=True).start()
            return
        self._portal_cm.__exit__(None, None, None)  # the thread has ended: returns at once
        for worker in _anyio_workers_of(self._loop):
            worker.join(max(0.0, deadline - time.monotonic()))

    def _reap(self) -> None:
        """Exit the portal once a thread left running has ended (waits as long as it takes)."""
        self._thread.join()
        with contextlib.suppress(Exception):
            self._portal_cm.__exit__(None, None, None)

    async def _finalize(self, timeout_s: float) -> None:
        """Cancel every task but the portal's, then shut down async generators and the executor."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        me = asyncio.current_task()
        leftovers = [t for t in asyncio.all_tasks() if t is not me and t not in self._portal_tasks]
        for task in leftovers:
            task.cancel()
        if leftovers:
            _, pending = await asyncio.wait(leftovers, timeout=max(0.0, deadline - loop.time()))
            if pending:
                logger.error(
                    "event-loop thread %r: %d task(s) ignored cancellation: %s",
                    self.name,
                    len(pending),
                    ", ".join(repr(t.get_coro()) for t in pending),
                )
        await loop.shutdown_asyncgens()
        try:
            await asyncio.wait_for(
                loop.shutdown_default_executor(), max(0.001, deadline - loop.time())
            )
        except TimeoutError:
            logger.error("event-loop thread %r: executor threads still busy at close", self.name)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "running"
        return f"<LoopThread {self.name!r} {state}>"


def _loop_facts() -> tuple[asyncio.AbstractEventLoop, threading.Thread, frozenset[object]]:
    """Run once on the new loop: the loop, its thread and the portal's own tasks (kept alive)."""
    me = asyncio.current_task()
    portal_tasks = frozenset(t for t in asyncio.all_tasks() if t is not me)
    return asyncio.get_running_loop(), threading.current_thread(), portal_tasks


def _anyio_workers_of(loop: asyncio.AbstractEventLoop) -> Generator[threading.Thread, None, None]:
    """anyio's ``to_thread`` worker threads serving ``loop``.

    anyio tells them to stop when the portal's task ends but does not join
    them; they carry their loop as ``.loop`` (anyio 4's ``WorkerThread``).
    """
    for thread in threading.enumerate():
        if getattr(thread, "loop", None) is loop and thread is not threading.current_thread():
            yield thread


async def _awaited(fn: Callable[..., Awaitable[T]], *args: Any) -> T:
    """``fn(*args)`` awaited (``fn`` may return any awaitable, as the portal allowed)."""
    return await fn(*args)
