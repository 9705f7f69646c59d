"""``AsyncTierManager``: the seed's synchronous ``SecondaryTierManager`` over any ``AsyncTier``.

The scheduler thread calls this facade; the tier runs as coroutines on a
dedicated event-loop thread owned by the facade. This module is that
transport; the contract itself (job checks, the lookup view, results,
``drain``, ``stats``) is :class:`~tiering.runtime.scheduler_side.SchedulerSide`,
shared with the isolated transport. What crosses threads:

* scheduler -> loop: immutable job descriptions, through a :class:`Mailbox`
  (a deque plus coalesced ``call_soon_threadsafe`` wake-ups);
* loop -> scheduler: ``JobResult`` objects through a ``queue.SimpleQueue``,
  events through a deque, and a presence view (sets the loop thread writes
  and ``lookup`` reads) so that ``lookup`` never makes a round trip.

Scheduler-side state (outstanding jobs, keys with a store in flight) is owned
by the thread that calls the facade; calls must not overlap (the seed's
contract: every method runs on the scheduler thread). See ``docs/runtime.md``.
"""

from __future__ import annotations

import logging
import queue
import time
from collections.abc import Awaitable, Callable, Collection, Sequence

from tiering.core.jobs import JobResult
from tiering.core.keys import OffloadKey
from tiering.runtime.affinity import check_cpus, pin_current_thread
from tiering.runtime.gil_handoff import hold_seconds
from tiering.runtime.loop_thread import LoopThread
from tiering.runtime.mailbox import Mailbox
from tiering.runtime.options import DEFAULT_MAX_GIL_HOLD_MS, check_runtime_options
from tiering.runtime.presence import Presence
from tiering.runtime.scheduler_side import _NOTHING, SchedulerSide
from tiering.runtime.service import TierService, _Job
from tiering.runtime.stats import TierCounters
from tiering.runtime.young_gc import collect_young_generation
from tiering.tier import AsyncTier, TierContext

logger = logging.getLogger("tiering.runtime")

__all__ = ["DEFAULT_MAX_GIL_HOLD_MS", "AsyncTierManager", "Presence", "check_runtime_options"]


class AsyncTierManager(SchedulerSide):
    """Runs ``tier`` on its own event-loop thread behind the seed's scheduler-facing contract.

    Construction starts the thread, opens the tier (``TierContext`` with the
    primary view's row size as ``block_bytes``) within ``open_timeout_s`` and
    seeds the presence view from ``tier.list_keys()``; a failure closes
    everything and re-raises the tier's exception.

    ``primary_kv_view`` is the primary tier's buffer: 2-D ``(num_blocks,
    block_bytes)`` (any format, C-contiguous), or 1-D bytes with
    ``block_bytes`` given. ``job_timeout_s`` is every job's deadline from its
    submission; ``shutdown_timeout_s`` bounds :meth:`shutdown`;
    ``cancel_grace_s`` is how long a job's tier operation may ignore
    cancellation before it is logged and counted as abandoned (the job is
    reported failed only once the operation ends: its rows are in use);
    ``shared_absent_ttl_s`` is how long a shared tier's "absent" answer is
    trusted, ``shared_present_ttl_s`` how long its "present" answer is (then
    the tier is asked again) and ``shared_max_known_keys`` how many "present"
    answers are kept (the oldest are forgotten first); ``max_events`` bounds
    events waiting for :meth:`take_events` (more are counted in
    ``stats().events_dropped``). ``verify`` (default:
    unless the tier sets ``verifies_reads``) keeps an xxh3 checksum of every
    block stored and fails a load whose bytes differ: a silently corrupted
    read is a miss, never a wrong hit. ``failed_load_backoff_s`` (default 0:
    off): after a load of a key fails, :meth:`lookup` answers False for it
    this long (until a store of it is submitted), so an engine whose manager
    promotes every hit again at once - vLLM 0.33's - recomputes the block
    instead of retrying a doomed load every step. ``cpus`` (default: not
    pinned) restricts the loop thread, and every thread the tier starts from
    it, to those CPUs (ids, or a list string like ``"2-5"``), set before the
    tier opens; keep them apart from the scheduler thread's.
    ``max_gil_hold_ms`` (default 1; ``None``: off) bounds how long the loop
    thread runs callbacks back to back before it releases the GIL for a
    moment, so that a thread waiting for it (the scheduler, back from a GPU
    step) gets it within about that long instead of waiting while the loop
    stays busy (:mod:`tiering.runtime.gil_handoff`). ``gc_handoff``
    (default True): when :meth:`get_finished` finds Python's youngest
    generation well on its way to a collection, the loop thread runs it, while
    the scheduler waits for the GPU, rather than the scheduler's next step
    (:mod:`tiering.runtime.young_gc`).

    Use it as a context manager, or call :meth:`shutdown`.
    """

    def __init__(
        self,
        tier: AsyncTier,
        primary_kv_view: memoryview,
        tier_type: str,
        *,
        name: str | None = None,
        layout_fingerprint: str = "",
        job_timeout_s: float = 30.0,
        open_timeout_s: float = 30.0,
        shutdown_timeout_s: float = 10.0,
        block_bytes: int | None = None,
        cancel_grace_s: float = 1.0,
        shared_absent_ttl_s: float = 5.0,
        shared_present_ttl_s: float = 60.0,
        shared_max_known_keys: int = 1_000_000,
        max_events: int = 100_000,
        verify: bool | None = None,
        failed_load_backoff_s: float = 0.0,
        cpus: Collection[int] | str | None = None,
        max_gil_hold_ms: float | None = DEFAULT_MAX_GIL_HOLD_MS,
        gc_handoff: bool = True,
    ) -> None:
        super().__init__(primary_kv_view, tier_type)
        if not isinstance(tier, AsyncTier):
            raise TypeError(f"tier must be an AsyncTier, not {type(tier).__name__}")
        check_runtime_options(
            job_timeout_s=job_timeout_s,
            open_timeout_s=open_timeout_s,
            shutdown_timeout_s=shutdown_timeout_s,
            cancel_grace_s=cancel_grace_s,
            shared_absent_ttl_s=shared_absent_ttl_s,
            shared_present_ttl_s=shared_present_ttl_s,
            shared_max_known_keys=shared_max_known_keys,
            max_events=max_events,
            verify=verify,
            failed_load_backoff_s=failed_load_backoff_s,
            max_gil_hold_ms=max_gil_hold_ms,
            gc_handoff=gc_handoff,
        )
        self.cpus = check_cpus(cpus)
        self.name = name or tier_type
        self.tier = tier
        self._init_scheduler_side(
            primary_kv_view, block_bytes, job_timeout_s, shutdown_timeout_s, failed_load_backoff_s
        )
        if gc_handoff:
            self._offer_collection = self._post_collection
        self._thread = LoopThread(f"tier-{self.name}", hold_seconds(max_gil_hold_ms))
        try:  # the thread runs from here: anything that fails must join it
            self._service = TierService(
                tier,
                name=self.name,
                flat_view=self._flat,
                block_bytes=self.block_bytes,
                job_timeout_s=self.job_timeout_s,
                cancel_grace_s=float(cancel_grace_s),
                shared_absent_ttl_s=float(shared_absent_ttl_s),
                shared_present_ttl_s=float(shared_present_ttl_s),
                shared_max_known_keys=shared_max_known_keys,
                max_events=max_events,
                verify=not tier.verifies_reads if verify is None else verify,
            )
            self._mailbox = Mailbox(self._thread.loop)
        except BaseException:
            self._closed = True
            self._thread.close(self.shutdown_timeout_s)
            self._flat.release()
            raise
        context = TierContext(self.block_bytes, layout_fingerprint, self.name)
        try:
            if self.cpus is not None:  # before the tier opens: the threads it starts inherit it
                self._thread.call(_pin_loop_thread, self.cpus, timeout=float(open_timeout_s))
            deadline_s = float(open_timeout_s)
            self._thread.call(self._service.open, context, deadline_s, timeout=deadline_s)
        except BaseException:
            self._closed = True
            try:
                self._stop(self._service.close_tier_only, self.shutdown_timeout_s)
            except BaseException:
                logger.exception("tier %s: closing after a failed open failed", self.name)
            finally:
                self._mailbox.close()
                self._flat.release()
            raise
        service = self._service
        self._results = service.results
        self._events = service.events
        self._touch_supported = service.touch_supported
        self._bind_published(
            service.present,
            service.unsettled,
            service.absent_at,
            shared=service.shared,
            shared_absent_ttl_s=shared_absent_ttl_s,
            shared_present_ttl_s=shared_present_ttl_s,
        )

    # -- where jobs go and results come from (the tier's own process: its loop thread) -------

    def _post_job(self, job: _Job) -> None:
        self._mailbox.post(self._service.start_job, job)

    def _post_resolve(self, key: OffloadKey) -> None:
        self._mailbox.post(self._service.request_resolve, key)

    def _post_touch(self, keys: tuple[OffloadKey, ...]) -> None:
        self._mailbox.post(self._service.touch, keys)

    def _post_collection(self) -> None:
        self._mailbox.post(_collect_young_generation, None)

    def _take_results(self) -> Sequence[JobResult]:
        """Results published since the last call (never blocks)."""
        results = self._results
        if results.empty():
            return _NOTHING
        return [results.get_nowait() for _ in range(results.qsize())]

    def _results_waiting(self) -> bool:
        return not self._results.empty()

    def _wait_result(self, timeout_s: float | None) -> JobResult | None:
        """The next published result, or None after ``timeout_s`` (None: wait)."""
        try:
            return self._results.get(timeout=timeout_s)
        except queue.Empty:
            return None

    def _counters(self) -> TierCounters:
        return self._service.counters

    def _capacity_blocks(self) -> object:
        return getattr(self.tier, "capacity_blocks", None)

    def _tier_class_name(self) -> str:
        return type(self.tier).__name__

    def _close_backend(self, budget_s: float) -> None:
        try:
            self._stop(self._service.aclose, budget_s)
        except BaseException:
            logger.exception("tier %s: shutting down the tier failed", self.name)
        finally:
            self._mailbox.close()

    def _stop(self, close_tier: Callable[[float], Awaitable[None]], budget_s: float) -> None:
        """Close the tier on its loop, then the loop thread, within ``budget_s`` in all.

        Bounded even when the tier wedged its loop (the thread is then left as a
        daemon, with an error logged). Raises what closing the tier raised.
        """
        deadline = time.monotonic() + budget_s
        try:
            self._thread.call(close_tier, budget_s * 0.8, timeout=budget_s * 0.85)
        finally:
            self._thread.close(max(0.05, deadline - time.monotonic()))


def _collect_young_generation(_: None) -> None:
    collect_young_generation()  # runs on the loop thread (a mailbox item)


async def _pin_loop_thread(cpus: frozenset[int]) -> None:
    pin_current_thread(cpus)  # runs on the loop thread
