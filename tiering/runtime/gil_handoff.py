"""A loop thread that hands the GIL to a waiting thread at least every ``max_hold_s``.

Why: CPython 3.11's GIL has no fairness for a thread that comes back from a
GIL-free wait (the scheduler thread after a GPU step). The waiter is woken
when the holder releases the GIL, but a busy event loop releases it only for
a moment at each ``epoll_wait(0)`` or short system call and takes it straight
back, before the woken waiter is on a CPU. Each such re-take also restarts
the waiter's switch-interval clock, so CPython's forced switch never comes:
the waiter can wait for as long as the loop stays busy. ``benchmarks/
gil_handoff.py`` measures it: with a loop running 100 µs callbacks, a thread
back from a 2 ms sleep waited 0.4 s (median) on the development machine.

The fix is on the loop's side, in the one place every loop iteration passes:
the selector. When the loop has run callbacks back to back for ``max_hold_s``
without blocking, the next poll first sleeps ``pause_s`` (whatever the poll's
timeout: a loop busy with I/O finds events ready at once); the
sleep releases the GIL for long enough that a woken waiter takes it, and the
loop continues once that thread releases it again. A poll that blocked for
at least ``pause_s`` (the loop was idle, so any waiter had its chance)
restarts the budget. The cost is at most one pause per ``max_hold_s`` of
continuous loop work, and nothing while the loop idles. A single callback
that runs Python for longer than ``max_hold_s`` is not interrupted: CPython's
own switch interval (``sys.getswitchinterval()``) bounds that case.
"""

from __future__ import annotations

import asyncio
import selectors
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from _typeshed import FileDescriptorLike

#: Default budget of continuous loop work between hand-offs (see ``docs/runtime.md``).
DEFAULT_MAX_GIL_HOLD_S = 0.001
#: How long a hand-off releases the GIL (the sleep's real length is longer: timer slack,
#: about 50 µs on Linux). A woken thread must reach its CPU within it: 20 µs often
#: lost the race on the development VM (wake p99 0.75-1.3 ms at a 1 ms budget), 50-60 µs
#: did not (0.44-0.49 ms), for 3-4 % more of a saturated loop's time.
HANDOFF_PAUSE_S = 50e-6


class HandoffSelector(selectors.BaseSelector):
    """The platform's default selector, with a GIL hand-off before a poll once the budget is spent.

    Owned by one event loop and called only on its thread (the selector
    contract); :attr:`handoffs` counts the pauses taken. ``clock`` and
    ``sleep`` are :func:`time.perf_counter` and :func:`time.sleep` (tests
    pass their own).
    """

    def __init__(
        self,
        max_hold_s: float,
        pause_s: float = HANDOFF_PAUSE_S,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        _check_hold(max_hold_s)
        self._inner = selectors.DefaultSelector()
        self._max_hold_s = max_hold_s
        self._pause_s = pause_s
        self._clock = clock
        self._sleep = sleep
        self._held_since = clock()
        self.handoffs = 0

    def select(self, timeout: float | None = None) -> list[tuple[selectors.SelectorKey, int]]:
        # Wall time since the loop last let go, not the loop thread's CPU time: what a
        # waiting thread feels is wall time, whoever held the GIL meanwhile. (A CPU-time
        # budget was tried: it lost the whole gain on Redis, scheduler wake p99 2.9-3.6 ms
        # against 1.4-1.9 ms, benchmarks/engine_step.py --pin on.)
        started = self._clock()
        # Before any poll, blocking or not: a poll that may block often returns at once
        # (I/O already ready), so a loop busy with I/O callbacks never polls with 0.
        if started - self._held_since >= self._max_hold_s:
            self._sleep(self._pause_s)  # releases the GIL: a waiting thread takes it here
            self.handoffs += 1
            started = self._held_since = self._clock()
        ready = self._inner.select(timeout)
        now = self._clock()
        if now - started >= self._pause_s:  # it really waited: waiters had their chance
            self._held_since = now
        return ready

    def register(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._inner.register(fileobj, events, data)

    def unregister(self, fileobj: FileDescriptorLike) -> selectors.SelectorKey:
        return self._inner.unregister(fileobj)

    def modify(
        self, fileobj: FileDescriptorLike, events: int, data: Any = None
    ) -> selectors.SelectorKey:
        return self._inner.modify(fileobj, events, data)

    def get_map(self) -> Mapping[FileDescriptorLike, selectors.SelectorKey]:
        return self._inner.get_map()

    def close(self) -> None:
        self._inner.close()


def hold_seconds(max_gil_hold_ms: float | None) -> float | None:
    """The managers' ``max_gil_hold_ms`` option in seconds (``None``, off, stays ``None``)."""
    return None if max_gil_hold_ms is None else max_gil_hold_ms / 1e3


def handoff_loop_factory(max_hold_s: float | None) -> Callable[[], asyncio.AbstractEventLoop]:
    """An event-loop factory: a loop over a :class:`HandoffSelector`, or plain (``None``)."""
    if max_hold_s is None:
        return asyncio.new_event_loop
    _check_hold(max_hold_s)

    def new_loop() -> asyncio.AbstractEventLoop:
        return asyncio.SelectorEventLoop(HandoffSelector(max_hold_s))

    return new_loop


def handoffs_of(loop: asyncio.AbstractEventLoop) -> int:
    """How many GIL hand-offs ``loop`` has made (0 for a loop without them)."""
    selector = getattr(loop, "_selector", None)  # asyncio's selector loops keep it there
    return selector.handoffs if isinstance(selector, HandoffSelector) else 0


def _check_hold(max_hold_s: float) -> None:
    if not 0 < max_hold_s < float("inf"):
        raise ValueError(f"max_hold_s must be a positive, finite number of seconds: {max_hold_s}")
