"""The manager's shared state, its job records, and the helpers every layer uses.

:class:`ManagerState` declares every attribute the manager's layers share (each
assigned once, by ``TieringOffloadingManager.__init__``), and owns the small rules
that several layers apply: the lifetime of a step's hits (pinned only when a
promotion must evict, released when the step ends), the failed-promotion back-off
expiry, and how an internal error is counted and logged. Everything runs on the
scheduler thread.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

from tiering.core.contract import OffloadingEvent, PrepareStoreOutput
from tiering.core.errors import TierClosedError
from tiering.core.jobs import JobId, SecondaryTierManager
from tiering.core.keys import NO_CONTEXT, OffloadKey, ReqContext
from tiering.core.specs import BlockIds, BlockIDsLoadStoreSpec, LoadStoreSpec
from tiering.core.stats import ManagerStats, TierCounters
from tiering.manager.backpressure import JobsInFlight
from tiering.manager.failures import FailureLog
from tiering.manager.filters import RequestFilters, TierFilter
from tiering.metrics import MetricsExport
from tiering.policies.admission import AdmissionPolicy

# Every part logs as "tiering.manager", the name operators filter on.
logger = logging.getLogger("tiering.manager")


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


class JobKind(enum.Enum):
    CASCADE = "cascade"
    PROMOTION = "promotion"


@dataclass(slots=True)
class Job:
    """A job submitted to a secondary tier and not yet answered."""

    kind: JobKind
    tier: int
    keys: tuple[OffloadKey, ...]
    req_context: ReqContext
    submitted_at: float


@dataclass(slots=True)
class StagedBatch:
    """Promotions promised a primary row, not yet reserved nor submitted (one job per batch)."""

    req_context: ReqContext
    keys: list[OffloadKey]


def block_ids_of(spec: LoadStoreSpec) -> BlockIds:
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"the primary tier returned {type(spec).__name__}, not block ids")
    return spec.block_ids


def tier_names(tiers: Sequence[SecondaryTierManager]) -> list[str]:
    """Each tier's label (metrics, stats, the replay report): the ``name`` its entry gives;
    else its type, with ``#position`` where the type appears twice. A label that would
    still repeat (or be the primary tier's ``cpu``) gets ``#position`` too."""
    types = [str(t.tier_type) for t in tiers]

    def label(position: int, tier: SecondaryTierManager) -> str:
        name = getattr(tier, "name", None)
        # The registry's default name is "<type>-<position>": unnamed, labelled by type.
        if isinstance(name, str) and name and name != f"{tier.tier_type}-{position}":
            return name
        kind = types[position]
        return f"{kind}#{position}" if types.count(kind) > 1 else kind

    labels = [label(i, t) for i, t in enumerate(tiers)]
    repeated = {x for x in labels if labels.count(x) > 1}
    return [f"{x}#{i}" if x in repeated or x == "cpu" else x for i, x in enumerate(labels)]


class ManagerState:
    """Attributes and helpers shared by the manager's layers (see the module docstring)."""

    # Declared here, assigned by TieringOffloadingManager.__init__ (core.py). One owner:
    # the scheduler thread.
    _primary: PrimaryTier
    _tiers: tuple[SecondaryTierManager, ...]
    _admission: AdmissionPolicy[OffloadKey] | None  # which stored blocks are cascaded
    _enable_events: bool
    _shutdown_timeout_s: float
    _backoff_s: float  # how long a failed promotion's keys answer "miss"
    _backfill: bool  # a block promoted from tier i is also stored into tiers before i
    _event_block_size: int
    _relabel_primary_events: bool
    _max_batch: int  # most blocks per promotion job
    _cascade_budget: int  # most primary rows one tier's jobs may pin once behind (back-pressure)
    _in_flight: list[JobsInFlight]  # per tier: the rows its jobs hold, since when (back-pressure)
    _filters: RequestFilters  # kv_load_tiers / kv_store_tiers of each request, parsed once
    _store_filters: dict[OffloadKey, TierFilter]  # blocks being stored -> their kv_store_tiers
    _refusal_log: FailureLog  # prepare_store refusals, rate-limited like failures
    _clock: Callable[[], float]
    _block_bytes: int
    _primary_counters: TierCounters
    _tier_counters: list[TierCounters]
    _job_ids: Iterator[int]
    _jobs: dict[JobId, Job]  # submission order: the first is the oldest
    _promoting: dict[OffloadKey, int]  # key -> source tier (staged or submitted)
    _staged: list[list[StagedBatch]]  # per tier, promotions not yet submitted
    _num_staged: int
    _user_load_pins: dict[OffloadKey, int]  # pins taken by the engine
    # Keys answered True since the step began: a promotion's eviction must not take them
    # before the engine's prepare_load. Pinned lazily, only when a promotion must evict.
    _step_hits: set[OffloadKey]
    _unpinned_hits: list[OffloadKey]
    _pinned_hits: list[OffloadKey]
    _backoff: dict[OffloadKey, float]  # key -> when it may be promoted again
    _lookups: int
    _retries: int
    _no_room: int
    _unexpected_results: int
    _internal_errors: int
    _failure_log: FailureLog
    _closed: bool
    _final_stats: ManagerStats | None
    _metrics: MetricsExport
    _next_publish: float

    def _poll(self, landed_only: bool = False) -> int:
        """Collect every tier's finished jobs and act on them (results.py). Returns how many."""
        raise NotImplementedError

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
