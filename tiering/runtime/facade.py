"""``AsyncTierManager``: the seed's synchronous ``SecondaryTierManager`` over any ``AsyncTier``.

The scheduler thread calls this facade; the tier runs as coroutines on a
dedicated event-loop thread owned by the facade. What crosses threads:

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

import enum
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from types import TracebackType
from typing import NamedTuple

from tiering.errors import ConfigError, ContractError, TierClosedError
from tiering.jobs import JobMetadata, JobResult, SecondaryTierManager
from tiering.keys import OffloadKey, ReqContext
from tiering.runtime.affinity import check_cpus, pin_current_thread
from tiering.runtime.gil_handoff import DEFAULT_MAX_GIL_HOLD_S, hold_seconds
from tiering.runtime.loop_thread import LoopThread
from tiering.runtime.mailbox import Mailbox
from tiering.runtime.service import TierService, _Job
from tiering.runtime.stats import TierCounters, TierStats
from tiering.runtime.young_gc import collect_young_generation, young_collection_due
from tiering.tier import AsyncTier, TierContext

logger = logging.getLogger("tiering.runtime")

_NOTHING: tuple[JobResult, ...] = ()
#: ``max_gil_hold_ms``'s default.
DEFAULT_MAX_GIL_HOLD_MS = DEFAULT_MAX_GIL_HOLD_S * 1e3


class Presence(enum.Enum):
    """What :meth:`AsyncTierManager.lookup_state` knows about a key."""

    ABSENT = "absent"
    PRESENT = "present"
    STORING = "storing"
    CHECKING = "checking"


class _Outstanding(NamedTuple):
    is_load: bool
    keys: tuple[OffloadKey, ...]


class AsyncTierManager(SecondaryTierManager):
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

    #: How a due garbage collection leaves the scheduler thread (None: it does not).
    _offer_collection: Callable[[], None] | None

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
        context = TierContext(self.block_bytes, layout_fingerprint, self.name)
        try:
            if self.cpus is not None:  # before the tier opens: the threads it starts inherit it
                self._thread.call(_pin_loop_thread, self.cpus, timeout=float(open_timeout_s))
            self._thread.call(self._service.open, context, timeout=float(open_timeout_s))
        except BaseException:
            self._closed = True
            try:
                self._thread.call(
                    self._service.close_tier_only,
                    self.shutdown_timeout_s,
                    timeout=self.shutdown_timeout_s + 1.0,
                )
            except BaseException:
                logger.exception("tier %s: closing after a failed open failed", self.name)
            finally:
                self._thread.close(self.shutdown_timeout_s)
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

    def _init_scheduler_side(
        self,
        primary_kv_view: memoryview,
        block_bytes: int | None,
        job_timeout_s: float,
        shutdown_timeout_s: float,
        failed_load_backoff_s: float,
    ) -> None:
        """The primary view's geometry and the state the scheduler thread owns."""
        self.job_timeout_s = float(job_timeout_s)
        self.shutdown_timeout_s = float(shutdown_timeout_s)
        self._flat, self._num_rows, self.block_bytes = _geometry(primary_kv_view, block_bytes)
        self._closed = False
        self._shutdown_lock = threading.Lock()
        self._outstanding: dict[int, _Outstanding] = {}
        self._storing: dict[OffloadKey, int] = {}
        self._ready: deque[JobResult] = deque()
        self._requested: dict[OffloadKey, float] = {}
        self._failed_load_backoff_s = float(failed_load_backoff_s)
        self._failed_loads: dict[OffloadKey, float] = {}  # key -> when its load failed
        self._store_jobs = 0
        self._load_jobs = 0
        self._offer_collection = None

    def _bind_published(
        self,
        present: Collection[OffloadKey],
        unsettled: Collection[OffloadKey],
        absent_at: dict[OffloadKey, float],
        *,
        shared: bool,
        shared_absent_ttl_s: float,
        shared_present_ttl_s: float,
    ) -> None:
        """Bind the views ``lookup`` reads, once, so a lookup is a couple of set probes."""
        self._present = present
        self._unsettled = unsettled
        self._absent_at = absent_at
        self._shared = shared
        self._absent_ttl_s = float(shared_absent_ttl_s)
        # A repeated lookup of a key being checked posts no new request within this window.
        self._recheck_after_s = min(self.job_timeout_s, float(shared_present_ttl_s))

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
            self._thread.call(self._service.aclose, budget_s * 0.8, timeout=budget_s)
        except BaseException:
            logger.exception("tier %s: shutting down the tier failed", self.name)
        finally:
            self._thread.close(max(1.0, budget_s * 0.2))

    # -- the scheduler-facing contract -------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if ``key`` is in the tier, False if not, None if in flight or being checked.

        Never waits for the loop. For a shared tier an unknown key answers
        None and is checked in the background (batched with other keys); the
        answer is cached (an absent answer for ``shared_absent_ttl_s``, a
        present one for ``shared_present_ttl_s``).
        """
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        if self._failed_loads and self._load_failed_recently(key):
            return False
        if key in self._present:
            return True
        if key in self._storing or key in self._unsettled:
            return None
        if not self._shared:
            return False
        return self._lookup_shared(key)

    def holds(self, key: OffloadKey) -> bool:
        """True if the tier holds ``key`` or a store of it is in flight (no side effects).

        Unlike :meth:`lookup` it never starts a check of a shared tier: a key
        another process stored answers False until a lookup has found it.
        """
        return key in self._present or key in self._storing

    def lookup_state(self, key: OffloadKey) -> Presence:
        """Like :meth:`lookup`, telling apart the two reasons for None.

        ``STORING``: a store of the key is in flight (a hit once it succeeds;
        vLLM 0.33's ``HIT_PENDING``). ``CHECKING``: whether the tier holds it is
        being found out (ask again; ``RETRY``).
        """
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        if self._failed_loads and self._load_failed_recently(key):
            return Presence.ABSENT
        if key in self._present:
            return Presence.PRESENT
        if key in self._storing:
            return Presence.STORING
        if key in self._unsettled:
            return Presence.CHECKING
        if not self._shared:
            return Presence.ABSENT
        return Presence.ABSENT if self._lookup_shared(key) is False else Presence.CHECKING

    def _load_failed_recently(self, key: OffloadKey) -> bool:
        failed_at = self._failed_loads.get(key)
        if failed_at is None:
            return False
        if time.monotonic() - failed_at < self._failed_load_backoff_s:
            return True
        del self._failed_loads[key]
        return False

    def _lookup_shared(self, key: OffloadKey) -> bool | None:
        now = time.monotonic()
        absent_at = self._absent_at.get(key)
        if absent_at is not None and now - absent_at < self._absent_ttl_s:
            self._requested.pop(key, None)
            return False
        asked = self._requested.get(key)
        if asked is not None and now - asked < self._recheck_after_s:
            return None  # already being checked
        if len(self._requested) >= 65536:
            self._forget_old_requests(now)
        self._requested[key] = now
        self._post_resolve(key)
        return None

    def _forget_old_requests(self, now: float) -> None:
        horizon = now - self.job_timeout_s
        self._requested = {k: t for k, t in self._requested.items() if t >= horizon}

    def submit_store(self, job_metadata: JobMetadata) -> None:
        """Copy the job's primary rows into the tier, skipping keys already present.

        Returns at once; the result comes from :meth:`get_finished`. Raises
        :class:`~tiering.errors.ContractError` (nothing enqueued) for a job id
        in flight or with an undelivered result, mismatched lengths, a block
        id outside the primary view or a key listed twice.
        """
        job = self._accept(job_metadata, is_load=False)
        if self._failed_loads:  # a fresh copy of the block: its old failure is moot
            for key in job.meta.keys:
                self._failed_loads.pop(key, None)
        storing = self._storing
        for key in job.meta.keys:
            storing[key] = storing.get(key, 0) + 1
        self._store_jobs += 1
        self._post_job(job)

    def submit_load(self, job_metadata: JobMetadata) -> None:
        """Copy the keys' blocks into the job's primary rows; any failed key fails the job.

        Returns at once; bad input raises like :meth:`submit_store`.
        """
        job = self._accept(job_metadata, is_load=True)
        self._load_jobs += 1
        self._post_job(job)

    def _accept(self, meta: JobMetadata, *, is_load: bool) -> _Job:
        """Validate a submitted job and register it as outstanding (raises, changing nothing)."""
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        job_id = meta.job_id
        if job_id in self._outstanding:
            raise ContractError(
                f"tier {self.name}: job {job_id} was already submitted and its result "
                "has not been returned by get_finished() yet"
            )
        keys = meta.keys
        block_ids = meta.block_ids
        tolist = getattr(block_ids, "tolist", None)
        rows: list[int] = tolist() if tolist is not None else [int(b) for b in block_ids]
        if len(rows) != len(keys):
            raise ContractError(
                f"tier {self.name}: job {job_id} has {len(keys)} keys but {len(rows)} block_ids"
            )
        if rows:
            if max(rows) >= self._num_rows or min(rows) < 0:
                bad = next(r for r in rows if not 0 <= r < self._num_rows)
                raise ContractError(
                    f"tier {self.name}: job {job_id} names block id {bad}, outside the primary "
                    f"view's {self._num_rows} rows"
                )
            if len(keys) > 1 and len(set(keys)) != len(keys):
                raise ContractError(f"tier {self.name}: job {job_id} lists a key twice")
        self._outstanding[job_id] = _Outstanding(is_load, keys)
        return _Job(meta, rows, is_load, time.monotonic() + self.job_timeout_s)

    def get_finished(self) -> Iterable[JobResult]:
        """Results of the jobs finished since the last call; never blocks."""
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        if self._offer_collection is not None and young_collection_due():
            self._offer_collection()
        taken = self._take_results()
        if self._ready:
            finished = [*self._ready, *taken]
            self._ready.clear()
        elif taken:
            finished = list(taken)
        else:
            return _NOTHING
        for result in finished:
            self._deliver(result)
        return finished

    def _deliver(self, result: JobResult) -> None:
        outstanding = self._outstanding.pop(result.job_id, None)
        if outstanding is None:
            return
        if outstanding.is_load:
            if not result.success and self._failed_load_backoff_s > 0:
                self._note_failed_load(outstanding.keys, result.successful_keys)
            return
        storing = self._storing
        for key in outstanding.keys:
            count = storing.get(key, 0) - 1
            if count > 0:
                storing[key] = count
            else:
                storing.pop(key, None)

    def _note_failed_load(
        self, keys: tuple[OffloadKey, ...], loaded: frozenset[OffloadKey] | None
    ) -> None:
        now = time.monotonic()
        failed = self._failed_loads
        if len(failed) >= 65536:  # bounded: forget expired entries first
            horizon = now - self._failed_load_backoff_s
            self._failed_loads = failed = {k: t for k, t in failed.items() if t >= horizon}
        for key in keys:
            if loaded is None or key not in loaded:
                failed[key] = now

    def drain(self, timeout_s: float | None = None) -> None:
        """Block until every submitted job has a result ready for :meth:`get_finished`.

        Raises ``TimeoutError`` naming how many jobs are still running when
        ``timeout_s`` passes (None: wait; every job has a deadline anyway).
        """
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while len(self._ready) < len(self._outstanding):
            remaining = None if deadline is None else deadline - time.monotonic()
            if remaining is not None and remaining <= 0:
                raise TimeoutError(self._drain_timeout_message(timeout_s))
            result = self._wait_result(remaining)
            if result is None:
                raise TimeoutError(self._drain_timeout_message(timeout_s))
            self._ready.append(result)

    def _drain_timeout_message(self, timeout_s: float | None) -> str:
        running = len(self._outstanding) - len(self._ready)
        return f"tier {self.name}: {running} job(s) still running after {timeout_s} s"

    @property
    def failed_load_backoff_s(self) -> float:
        """How long a key whose load failed answers "miss" (0: never)."""
        return self._failed_load_backoff_s

    def has_pending_work(self) -> bool:
        """Whether any submitted job's result has not been returned by ``get_finished`` yet."""
        return bool(self._outstanding)

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Forward a use of these blocks to the tier's eviction policy (in the background)."""
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        if keys and self._touch_supported:
            self._post_touch(tuple(keys))

    def get_num_blocks(self) -> int:
        """Blocks known to be in the tier (see :attr:`TierStats.blocks_held`)."""
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        return len(self._present)

    def take_events(self) -> Iterable[tuple[list[OffloadKey], bool]]:
        """``(keys, removed)`` pairs since the last call: stores, evictions, blocks found gone."""
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        events = self._events
        if not events:
            return ()
        return [events.popleft() for _ in range(len(events))]

    def stats(self) -> TierStats:
        """An immutable snapshot of this tier's counters (also after shutdown)."""
        counters = self._counters()
        capacity = self._capacity_blocks()
        submitted = self._store_jobs + self._load_jobs
        finished = counters.jobs_succeeded + counters.jobs_failed
        return TierStats(
            name=self.name,
            tier_type=self.tier_type,
            blocks_held=len(self._present),
            capacity_blocks=capacity if isinstance(capacity, int) else None,
            jobs_submitted=submitted,
            store_jobs_submitted=self._store_jobs,
            load_jobs_submitted=self._load_jobs,
            jobs_succeeded=counters.jobs_succeeded,
            jobs_failed=counters.jobs_failed,
            jobs_in_flight=max(0, submitted - finished),
            blocks_stored=counters.blocks_stored,
            blocks_loaded=counters.blocks_loaded,
            bytes_stored=counters.bytes_stored,
            bytes_loaded=counters.bytes_loaded,
            store_seconds=counters.store_seconds,
            load_seconds=counters.load_seconds,
            timeouts=counters.timeouts,
            corrupt_reads=counters.corrupt_reads,
            missing_reads=counters.missing_reads,
            abandoned_jobs=counters.abandoned_jobs,
            blocks_removed=counters.blocks_removed,
            events_dropped=counters.events_dropped,
            closed=self._closed,
            store_seconds_counts=tuple(counters.store_seconds_counts),
            load_seconds_counts=tuple(counters.load_seconds_counts),
        )

    def shutdown(self) -> None:
        """Stop accepting jobs, drain or cancel in-flight work, close the tier, join the thread.

        Bounded by ``shutdown_timeout_s``. Idempotent; every other method
        except :meth:`stats` raises :class:`~tiering.errors.TierClosedError`
        afterwards. Results not collected before are discarded.
        """
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._close_backend(self.shutdown_timeout_s)
        finally:
            self._flat.release()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> AsyncTierManager:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self._outstanding)} jobs outstanding"
        return f"<{type(self).__name__} {self.name!r} ({self._tier_class_name()}) {state}>"


def check_runtime_options(
    *,
    job_timeout_s: object = 30.0,
    open_timeout_s: object = 30.0,
    shutdown_timeout_s: object = 10.0,
    cancel_grace_s: object = 1.0,
    shared_absent_ttl_s: object = 5.0,
    shared_present_ttl_s: object = 60.0,
    shared_max_known_keys: object = 1_000_000,
    max_events: object = 100_000,
    verify: object = None,
    failed_load_backoff_s: object = 0.0,
    cpus: object = None,
    max_gil_hold_ms: object = DEFAULT_MAX_GIL_HOLD_MS,
    gc_handoff: object = True,
) -> None:
    """Check the runtime's options (a tier entry's framework keys) without building anything.

    Raises :class:`~tiering.errors.ConfigError` naming the first bad one.
    """
    for option, value in (
        ("job_timeout_s", job_timeout_s),
        ("open_timeout_s", open_timeout_s),
        ("shutdown_timeout_s", shutdown_timeout_s),
        ("cancel_grace_s", cancel_grace_s),
        ("shared_absent_ttl_s", shared_absent_ttl_s),
        ("shared_present_ttl_s", shared_present_ttl_s),
    ):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
            raise ConfigError(f"{option} must be a positive number of seconds, got {value!r}")
    if (
        not isinstance(failed_load_backoff_s, (int, float))
        or isinstance(failed_load_backoff_s, bool)
        or not failed_load_backoff_s >= 0
    ):
        raise ConfigError(
            f"failed_load_backoff_s must be a number of seconds >= 0, got {failed_load_backoff_s!r}"
        )
    if verify is not None and not isinstance(verify, bool):
        raise ConfigError(f"verify must be true, false or null, got {verify!r}")
    if not isinstance(gc_handoff, bool):
        raise ConfigError(f"gc_handoff must be true or false, got {gc_handoff!r}")
    if (
        not isinstance(shared_max_known_keys, int)
        or isinstance(shared_max_known_keys, bool)
        or shared_max_known_keys < 1
    ):
        raise ConfigError(
            f"shared_max_known_keys must be a positive int, got {shared_max_known_keys!r}"
        )
    if not isinstance(max_events, int) or isinstance(max_events, bool) or max_events < 0:
        raise ConfigError(f"max_events must be a non-negative int, got {max_events!r}")
    if max_gil_hold_ms is not None and (
        not isinstance(max_gil_hold_ms, (int, float))
        or isinstance(max_gil_hold_ms, bool)
        or not 0 < max_gil_hold_ms < float("inf")
    ):
        raise ConfigError(
            "max_gil_hold_ms must be a positive number of milliseconds or null (off), "
            f"got {max_gil_hold_ms!r}"
        )
    check_cpus(cpus)


def _collect_young_generation(_: None) -> None:
    collect_young_generation()  # runs on the loop thread (a mailbox item)


async def _pin_loop_thread(cpus: frozenset[int]) -> None:
    pin_current_thread(cpus)  # runs on the loop thread


def _geometry(view: memoryview, block_bytes: int | None) -> tuple[memoryview, int, int]:
    """The primary view as flat writable bytes, its number of rows and the row size."""
    if not isinstance(view, memoryview):
        raise TypeError(f"primary_kv_view must be a memoryview, not {type(view).__name__}")
    if view.readonly:
        raise ConfigError("primary_kv_view must be writable (loads write into it)")
    if not view.c_contiguous:
        raise ConfigError("primary_kv_view must be C-contiguous")
    flat = view.cast("B") if view.ndim != 1 or view.format != "B" else view[:]
    if block_bytes is None:
        if view.ndim < 2 or view.shape is None or view.shape[0] == 0:
            flat.release()
            raise ConfigError(
                "primary_kv_view must be 2-D (num_blocks, block_bytes) or block_bytes given"
            )
        rows = view.shape[0]
        size = view.nbytes // rows
    else:
        if block_bytes <= 0 or view.nbytes % block_bytes:
            flat.release()
            raise ConfigError(
                f"block_bytes={block_bytes} does not divide the primary view's {view.nbytes} bytes"
            )
        size = block_bytes
        rows = view.nbytes // block_bytes
    if size <= 0:
        flat.release()
        raise ConfigError("primary_kv_view rows are empty")
    return flat, rows, size
