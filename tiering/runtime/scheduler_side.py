"""The scheduler side of a secondary tier: the seed's ``SecondaryTierManager`` contract.

:class:`SchedulerSide` owns everything the scheduler thread sees of a tier and
nothing of how the tier runs: job validation and the jobs outstanding, the
keys with a store in flight, failed-load back-off, the lookup view's bindings,
results waiting for collection, ``drain``, ``stats`` and ``shutdown``'s
ordering. Where jobs go and where results, view changes and counters come
from is a transport, supplied by each subclass through a handful of
``_post_*``/``_take_*`` methods: :class:`~tiering.runtime.AsyncTierManager`
(the tier on a loop thread of this process) and
:class:`~tiering.isolation.IsolatedTierManager` (the tier in a child process,
over shared-memory rings). Calls must not overlap: the seed's contract runs
every method on the scheduler thread.
"""

from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from types import TracebackType
from typing import NamedTuple, Self

from tiering.core.errors import ContractError, TierClosedError
from tiering.core.jobs import JobMetadata, JobResult, SecondaryTierManager
from tiering.core.keys import OffloadKey, ReqContext
from tiering.runtime.options import primary_geometry
from tiering.runtime.presence import Presence
from tiering.runtime.service_state import _Job
from tiering.runtime.stats import TierCounters, TierStats, tier_stats
from tiering.runtime.young_gc import young_collection_due

_NOTHING: tuple[JobResult, ...] = ()


class _Outstanding(NamedTuple):
    is_load: bool
    keys: tuple[OffloadKey, ...]


class SchedulerSide(SecondaryTierManager):
    """The scheduler-facing contract over a transport (see the module docs).

    Subclasses call :meth:`_init_scheduler_side` in their constructor, then
    :meth:`_bind_published` once the tier is open, and implement the
    transport methods.
    """

    #: How a due garbage collection leaves the scheduler thread (None: it does not).
    _offer_collection: Callable[[], None] | None
    name: str
    _touch_supported: bool  # whether the tier has a touch() worth forwarding
    _events: deque[tuple[list[OffloadKey], bool]]  # filled by the transport

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
        geometry = primary_geometry(primary_kv_view, block_bytes)
        self._flat, self._num_rows, self.block_bytes = geometry
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

    # -- the transport: where jobs go and results come from (each subclass's own) ------------

    @abstractmethod
    def _post_job(self, job: _Job) -> None:
        """Hand an accepted job to the tier."""

    @abstractmethod
    def _post_resolve(self, key: OffloadKey) -> None:
        """Ask a shared tier whether it holds ``key`` (the answer updates the view)."""

    @abstractmethod
    def _post_touch(self, keys: tuple[OffloadKey, ...]) -> None:
        """Forward a use of these blocks to the tier's eviction policy."""

    @abstractmethod
    def _take_results(self) -> Sequence[JobResult]:
        """Results published since the last call (never blocks)."""

    @abstractmethod
    def _results_waiting(self) -> bool:
        """Whether :meth:`_take_results` would return anything now (never blocks)."""

    @abstractmethod
    def _wait_result(self, timeout_s: float | None) -> JobResult | None:
        """The next published result, or None after ``timeout_s`` (None: wait)."""

    @abstractmethod
    def _counters(self) -> TierCounters:
        """The tier's latest counters."""

    @abstractmethod
    def _capacity_blocks(self) -> object:
        """The tier's ``capacity_blocks`` (None or anything not an int: unbounded)."""

    @abstractmethod
    def _tier_class_name(self) -> str:
        """The tier's class name, for ``repr``."""

    @abstractmethod
    def _close_backend(self, budget_s: float) -> None:
        """Close the tier and stop what runs it, within about ``budget_s``."""

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
        :class:`~tiering.core.errors.ContractError` (nothing enqueued) for a job id
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

    def has_finished(self) -> bool:
        """Whether :meth:`get_finished` would return a result now (True once shut down, so
        that call says so). Never blocks, offers no collection: for checks within a step."""
        return self._closed or bool(self._ready) or self._results_waiting()

    def get_finished(self) -> Iterable[JobResult]:
        """Results of the jobs finished since the last call; never blocks."""
        if self._closed:
            raise TierClosedError(f"tier {self.name} is shut down")
        if self._offer_collection is not None and young_collection_due():
            self._offer_collection()
        return self._collect()

    def _collect(self) -> Sequence[JobResult]:
        """The results waiting (held back, then published), each delivered once."""
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
        capacity = self._capacity_blocks()
        return tier_stats(
            self._counters(),
            name=self.name,
            tier_type=self.tier_type,
            blocks_held=len(self._present),
            capacity_blocks=capacity if isinstance(capacity, int) else None,
            store_jobs=self._store_jobs,
            load_jobs=self._load_jobs,
            closed=self._closed,
        )

    def shutdown(self) -> None:
        """Stop accepting jobs, drain or cancel in-flight work, close the tier, join the thread.

        Bounded by ``shutdown_timeout_s``. Idempotent; every other method
        except :meth:`stats` and :meth:`results_after_shutdown` raises
        :class:`~tiering.core.errors.TierClosedError` afterwards. Results not
        collected before are kept for :meth:`results_after_shutdown`.
        """
        with self._shutdown_lock:
            if self._closed:
                return
            self._closed = True
        try:
            self._close_backend(self.shutdown_timeout_s)
        finally:
            self._flat.release()

    def results_after_shutdown(self) -> list[JobResult]:
        """Results not collected before :meth:`shutdown`, with those of the jobs it drained
        or cancelled (each once; never blocks). ``ContractError`` before shutdown."""
        if not self._closed:
            raise ContractError(f"tier {self.name}: results_after_shutdown() before shutdown()")
        return list(self._collect())

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> Self:
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
