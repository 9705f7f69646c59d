"""Garbage collections handed off the scheduler thread, not run inside its step.

Why: CPython collects when an allocation takes the youngest generation's
count past its threshold (700 by default), on whichever thread makes that
allocation. A tier's loop thread allocates as it serves jobs (futures,
per-block state) and those objects live until their jobs finish, so the
count climbs while the tier works; the allocation that finally crosses the
threshold is most often the scheduler's, and the collection runs inside its
step. ``benchmarks/engine_step.py`` counts them: with the fs tier flat out on
its loop thread, 3.6-7.9% of a resting scheduler's steps ran a collection
(0.5-1 ms each on the development VM, 4 ms for the middle generation), and
the steps' p99 rose 1.5-2.2x; steps alone ran none (``docs/runtime.md``,
"Garbage collections").

The remedy (the managers' ``gc_handoff`` option): once per ``get_finished()``
(once per scheduler step) the facade reads the count; once it is past
:data:`DUE_FRACTION` of the threshold it posts :func:`collect_young_generation`
to another thread of the process, which runs it while the scheduler waits for
the GPU: the tier's loop thread, or, for a tier in a child process (whose
scheduler side still allocates, for the results it unpickles), a
:class:`CollectorThread`. That function does not pick a generation
itself: it lowers the threshold below the count for one allocation, so
CPython's own automatic collection runs, on that thread, choosing the
generation as it always would (the oldest generation's rule reads a ratio
Python cannot see). An embedder who disabled the collector (``gc.disable()``)
or set threshold 0 gets nothing of this.
"""

from __future__ import annotations

import gc
import logging
import queue
import threading

from tiering.core.errors import ConfigError
from tiering.runtime.affinity import pin_current_thread

logger = logging.getLogger(__name__)

#: Share of the youngest generation's threshold past which a collection is handed
#: off the scheduler thread. Lower hands over more, smaller collections; the scheduler's
#: own allocations within one step must fit under the rest of the threshold.
DUE_FRACTION = 0.25


def young_collection_due() -> bool:
    """Whether the youngest generation's count is past :data:`DUE_FRACTION` of its threshold
    (False while automatic collection is off). A couple of C calls: cheap on any thread."""
    if not gc.isenabled():
        return False
    threshold = gc.get_threshold()[0]
    return threshold > 0 and gc.get_count()[0] >= threshold * DUE_FRACTION


def collect_young_generation() -> None:
    """Run CPython's automatic collection now, on this thread, if it is still due.

    Lowers the youngest generation's threshold to 1 for the few allocations it
    takes to cross it, then puts the thresholds back: the allocation that crosses
    runs the collection here, exactly as the one the scheduler would have made
    there (CPython chooses the generation, by rules that read counts Python cannot
    see). One allocation, where filling the count up to the real threshold took a
    few hundred (and as many more objects for the collection to traverse): about
    10 us instead of 41 us per hand-off here, 7.6 us of it the collection itself.
    Should another thread allocate in that window, the collection runs there, as
    it would have without a hand-off.
    Gives up after :data:`_MAX_BALLAST` allocations, should something else switch
    collection off meanwhile. One thread at a time (a second returns at once):
    two interleaved would save and restore each other's lowered threshold, and
    leave a collection on every allocation of the process for good.
    """
    if not young_collection_due() or not _THRESHOLD_LOCK.acquire(blocking=False):
        return
    try:
        _collect_with_lowered_threshold()
    finally:
        _THRESHOLD_LOCK.release()


def _collect_with_lowered_threshold() -> None:
    thresholds = gc.get_threshold()
    count = gc.get_count()[0]
    ballast: list[_Ballast] = []
    gc.set_threshold(1, *thresholds[1:])
    try:
        # Instances of a class with a __dict__: each one counts (lists come from
        # CPython's free list, which never touches the count). Python 3.12 runs a due
        # collection at the thread's next check for pending work, not inside the
        # allocation: the loop goes round until the count drops.
        for _ in range(_MAX_BALLAST):
            ballast.append(_Ballast())
            now = gc.get_count()[0]
            if now < count:
                return
            count = now
    finally:
        gc.set_threshold(*thresholds)


class _Ballast:
    """An allocation that counts towards the youngest generation (see above)."""


#: Most allocations :func:`collect_young_generation` makes waiting for the collection.
_MAX_BALLAST = 64
#: Held while the youngest generation's threshold is lowered (see collect_young_generation).
_THRESHOLD_LOCK = threading.Lock()


class CollectorThread:
    """A daemon thread that runs :func:`collect_young_generation` when offered one.

    For a scheduler-side process with no loop thread of its own (an isolated
    tier's). :meth:`offer` (the scheduler thread) returns at once and queues at
    most one request at a time; :meth:`close` stops the thread and joins it.
    ``cpus`` is where the thread runs (None: wherever its creator may run).
    :class:`~tiering.isolation.IsolatedTierManager` passes None, so the thread
    shares the scheduler's CPUs and collects while the scheduler waits for the
    GPU: on the tier's CPUs, the tier's busy process preempted it mid-collection,
    GIL held (``docs/runtime.md``, "Garbage collections"). If this process may
    not run on ``cpus``, it logs a warning and runs where it was started.
    """

    def __init__(self, name: str, cpus: frozenset[int] | None = None) -> None:
        self._requests: queue.SimpleQueue[bool] = queue.SimpleQueue()  # True: collect
        self._cpus = cpus
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    @property
    def thread(self) -> threading.Thread:
        return self._thread

    def offer(self) -> None:
        """Ask for a collection (if one is due when the thread gets to it)."""
        if self._requests.empty():  # one queued is enough: it re-checks when it runs
            self._requests.put(True)

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the thread and join it (within ``timeout_s``; a collection in progress ends
        first). Idempotent."""
        if self._thread.is_alive():
            self._requests.put(False)
            self._thread.join(timeout_s)

    def _serve(self) -> None:
        try:
            pin_current_thread(self._cpus)
        except ConfigError as exc:  # only slower elsewhere: collections still run
            logger.warning("%s runs unpinned: %s", self._thread.name, exc)
        while self._requests.get():
            collect_young_generation()
