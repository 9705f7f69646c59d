"""A named thread running one asyncio event loop, and the ways other threads reach it.

Modelled on anyio's ``from_thread.BlockingPortal``: the thread starts on
construction and is always joined by :meth:`LoopThread.close`; :meth:`call`
runs a coroutine function on the loop and blocks for its result (exceptions
keep their type); calling it from the loop thread itself is refused with
:class:`WrongThreadError` instead of deadlocking. :meth:`call_soon` is the
cheap, non-blocking hand-off used on hot paths.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, TypeVar

from tiering.errors import TierClosedError, TieringError

logger = logging.getLogger(__name__)

T = TypeVar("T")


class WrongThreadError(TieringError, RuntimeError):
    """A blocking call into an event-loop thread was made from that thread (it would deadlock)."""


class LoopThread:
    """One event loop on its own named thread; a context manager that closes it.

    Construction starts the thread and returns once the loop runs.
    :meth:`close` cancels what is left on the loop, shuts down its default
    executor (the threads of ``asyncio.to_thread``), stops the loop, joins
    the thread and closes the loop (its selector and self-pipe). Idempotent.
    """

    def __init__(self, name: str, *, start_timeout_s: float = 10.0) -> None:
        self.name = name
        self._loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._close_lock = threading.Lock()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()
        if not self._started.wait(start_timeout_s):  # pragma: no cover - a wedged machine
            raise TimeoutError(f"event-loop thread {name!r} did not start in {start_timeout_s} s")

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        """The loop (schedule on it only through this class's methods from other threads)."""
        return self._loop

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    @property
    def closed(self) -> bool:
        return self._closed

    def in_loop_thread(self) -> bool:
        """Whether the caller runs on this loop's thread."""
        return threading.get_ident() == self._thread.ident

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        try:
            self._loop.run_forever()
        finally:
            asyncio.set_event_loop(None)

    def call(
        self,
        fn: Callable[..., Awaitable[T]],
        *args: Any,
        timeout: float | None = None,
    ) -> T:
        """Run ``fn(*args)`` on the loop and return its result; blocks the calling thread.

        The coroutine's exception is re-raised with its own type. After
        ``timeout`` seconds the coroutine is cancelled and ``TimeoutError``
        raised. Raises :class:`WrongThreadError` on the loop thread and
        :class:`~tiering.errors.TierClosedError` once closed.
        """
        self._check_callable_from_here("call")
        future = asyncio.run_coroutine_threadsafe(_invoke(fn, args), self._loop)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(
                f"{getattr(fn, '__qualname__', fn)!s} did not finish within {timeout} s "
                f"on event-loop thread {self.name!r}"
            ) from None

    def call_soon(self, fn: Callable[..., object], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop and return at once (any thread).

        Raises :class:`~tiering.errors.TierClosedError` once closed.
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
        """Cancel leftover tasks, shut down the default executor, stop and join. Idempotent.

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
        finalized = asyncio.run_coroutine_threadsafe(self._finalize(timeout_s * 0.8), self._loop)
        try:
            finalized.result(timeout_s)
        except BaseException:
            logger.exception("event-loop thread %r: finalizing the loop failed", self.name)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            logger.error(
                "event-loop thread %r did not stop within %s s (something blocks the loop); "
                "leaving it as a daemon thread",
                self.name,
                timeout_s,
            )
            return
        self._loop.close()

    async def _finalize(self, timeout_s: float) -> None:
        """Cancel every other task, then shut down async generators and the executor."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        me = asyncio.current_task()
        leftovers = [t for t in asyncio.all_tasks() if t is not me]
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


async def _invoke(fn: Callable[..., Awaitable[T]], args: tuple[Any, ...]) -> T:
    return await fn(*args)
