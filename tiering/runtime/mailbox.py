"""The hand-off from the scheduler thread to a loop thread: a deque and coalesced wake-ups.

``post(fn, arg)`` appends to a ``collections.deque`` (thread-safe, ~0.1 us)
and wakes the loop with ``call_soon_threadsafe`` only when no wake-up is
already pending. While the loop is busy, posts cost no system call at all;
one wake-up drains everything posted since. See ``docs/runtime.md`` for the
measurements behind this choice (``run_coroutine_threadsafe`` costs a
concurrent Future, a Task and a self-pipe write per job).

Why no post is ever lost: the loop clears ``_wake_pending`` *before* it
empties the deque, and a poster appends *before* it reads the flag. A poster
that reads True therefore appended before the pending drain cleared the
flag, so that drain (which empties the deque after clearing) sees its item.
A poster that reads False schedules a new drain. At worst a drain finds the
deque empty. This relies on the GIL making each deque operation and flag
read/write atomic (CPython with the GIL).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class Mailbox:
    """Calls ``fn(arg)`` on ``loop``'s thread, in posting order, for each ``post(fn, arg)``."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._items: deque[tuple[Callable[[Any], object], Any]] = deque()
        self._wake_pending = False

    def post(self, fn: Callable[[Any], object], arg: Any) -> None:
        """Hand ``fn(arg)`` to the loop thread; returns at once (any thread)."""
        self._items.append((fn, arg))
        if not self._wake_pending:
            self._wake_pending = True
            self._loop.call_soon_threadsafe(self._drain)

    def __len__(self) -> int:
        return len(self._items)

    def _drain(self) -> None:
        self._wake_pending = False  # before emptying: see the module docstring
        items = self._items
        while items:
            fn, arg = items.popleft()
            try:
                fn(arg)
            except Exception:  # one bad item must not strand the ones behind it
                logger.exception("mailbox item %r failed on the loop thread", fn)
