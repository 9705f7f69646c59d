"""GIL hand-offs inside one long piece of work, where no selector runs to make them.

The loop thread hands the GIL to a waiting scheduler thread at least every
millisecond of busy loop (:mod:`tiering.runtime.gil_handoff`), but only between
callbacks. One long piece of work holds it longer:

* Python in a worker thread (an fs tier encoding a journal snapshot: 0.45 s per
  million blocks) is interrupted only at CPython's switch interval: a scheduler
  thread back from a 2 ms GPU step then waited 5.2 ms at the median, 9.3 ms at
  p99, for every step of that time;
* a C call (copying a million-entry index: about 90 ms) is never interrupted.

:class:`GilBreaks` is called between the units of such work and sleeps
``pause_s`` (releasing the GIL long enough for a woken thread to take it, as the
selector's hand-off does) once ``every_s`` has passed since its last pause;
:func:`list_in_turns` copies an iterable in chunks with a break between them, and
:func:`clear_in_turns` empties a list so (freeing is C too: a million references,
about 10 ms).
A pause costs about 60 us per ``every_s`` of work (6 % at 1 ms), and nothing when
the work is shorter than ``every_s``.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterable
from typing import TypeVar

from tiering.runtime.gil_handoff import DEFAULT_MAX_GIL_HOLD_S, HANDOFF_PAUSE_S

T = TypeVar("T")

#: Items copied between two checks of :func:`list_in_turns` (0.2-0.4 ms of C on these machines).
COPY_CHUNK = 8192


class GilBreaks:
    """A callable that pauses ``pause_s`` once ``every_s`` has passed since the last pause.

    For one thread at a time (the one doing the work). ``clock`` and ``sleep`` are
    :func:`time.perf_counter` and :func:`time.sleep` (tests pass their own).
    """

    __slots__ = ("_clock", "_every_s", "_pause_s", "_since", "_sleep", "pauses")

    def __init__(
        self,
        every_s: float = DEFAULT_MAX_GIL_HOLD_S,
        pause_s: float = HANDOFF_PAUSE_S,
        *,
        clock: Callable[[], float] = time.perf_counter,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        if not 0 < every_s < float("inf") or not 0 <= pause_s < float("inf"):
            raise ValueError(f"every_s must be positive and pause_s >= 0: {every_s}, {pause_s}")
        self._every_s, self._pause_s = every_s, pause_s
        self._clock, self._sleep = clock, sleep
        self._since = clock()
        self.pauses = 0

    def __call__(self) -> None:
        if self._clock() - self._since >= self._every_s:
            self._sleep(self._pause_s)  # releases the GIL: a waiting thread takes it here
            self.pauses += 1
            self._since = self._clock()


def list_in_turns(items: Iterable[T], breaks: Callable[[], None] | None = None) -> list[T]:
    """``list(items)``, copied :data:`COPY_CHUNK` at a time with ``breaks()`` between chunks
    (a new :class:`GilBreaks` by default).

    ``items`` must not change meanwhile: the caller owns it and does not run other code
    during the copy (the pauses release the GIL, not the caller's event loop).
    """
    pause = GilBreaks() if breaks is None else breaks
    out: list[T] = []
    iterator = iter(items)
    while chunk := list(itertools.islice(iterator, COPY_CHUNK)):
        out.extend(chunk)
        pause()
    return out


def clear_in_turns(items: list[T], breaks: Callable[[], None] | None = None) -> None:
    """Empty ``items`` from its end, :data:`COPY_CHUNK` at a time with ``breaks()`` between
    chunks: dropping a million references at once is about 10 ms of C, GIL held."""
    pause = GilBreaks() if breaks is None else breaks
    while items:
        del items[-COPY_CHUNK:]
        pause()
