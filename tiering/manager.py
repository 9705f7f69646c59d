"""``TieringOffloadingManager``: the CPU primary tier plus any number of secondary tiers,
behind the scheduler-facing :class:`~tiering.contract.OffloadingManager` contract.

Everything here runs on the scheduler thread and never blocks (except
``shutdown``, which waits a bounded time). Secondary tiers are
:class:`~tiering.jobs.SecondaryTierManager` objects (normally the async facade,
whose work runs on its own event-loop thread); the manager talks to them only
through jobs (``submit_store`` / ``submit_load``) and their results
(``get_finished``).

Data paths::

    GPU --store--> primary --cascade (one job per tier)--> secondary tiers
    GPU <--load--- primary <--promotion (one job per batch)-- a secondary tier

Rules the manager keeps:

* A cascade job reads primary rows: the rows are pinned (``prepare_load`` on
  the primary tier) per tier job until that job's result arrives, so eviction
  never frees bytes under an in-flight copy.
* A promotion reserves a primary row (``prepare_store``; it may evict an
  unpinned block), which stays pinned and unreadable until the job's result:
  success commits it (``complete_store(success=True)``), failure frees it and
  the key is answered as a miss for ``failed_promotion_backoff_s`` seconds so
  the same doomed load is not re-issued every step.
* Results are polled from every tier by :meth:`step` (once per scheduler
  step), before any eviction decision, and whenever a lookup asks about a key
  that is on its way.
* A failed or unverifiable load is a miss, never a wrong hit: a promoted
  block becomes readable only after its tier reported success for it.
"""

from __future__ import annotations

import dataclasses
import enum
import itertools
import logging
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from tiering.contract import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiering.errors import ContractError, TierClosedError
from tiering.jobs import JobId, JobMetadata, JobResult, SecondaryTierManager
from tiering.keys import NO_CONTEXT, OffloadKey, ReqContext
from tiering.metrics import MetricsExport
from tiering.policies.admission import AdmissionPolicy
from tiering.specs import BlockIds, BlockIDsLoadStoreSpec, LoadStoreSpec
from tiering.stats import ManagerStats, TierCounters, TierStats

logger = logging.getLogger(__name__)

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0
DEFAULT_FAILED_PROMOTION_BACKOFF_S = 10.0
DEFAULT_MAX_PROMOTION_BATCH = 256
#: Most keys remembered as "promotion failed recently"; the oldest are forgotten first.
MAX_BACKOFF_KEYS = 1 << 16
#: Seconds between two snapshots published to Prometheus by ``step``.
METRICS_PUBLISH_INTERVAL_S = 1.0
#: Seconds between two log lines about failed jobs of one tier.
FAILURE_LOG_INTERVAL_S = 10.0


class PrimaryTier(Protocol):
    """What the manager needs from the CPU primary tier (``tiering.primary.CPUPrimaryTier``).

    Besides the :class:`OffloadingManager` contract: per-key state queries and
    pool gauges, all O(1) and non-blocking.
    """

    @property
    def kv_view(self) -> memoryview: ...
    @property
    def num_blocks(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def medium(self) -> str: ...

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None: ...
    def prepare_load(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> LoadStoreSpec: ...
    def complete_load(self, keys: Sequence[OffloadKey]) -> None: ...
    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None: ...
    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None: ...
    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None: ...
    def take_events(self) -> Iterable[OffloadingEvent]: ...
    def shutdown(self) -> None: ...
    def is_ready(self, key: OffloadKey) -> bool: ...
    def is_stored_or_in_flight(self, key: OffloadKey) -> bool: ...
    def num_free(self) -> int: ...
    def num_ready(self) -> int: ...
    def num_pinned(self) -> int: ...
    def num_storing(self) -> int: ...


class _Kind(enum.Enum):
    CASCADE = "cascade"
    PROMOTION = "promotion"


@dataclass(slots=True)
class _Job:
    """A job submitted to a secondary tier and not yet answered."""

    kind: _Kind
    tier: int
    keys: tuple[OffloadKey, ...]
    req_context: ReqContext
    submitted_at: float


@dataclass(slots=True)
class _StagedBatch:
    """Promotions promised a primary row, not yet reserved nor submitted (one job per batch)."""

    req_context: ReqContext
    keys: list[OffloadKey]


class _FailureLog:
    """One log line per tier per interval about failed jobs, so a dead tier cannot flood logs."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next_at: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def failed(self, tier: str, what: str, error: str | None, *, routine: bool = False) -> None:
        """Log a failed job; ``routine`` ones (blocks gone from a tier) at INFO."""
        if routine:
            logger.info("tier %s: %s failed: %s", tier, what, error or "no reason given")
            return
        now = time.monotonic()
        if now < self._next_at.get(tier, 0.0):
            self._suppressed[tier] += 1
            return
        more = self._suppressed.pop(tier, 0)
        logger.warning(
            "tier %s: %s failed: %s%s",
            tier,
            what,
            error or "no reason given",
            f" (and {more} more failures since the last report)" if more else "",
        )
        self._next_at[tier] = now + self._interval_s


def _block_ids_of(spec: LoadStoreSpec) -> BlockIds:
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"the primary tier returned {type(spec).__name__}, not block ids")
    return spec.block_ids


class TieringOffloadingManager(OffloadingManager):
    """Composes the CPU primary tier with an ordered list of secondary tiers.

    ``primary`` owns the host buffer the engine's workers copy GPU blocks to
    and from; ``secondary_tiers`` are asked in order on a primary miss, and
    every block stored into the primary tier is cascaded to all of them.
    The manager takes ownership of all tiers: :meth:`shutdown` shuts them down.

    Options: ``enable_events`` (collect stored/removed events for
    :meth:`take_events`); ``shutdown_timeout_s`` (how long :meth:`shutdown`
    waits for in-flight jobs before giving up on them);
    ``failed_promotion_backoff_s`` (how long a key whose promotion failed is
    answered as a miss); ``backfill_earlier_tiers`` (a block promoted from
    tier *i* is also stored into tiers before *i*, which missed it);
    ``event_block_size`` (the ``block_size`` every event reports, e.g. tokens
    per block; default: the primary tier's own label, its block bytes);
    ``max_promotion_batch`` (most blocks per promotion job); ``name`` (the
    ``manager`` label of its metrics);
    ``metrics_registry`` (a ``prometheus_client`` registry, None for the
    default one, False for none); ``clock`` (seconds, for back-off and ages);
    ``cascade_admission`` (a :class:`~tiering.policies.admission.AdmissionPolicy`
    choosing which stored blocks are cascaded, and which blocks a request uses
    are cascaded late; None cascades every stored block).

    Not thread-safe: call every method from the scheduler thread.
    """

    def __init__(
        self,
        primary: PrimaryTier,
        secondary_tiers: Sequence[SecondaryTierManager] = (),
        *,
        enable_events: bool = True,
        shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
        failed_promotion_backoff_s: float = DEFAULT_FAILED_PROMOTION_BACKOFF_S,
        backfill_earlier_tiers: bool = True,
        event_block_size: int | None = None,
        max_promotion_batch: int = DEFAULT_MAX_PROMOTION_BATCH,
        name: str = "tiering",
        metrics_registry: Any = None,
        clock: Callable[[], float] = time.monotonic,
        cascade_admission: AdmissionPolicy[OffloadKey] | None = None,
    ) -> None:
        tiers = tuple(secondary_tiers)
        for position, tier in enumerate(tiers):
            if not isinstance(tier, SecondaryTierManager):
                raise TypeError(
                    f"secondary_tiers[{position}] must be a SecondaryTierManager, "
                    f"got {type(tier).__name__}"
                )
        if len({id(t) for t in tiers}) != len(tiers):
            raise ValueError("the same secondary tier object appears twice in secondary_tiers")
        if not shutdown_timeout_s > 0:
            raise ValueError(f"shutdown_timeout_s must be positive, got {shutdown_timeout_s!r}")
        if not failed_promotion_backoff_s >= 0:
            raise ValueError(
                f"failed_promotion_backoff_s must be >= 0, got {failed_promotion_backoff_s!r}"
            )
        if max_promotion_batch < 1:
            raise ValueError(f"max_promotion_batch must be >= 1, got {max_promotion_batch!r}")

        self._primary = primary
        self._tiers = tiers
        self._admission = cascade_admission
        self._enable_events = enable_events
        self._shutdown_timeout_s = float(shutdown_timeout_s)
        self._backoff_s = float(failed_promotion_backoff_s)
        self._backfill = backfill_earlier_tiers
        # The primary tier labels its events with its block bytes; secondary events follow
        # that convention unless the caller names a block size for every event.
        self._event_block_size = (
            primary.block_bytes if event_block_size is None else event_block_size
        )
        self._relabel_primary_events = event_block_size is not None
        self._max_batch = max_promotion_batch
        self._clock = clock
        self._block_bytes = primary.block_bytes

        self._primary_counters = TierCounters("cpu", primary.medium)
        self._tier_counters = [
            TierCounters(name, tier.tier_type)
            for name, tier in zip(_tier_names(tiers), tiers, strict=True)
        ]
        self._job_ids = itertools.count(1)
        self._jobs: dict[JobId, _Job] = {}  # submission order: the first is the oldest
        self._promoting: dict[OffloadKey, int] = {}  # key -> source tier (staged or submitted)
        self._staged: list[list[_StagedBatch]] = [[] for _ in tiers]
        self._num_staged = 0
        self._user_load_pins: dict[OffloadKey, int] = {}  # pins taken by the engine
        # Keys answered True since the step began: a promotion's eviction must not take them
        # before the engine's prepare_load. Pinned lazily, only when a promotion must evict.
        self._step_hits: set[OffloadKey] = set()
        self._unpinned_hits: list[OffloadKey] = []
        self._pinned_hits: list[OffloadKey] = []
        self._backoff: dict[OffloadKey, float] = {}  # key -> when it may be promoted again
        self._lookups = 0
        self._retries = 0
        self._no_room = 0
        self._unexpected_results = 0
        self._internal_errors = 0
        self._failure_log = _FailureLog(FAILURE_LOG_INTERVAL_S)
        self._closed = False
        self._final_stats: ManagerStats | None = None
        self._metrics = MetricsExport(name, metrics_registry)
        self._next_publish = 0.0

    # -- properties ------------------------------------------------------------------------

    @property
    def primary(self) -> PrimaryTier:
        """The CPU primary tier (read its state; drive it only through the manager)."""
        return self._primary

    @property
    def secondary_tiers(self) -> tuple[SecondaryTierManager, ...]:
        """The secondary tiers, in lookup order."""
        return self._tiers

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` has been called."""
        return self._closed

    @property
    def metrics_name(self) -> str:
        """The ``manager`` label of this manager's Prometheus series."""
        return self._metrics.name

    def jobs_in_flight(self) -> int:
        """Secondary-tier jobs submitted and not yet answered (staged promotions excluded)."""
        return len(self._jobs)

    def is_promoting(self, key: OffloadKey) -> bool:
        """Whether ``key`` is on its way from a secondary tier into the primary tier."""
        return key in self._promoting

    # -- the OffloadingManager contract ----------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if readable in the primary tier; None while being promoted; else False.

        On a primary miss the secondary tiers are asked in order; the first
        that holds the block gets a promotion job (submitted at the next
        :meth:`step` or sooner) and the answer is None until it lands. If no
        primary block can be reserved the answer is False (a miss).

        A block answered True is not evicted to make room for a promotion
        until the step ends (:meth:`step`, :meth:`prepare_store` or
        :meth:`take_events`), so the engine's ``prepare_load`` of this step's
        hits never finds them gone.
        """
        self._check_open()
        self._lookups += 1
        primary = self._primary
        if primary.is_ready(key):
            self._hit(key)
            return True
        if key in self._promoting:
            # The engine retries the lookup of a key on its way: collect results now, so a
            # landed promotion is a hit this step rather than the next.
            self._flush_staged()
            self._poll()
            if primary.is_ready(key):
                self._hit(key)
                return True
            if key in self._promoting:
                self._retries += 1
                return None
            # The promotion failed during the poll: the back-off below answers False.
        elif primary.is_stored_or_in_flight(key):
            # Being stored from the GPU right now: the primary tier's own answer.
            answer = primary.lookup(key, req_context)
            self._count_answer(key, answer)
            return answer
        if self._backoff:
            retry_at = self._backoff.get(key)
            if retry_at is not None:
                if self._clock() < retry_at:
                    self._primary_counters.misses += 1
                    return False
                del self._backoff[key]
        pending = False
        for position, tier in enumerate(self._tiers):
            try:
                answer = tier.lookup(key, req_context)
            except Exception:
                self._internal_error(f"lookup in tier {self._tier_counters[position].name}")
                continue
            if answer is True:
                self._tier_counters[position].hits += 1
                return self._start_promotion(key, position, req_context)
            if answer is None:
                pending = True
            else:
                self._tier_counters[position].misses += 1
        if pending:
            self._retries += 1
            return None
        self._primary_counters.misses += 1
        return False

    def prepare_load(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        """Pin readable primary blocks for the engine to copy to the GPU (until complete_load).

        Raises :class:`~tiering.errors.ContractError` (from the primary tier)
        if a key is not readable, changing nothing.
        """
        self._check_open()
        spec = self._primary.prepare_load(keys, req_context)
        pins = self._user_load_pins
        for key in keys:
            pins[key] = pins.get(key, 0) + 1
        return spec

    def complete_load(self, keys: Sequence[OffloadKey]) -> None:
        """Release the pins of a previous :meth:`prepare_load` of these keys.

        Raises :class:`~tiering.errors.ContractError`, changing nothing, for a
        key the engine has not pinned (the manager's own pins, which protect
        in-flight cascades, cannot be released through this call).
        """
        self._check_open()
        pins = self._user_load_pins
        wanted: dict[OffloadKey, int] = (
            dict(Counter(keys)) if len(set(keys)) != len(keys) else dict.fromkeys(keys, 1)
        )
        for key, count in wanted.items():
            if pins.get(key, 0) < count:
                raise ContractError(
                    f"complete_load of block {bytes(key).hex()} which is not pinned by a "
                    "prepare_load (or was already completed)"
                )
        self._primary.complete_load(keys)
        for key, count in wanted.items():
            left = pins[key] - count
            if left:
                pins[key] = left
            else:
                del pins[key]

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """Mark blocks recently used in the primary tier and in every secondary tier."""
        self._check_open()
        self._primary.touch(keys, req_context)
        if self._admission is not None and self._tiers:
            # Blocks that earned a place below the primary tier by this use.
            ready = self._primary.is_ready
            late = self._admission.on_use([key for key in keys if ready(key)])
            if late:
                self._cascade(tuple(late), range(len(self._tiers)), req_context)
        for position, tier in enumerate(self._tiers):
            try:
                tier.touch(keys, req_context)
            except Exception:
                self._internal_error(f"touch in tier {self._tier_counters[position].name}")

    def prepare_store(
        self, keys: Sequence[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        """Reserve primary blocks for the keys not yet offloaded, evicting unpinned blocks.

        Finished jobs are collected first when eviction may be needed, so pins
        of finished cascades do not block eviction. Keys being promoted count
        as offloaded (not in ``keys_to_store``). None, changing nothing, when
        room cannot be made.
        """
        self._check_open()
        self._flush_staged()  # while this step's hits are still protected
        self._end_of_step()
        if self._jobs and self._primary.num_free() < len(keys):
            self._poll()
        output = self._primary.prepare_store(keys, req_context)
        if output is not None and output.evicted_keys:
            self._primary_counters.evictions += len(output.evicted_keys)
        return output

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Finish a prepared store; on success cascade the blocks to every secondary tier.

        Each tier gets one job for all ``keys``; the primary rows stay pinned
        for that job until its result arrives. Raises
        :class:`~tiering.errors.ContractError`, changing nothing, for keys that
        were not prepared by :meth:`prepare_store` (e.g. keys being promoted).
        """
        self._check_open()
        keys = list(keys)
        if self._promoting:
            for key in keys:
                if key in self._promoting:
                    raise ContractError(
                        f"complete_store of block {bytes(key).hex()}, which is being promoted "
                        "from a secondary tier, not stored by prepare_store"
                    )
        self._primary.complete_store(keys, success)
        if not success:
            self._primary_counters.failures += 1
            return
        self._primary_counters.cascades += len(keys)
        if keys and self._tiers:
            admitted = keys if self._admission is None else self._admission.admit(keys)
            if admitted:
                self._cascade(tuple(admitted), range(len(self._tiers)), NO_CONTEXT)

    def take_events(self) -> Iterable[OffloadingEvent]:
        """Stored/removed events of the primary tier and of every secondary tier.

        Each event's ``medium`` names the tier holding the blocks (``"CPU"``
        for the primary tier, the tier type for a secondary tier). Collects
        finished jobs first, so promotions that landed are reported.
        """
        self._check_open()
        self._flush_staged()  # while this step's hits are still protected
        self._end_of_step()
        self._poll()
        if not self._enable_events:
            self._discard_events()
            return []
        events = list(self._primary.take_events())
        if self._relabel_primary_events:
            size = self._event_block_size
            events = [
                e if e.block_size == size else dataclasses.replace(e, block_size=size)
                for e in events
            ]
        for position, tier in enumerate(self._tiers):
            try:
                tier_events = list(tier.take_events())
            except Exception:
                self._internal_error(f"take_events of tier {self._tier_counters[position].name}")
                continue
            for keys, removed in tier_events:
                if keys:
                    events.append(
                        OffloadingEvent(
                            keys=list(keys),
                            block_size=self._event_block_size,
                            medium=tier.tier_type,
                            removed=removed,
                        )
                    )
        return events

    def shutdown(self) -> None:
        """Drain in-flight jobs (at most ``shutdown_timeout_s``), then shut every tier down.

        Staged promotions are dropped; jobs still unanswered at the deadline
        are abandoned after their tier has shut down (which cancels them and
        joins its thread), and their pins are released. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        held: _Holdings | None = None
        try:
            self._end_of_step()
            self._drop_staged()
            self._drain(time.monotonic() + self._shutdown_timeout_s)
            held = self._holdings()
        finally:
            for position, tier in enumerate(self._tiers):
                try:
                    tier.shutdown()
                except Exception:
                    self._internal_error(f"shutdown of tier {self._tier_counters[position].name}")
                self._collect_after_shutdown(position, tier)
            self._abandon_jobs()
            tiers_held = held or _Holdings.unknown(len(self._tiers))
            # The primary tier is still up: its figures after every pin was released.
            self._final_stats = self._stats_from(
                dataclasses.replace(
                    tiers_held,
                    primary_ready=self._primary.num_ready(),
                    primary_pinned=self._primary.num_pinned(),
                )
            )
            self._metrics.publish(self._final_stats)
            self._metrics.close()
            self._primary.shutdown()

    def __enter__(self) -> TieringOffloadingManager:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    # -- beyond the contract -----------------------------------------------------------------

    def step(self) -> int:
        """Advance background work; call once per scheduler step. Returns jobs finished.

        Ends the step (this step's hits become evictable again), submits
        staged promotions, collects every tier's finished jobs
        (committing promotions, releasing cascade pins), expires failed-
        promotion back-offs, and publishes metrics about once a second.
        """
        self._check_open()
        self._flush_staged()  # while this step's hits are still protected
        self._end_of_step()
        finished = self._poll()
        now = self._clock()
        self._expire_backoff(now)
        if not self._enable_events:
            self._discard_events()
        if self._metrics.enabled and now >= self._next_publish:
            self._next_publish = now + METRICS_PUBLISH_INTERVAL_S
            self._metrics.publish(self._snapshot())
        return finished

    def flush(self) -> None:
        """Submit staged promotions now instead of at the next :meth:`step`."""
        self._check_open()
        self._flush_staged()

    def stats(self) -> ManagerStats:
        """An immutable snapshot: the primary tier first, then each secondary tier.

        After :meth:`shutdown`, the snapshot taken when the tiers were drained.
        """
        if self._final_stats is not None:
            return self._final_stats
        return self._snapshot()

    def publish_metrics(self) -> None:
        """Publish a fresh snapshot to Prometheus now (``step`` does it about once a second)."""
        self._metrics.publish(self.stats())

    # -- promotion -------------------------------------------------------------------------

    def _start_promotion(
        self, key: OffloadKey, position: int, req_context: ReqContext
    ) -> bool | None:
        """Promise a primary row to ``key`` and stage its promotion (None), or miss (False).

        Rows are reserved when the batch is submitted (one ``prepare_store`` per
        batch, not per block); here the manager only checks, in O(1), that one
        more row can be had: a free one, or an evictable one (ready, unpinned
        and not a hit of this step) beyond those already promised.
        """
        primary = self._primary
        needed = self._num_staged + 1
        if primary.num_free() < needed:
            # An eviction will be needed: release finished pins first, and pin this step's
            # hits (the engine may be about to load them) so they are not counted as victims.
            if self._jobs:
                self._poll()
            if primary.num_free() < needed:
                self._protect_step_hits()
                load_pinned = primary.num_pinned() - primary.num_storing()
                evictable = primary.num_ready() - load_pinned
                if primary.num_free() + evictable < needed:
                    self._no_room += 1
                    self._primary_counters.misses += 1
                    return False
        self._promoting[key] = position
        self._stage(position, key, req_context)
        self._retries += 1
        return None

    def _stage(self, position: int, key: OffloadKey, req_context: ReqContext) -> None:
        batches = self._staged[position]
        if batches:
            last = batches[-1]
            if len(last.keys) < self._max_batch and (
                last.req_context is req_context or last.req_context == req_context
            ):
                last.keys.append(key)
                self._num_staged += 1
                return
            # A new request (or a full batch): the previous batch is complete, send it.
            batches.pop()
            self._submit_promotion(position, last)
        batches.append(_StagedBatch(req_context, [key]))
        self._num_staged += 1

    def _flush_staged(self) -> None:
        if not self._num_staged:
            return
        for position, batches in enumerate(self._staged):
            while batches:
                self._submit_promotion(position, batches.pop(0))

    def _reserve(self, keys: list[OffloadKey], req_context: ReqContext) -> dict[OffloadKey, int]:
        """Reserve primary rows for a batch: ``{key: row}`` for the keys that got one."""
        primary = self._primary
        if primary.num_free() < len(keys):
            # An eviction decision: first collect finished jobs, whose cascade pins may be
            # all that keeps rows from being evictable.
            self._poll()
            self._protect_step_hits()
        output = primary.prepare_store(keys, req_context)
        if output is not None:
            outputs = [output]
        else:
            # Room shrank since the lookups (the engine pinned blocks): as many as fit.
            outputs = []
            for key in keys:
                single = primary.prepare_store((key,), req_context)
                if single is None:
                    break
                outputs.append(single)
        rows: dict[OffloadKey, int] = {}
        for out in outputs:
            if out.evicted_keys:
                self._primary_counters.evictions += len(out.evicted_keys)
            rows.update(zip(out.keys_to_store, _block_ids_of(out.store_spec).tolist(), strict=True))
        return rows

    def _submit_promotion(self, position: int, batch: _StagedBatch) -> None:
        self._num_staged -= len(batch.keys)
        try:
            rows = self._reserve(batch.keys, batch.req_context)
        except Exception:
            self._internal_error("reserving primary blocks for a promotion")
            rows = {}
        if len(rows) < len(batch.keys):
            for key in batch.keys:
                if key not in rows:
                    del self._promoting[key]
                    self._no_room += 1
            if not rows:
                return
        keys = tuple(rows)
        job_id = next(self._job_ids)
        job = _Job(_Kind.PROMOTION, position, keys, batch.req_context, self._clock())
        try:
            metadata = JobMetadata(
                job_id,
                keys,
                np.fromiter(rows.values(), np.int64, len(rows)),
                True,
                batch.req_context,
            )
            self._jobs[job_id] = job
            self._tier_counters[position].jobs_in_flight += 1
            self._tiers[position].submit_load(metadata)
        except Exception as exc:
            if self._jobs.pop(job_id, None) is not None:
                self._tier_counters[position].jobs_in_flight -= 1
            self._internal_error(f"submitting promotion job {job_id}")
            self._finish_promotion(job, JobResult(job_id, False, error=f"submit failed: {exc!r}"))

    def _finish_promotion(self, job: _Job, result: JobResult) -> None:
        counters = self._tier_counters[job.tier]
        if result.success:
            committed, failed = list(job.keys), []
        else:
            landed = result.successful_keys or frozenset()
            committed = [k for k in job.keys if k in landed]
            failed = [k for k in job.keys if k not in landed]
        promoting = self._promoting
        for key in job.keys:
            del promoting[key]
        primary = self._primary
        if committed:
            primary.complete_store(committed, True)
            counters.promotions += len(committed)
            self._primary_counters.promotions += len(committed)
            self._count_transfer(counters, job, result, len(committed))
        if failed:
            primary.complete_store(failed, False)
            counters.failures += 1
            self._failure_log.failed(
                counters.name,
                f"promotion of {len(failed)} block(s)",
                result.error,
                routine=result.only_missing_blocks,
            )
            if self._backoff_s > 0:
                retry_at = self._clock() + self._backoff_s
                backoff = self._backoff
                for key in failed:
                    backoff.pop(key, None)  # re-insert: the dict stays ordered by expiry
                    backoff[key] = retry_at
                while len(backoff) > MAX_BACKOFF_KEYS:
                    del backoff[next(iter(backoff))]
        if committed and self._backfill and job.tier > 0:
            self._cascade(tuple(committed), range(job.tier), job.req_context)

    def _drop_staged(self) -> None:
        # Staged promotions hold no primary row yet: forgetting them is enough.
        for batches in self._staged:
            while batches:
                for key in batches.pop().keys:
                    del self._promoting[key]
        self._num_staged = 0

    # -- cascade ---------------------------------------------------------------------------

    def _cascade(
        self, keys: tuple[OffloadKey, ...], positions: Iterable[int], req_context: ReqContext
    ) -> None:
        if self._backoff:
            for key in keys:
                self._backoff.pop(key, None)  # the tiers are about to hold it again
        primary = self._primary
        for position in positions:
            # One pin per tier job, released when that job's result arrives.
            block_ids = _block_ids_of(primary.prepare_load(keys, req_context))
            job_id = next(self._job_ids)
            job = _Job(_Kind.CASCADE, position, keys, req_context, self._clock())
            counters = self._tier_counters[position]
            try:
                metadata = JobMetadata(job_id, keys, block_ids, False, req_context)
                self._jobs[job_id] = job
                counters.jobs_in_flight += 1
                self._tiers[position].submit_store(metadata)
            except Exception as exc:
                if self._jobs.pop(job_id, None) is not None:
                    counters.jobs_in_flight -= 1
                self._internal_error(f"submitting cascade job {job_id} to tier {counters.name}")
                primary.complete_load(keys)
                counters.failures += 1
                self._failure_log.failed(counters.name, f"cascade job {job_id}", repr(exc))

    def _finish_cascade(self, job: _Job, result: JobResult) -> None:
        self._primary.complete_load(job.keys)
        counters = self._tier_counters[job.tier]
        if result.success:
            stored = len(job.keys)
        else:
            landed = result.successful_keys or frozenset()
            stored = sum(1 for k in job.keys if k in landed)
            counters.failures += 1
            self._failure_log.failed(
                counters.name, f"cascade of {len(job.keys) - stored} block(s)", result.error
            )
        counters.cascades += stored
        self._count_transfer(counters, job, result, stored)

    # -- results ---------------------------------------------------------------------------

    def _poll(self) -> int:
        """Collect every tier's finished jobs and act on them. Returns how many."""
        if not self._jobs:
            return 0
        finished = 0
        for position, tier in enumerate(self._tiers):
            if not self._tier_counters[position].jobs_in_flight:
                continue
            try:
                results = list(tier.get_finished())
            except Exception:
                self._internal_error(f"get_finished of tier {self._tier_counters[position].name}")
                continue
            for result in results:
                finished += self._on_result(position, result)
        return finished

    def _on_result(self, position: int, result: JobResult) -> int:
        job = self._jobs.get(result.job_id)
        if job is None or job.tier != position:
            self._unexpected_results += 1
            logger.error(
                "tier %s returned a result for job %s, which %s",
                self._tier_counters[position].name,
                result.job_id,
                "is not in flight" if job is None else "was submitted to another tier",
            )
            return 0
        del self._jobs[result.job_id]
        self._tier_counters[position].jobs_in_flight -= 1
        try:
            if job.kind is _Kind.CASCADE:
                self._finish_cascade(job, result)
            else:
                self._finish_promotion(job, result)
        except Exception:
            self._internal_error(f"handling the result of {job.kind.value} job {result.job_id}")
        return 1

    def _count_transfer(
        self, counters: TierCounters, job: _Job, result: JobResult, blocks: int
    ) -> None:
        nbytes = result.transfer_bytes or blocks * self._block_bytes
        seconds = result.transfer_time or max(0.0, self._clock() - job.submitted_at)
        counters.add_transfer(nbytes, seconds)
        self._primary_counters.add_transfer(nbytes, seconds)

    # -- shutdown --------------------------------------------------------------------------

    def _drain(self, deadline: float) -> None:
        while True:
            self._poll()
            remaining = deadline - time.monotonic()
            if not self._jobs or remaining <= 0:
                return
            busy = {job.tier for job in self._jobs.values()}
            waited = False
            for position in sorted(busy):
                drain = getattr(self._tiers[position], "drain", None)
                if callable(drain):
                    try:
                        drain(max(0.0, deadline - time.monotonic()))
                        waited = True
                    except TimeoutError:
                        waited = True  # the deadline passed: the loop above gives up
                    except Exception:
                        self._internal_error(f"drain of tier {self._tier_counters[position].name}")
            if not waited:
                time.sleep(min(0.001, max(0.0, remaining)))

    def _collect_after_shutdown(self, position: int, tier: SecondaryTierManager) -> None:
        """Take results a tier produced while shutting down (e.g. cancelled jobs)."""
        if not self._tier_counters[position].jobs_in_flight:
            return
        try:
            results = list(tier.get_finished())
        except Exception:
            return  # a closed tier may refuse; its jobs are abandoned below
        for result in results:
            self._on_result(position, result)

    def _abandon_jobs(self) -> None:
        """Release what jobs that never answered still hold (their tiers are shut down)."""
        for job_id, job in list(self._jobs.items()):
            self._on_result(job.tier, JobResult(job_id, False, error="abandoned at shutdown"))

    # -- helpers ---------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closed:
            raise TierClosedError("the TieringOffloadingManager has been shut down")

    def _hit(self, key: OffloadKey) -> None:
        self._primary_counters.hits += 1
        if key not in self._step_hits:
            self._step_hits.add(key)
            self._unpinned_hits.append(key)

    def _protect_step_hits(self) -> None:
        """Pin this step's hits before an eviction for a promotion (one call for all)."""
        if not self._unpinned_hits:
            return
        primary = self._primary
        hits = [k for k in self._unpinned_hits if primary.is_ready(k)]
        self._unpinned_hits.clear()
        if hits:
            primary.prepare_load(hits, NO_CONTEXT)
            self._pinned_hits.extend(hits)

    def _end_of_step(self) -> None:
        """The engine has taken what it needed from this step's hits: release their pins."""
        if self._step_hits:
            self._step_hits.clear()
            self._unpinned_hits.clear()
            if self._pinned_hits:
                pinned, self._pinned_hits = self._pinned_hits, []
                self._primary.complete_load(pinned)

    def _count_answer(self, key: OffloadKey, answer: bool | None) -> None:
        if answer is True:
            self._hit(key)
        elif answer is None:
            self._retries += 1
        else:
            self._primary_counters.misses += 1

    def _internal_error(self, what: str) -> None:
        self._internal_errors += 1
        logger.exception("kv-tiering manager: error while %s", what)

    def _expire_backoff(self, now: float) -> None:
        backoff = self._backoff
        while backoff:
            key = next(iter(backoff))
            if backoff[key] > now:
                return
            del backoff[key]

    def _discard_events(self) -> None:
        # Events are off: keep tiers' event buffers from growing.
        for tier in self._tiers:
            try:
                for _ in tier.take_events():
                    pass
            except Exception:
                self._internal_error(f"discarding events of tier {tier.tier_type}")

    def _snapshot(self) -> ManagerStats:
        return self._stats_from(self._holdings())

    def _holdings(self) -> _Holdings:
        primary = self._primary
        held: list[int | None] = []
        capacities: list[int | None] = []
        for tier in self._tiers:
            blocks, capacity = _tier_holdings(tier)
            held.append(blocks)
            capacities.append(capacity)
        return _Holdings(
            primary_ready=primary.num_ready(),
            primary_pinned=primary.num_pinned(),
            tier_blocks=held,
            tier_capacities=capacities,
        )

    def _stats_from(self, holdings: _Holdings) -> ManagerStats:
        tiers: list[TierStats] = [
            self._primary_counters.snapshot(
                blocks_held=holdings.primary_ready, capacity_blocks=self._primary.num_blocks
            )
        ]
        for counters, held, capacity in zip(
            self._tier_counters, holdings.tier_blocks, holdings.tier_capacities, strict=True
        ):
            tiers.append(counters.snapshot(blocks_held=held or 0, capacity_blocks=capacity))
        oldest = next(iter(self._jobs.values()), None)
        return ManagerStats(
            tiers=tuple(tiers),
            lookups=self._lookups,
            retries=self._retries,
            promotion_no_room=self._no_room,
            backoff_keys=len(self._backoff),
            pinned_blocks=holdings.primary_pinned,
            staged_promotions=self._num_staged,
            unexpected_results=self._unexpected_results,
            internal_errors=self._internal_errors,
            oldest_job_age_s=0.0 if oldest is None else self._clock() - oldest.submitted_at,
            closed=self._closed,
        )


@dataclass(frozen=True, slots=True)
class _Holdings:
    """What the tiers hold at one moment (read before they shut down)."""

    primary_ready: int
    primary_pinned: int
    tier_blocks: list[int | None]
    tier_capacities: list[int | None]

    @classmethod
    def unknown(cls, num_tiers: int) -> _Holdings:
        return cls(0, 0, [None] * num_tiers, [None] * num_tiers)


def _tier_holdings(tier: SecondaryTierManager) -> tuple[int | None, int | None]:
    """Blocks held and capacity of a tier, from its ``stats()`` snapshot where it has one."""
    try:
        stats = getattr(tier, "stats", None)
        snapshot = stats() if callable(stats) else None
        held = getattr(snapshot, "blocks_held", None)
        if not isinstance(held, int):
            held = tier.get_num_blocks()
        capacity = getattr(snapshot, "capacity_blocks", getattr(tier, "capacity_blocks", None))
    except Exception:
        return None, None
    return held, capacity if isinstance(capacity, int) else None


def _tier_names(tiers: Sequence[SecondaryTierManager]) -> list[str]:
    """Each tier's label: its type, with ``#position`` where a type appears twice."""
    types = [t.tier_type for t in tiers]
    repeated = {t for t in types if types.count(t) > 1}
    return [f"{t}#{i}" if t in repeated or t == "cpu" else t for i, t in enumerate(types)]
