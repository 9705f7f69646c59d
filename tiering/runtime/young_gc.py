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
itself: it allocates up to the threshold, so CPython's own automatic
collection runs, on that thread, choosing the generation as it always
would (the oldest generation's rule reads a ratio Python cannot see). An
embedder who disabled the collector (``gc.disable()``) or set threshold 0 gets
nothing of this.
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

    Allocates empty lists until the count drops (a few hundred at the default
    threshold of 700; they are freed at once): the allocation that crosses the
    threshold runs the collection here, exactly as one made by the scheduler
    would have there. Gives up after twice the threshold, should something
    else switch collection off meanwhile.
    """
    if not young_collection_due():
        return
    threshold = gc.get_threshold()[0]
    ballast: list[list[list[None]]] = []
    count = gc.get_count()[0]
    # Counting allocations would not do: lists that come from CPython's free list
    # never touch the count, so the number short of the threshold is a lower bound.
    # In chunks, the count read once per chunk: 58 instead of 108 us per hand-off here
    # (at most a chunk's worth of lists is allocated past the collection).
    for _ in range(2 * threshold // _BALLAST_CHUNK + 1):
        ballast.append([[] for _ in range(_BALLAST_CHUNK)])
        now = gc.get_count()[0]
        if now < count:
            return
        count = now


#: Empty lists allocated between two reads of the count by :func:`collect_young_generation`.
_BALLAST_CHUNK = 32


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
