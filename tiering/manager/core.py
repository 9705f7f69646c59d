"""``TieringOffloadingManager``: construction and the scheduler-facing contract.

The public class. It validates its options, assigns the state the layers share
(:mod:`tiering.manager.state`), and implements the store side of
:class:`~tiering.core.contract.OffloadingManager` (prepare/complete store, touch,
events) plus ``step`` and ``flush``; the load side (lookup, prepare/complete
load) is :mod:`tiering.manager.loads`, and promotion, cascade, result handling
(with shutdown) and statistics are the other layers it inherits from.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from tiering.config import DEFAULT_CASCADE_MAX_PINNED_FRACTION
from tiering.core.contract import OffloadingEvent, OffloadingManager, PrepareStoreOutput
from tiering.core.errors import ContractError
from tiering.core.jobs import SecondaryTierManager
from tiering.core.keys import NO_CONTEXT, OffloadKey, ReqContext
from tiering.core.stats import TierCounters
from tiering.manager.backpressure import JobsInFlight
from tiering.manager.failures import FailureLog
from tiering.manager.filters import ALL, RequestFilters
from tiering.manager.loads import LoadsMixin
from tiering.manager.state import (
    DEFAULT_FAILED_PROMOTION_BACKOFF_S,
    DEFAULT_MAX_PROMOTION_BATCH,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    FAILURE_LOG_INTERVAL_S,
    METRICS_PUBLISH_INTERVAL_S,
    PrimaryTier,
    tier_names,
)
from tiering.metrics import MetricsExport
from tiering.policies.admission import AdmissionPolicy


class TieringOffloadingManager(LoadsMixin, OffloadingManager):
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
    are cascaded late; None cascades every stored block);
    ``cascade_max_pinned_fraction`` (back-pressure: the share of the primary
    tier's blocks one secondary tier's cascades in flight may pin once the oldest
    has waited over 50 ms; a cascade that would pin more is dropped and counted in
    that tier's ``dropped``, so a tier that cannot keep up loses blocks, never the
    primary tier's room. One job is always let through, so a tier with a tiny
    share still makes progress.)

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
        cascade_max_pinned_fraction: float = DEFAULT_CASCADE_MAX_PINNED_FRACTION,
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
        if not 0 < cascade_max_pinned_fraction <= 1:
            raise ValueError(
                "cascade_max_pinned_fraction must be in (0, 1], got "
                f"{cascade_max_pinned_fraction!r}"
            )

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
        self._cascade_budget = max(1, int(primary.num_blocks * cascade_max_pinned_fraction))
        self._clock = clock
        self._block_bytes = primary.block_bytes

        self._primary_counters = TierCounters("cpu", primary.medium)
        self._tier_counters = [
            TierCounters(name, tier.tier_type)
            for name, tier in zip(tier_names(tiers), tiers, strict=True)
        ]
        self._job_ids = itertools.count(1)
        self._jobs = {}  # submission order: the first is the oldest
        self._promoting = {}  # key -> source tier (staged or submitted)
        self._staged = [[] for _ in tiers]
        self._in_flight = [JobsInFlight() for _ in tiers]
        self._filters = RequestFilters()
        self._store_filters = {}  # key -> its request's kv_store_tiers, prepare to complete
        self._num_staged = 0
        self._user_load_pins = {}  # pins taken by the engine
        # Keys answered True since the step began: a promotion's eviction must not take them
        # before the engine's prepare_load. Pinned lazily, only when a promotion must evict.
        self._step_hits = set()
        self._unpinned_hits = []
        self._pinned_hits = []
        self._backoff = {}  # key -> when it may be promoted again
        self._lookups = 0
        self._retries = 0
        self._no_room = 0
        self._unexpected_results = 0
        self._internal_errors = 0
        self._failure_log = FailureLog(FAILURE_LOG_INTERVAL_S)
        self._refusal_log = FailureLog(FAILURE_LOG_INTERVAL_S)
        self._closed = False
        self._final_stats = None
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

    # -- the OffloadingManager contract (the load side: LoadsMixin) ------------------------

    def touch(self, keys: Sequence[OffloadKey], req_context: ReqContext) -> None:
        """Mark blocks recently used in the primary tier and in every secondary tier."""
        self._check_open()
        self._primary.touch(keys, req_context)
        if self._admission is not None and self._tiers:
            # Blocks that earned a place below the primary tier by this use.
            ready = self._primary.is_ready
            late = self._admission.on_use([key for key in keys if ready(key)])
            if late:
                positions = self._store_positions(range(len(self._tiers)), req_context)
                self._cascade(tuple(late), positions, req_context)
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
            self._poll(landed_only=True)
        output = self._primary.prepare_store(keys, req_context)
        if output is not None and output.keys_to_store:
            store_filter = self._filters.of(req_context)[1]
            if store_filter is not ALL:  # kv_store_tiers: remembered until complete_store
                for key in output.keys_to_store:
                    self._store_filters[key] = store_filter
        if output is None:
            # Never silent: the engine keeps these blocks only on the GPU.
            self._primary_counters.dropped += len(keys)
            self._refusal_log.failed(
                "cpu",
                f"prepare_store of {len(keys)} block(s)",
                f"no primary block could be freed ({self._primary.num_pinned()} of "
                f"{self._primary.num_blocks} pinned); counted as dropped",
            )
        elif output.evicted_keys:
            self._primary_counters.evictions += len(output.evicted_keys)
        return output

    def complete_store(self, keys: Sequence[OffloadKey], success: bool = True) -> None:
        """Finish a prepared store; on success cascade the blocks to every secondary tier.

        Each tier gets one job for all ``keys``; the primary rows stay pinned
        for that job until its result arrives. Raises
        :class:`~tiering.core.errors.ContractError`, changing nothing, for keys that
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
        filters = self._store_filters
        chosen = {key: filters.pop(key, ALL) for key in keys} if filters else None
        if not success:
            self._primary_counters.failures += 1
            return
        self._primary_counters.cascades += len(keys)
        if keys and self._tiers:
            admitted = keys if self._admission is None else self._admission.admit(keys)
            if admitted and chosen is None:
                self._cascade(tuple(admitted), range(len(self._tiers)), NO_CONTEXT)
            elif admitted and chosen is not None:
                self._cascade_filtered(admitted, chosen)

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
            if not tier.events_enabled:
                continue  # the tier's enable_kv_events is off: taken, not reported
            for keys, removed in tier_events:
                if keys:
                    events.append(
                        OffloadingEvent(
                            keys=list(keys),
                            block_size=self._event_block_size,
                            medium=tier.tier_type,
                            removed=removed,
                            locality=tier.locality,
                        )
                    )
        return events

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
