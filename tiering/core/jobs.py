"""Secondary-tier jobs and the seed's synchronous ``SecondaryTierManager`` contract."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field

from tiering.core.keys import OffloadKey, ReqContext
from tiering.core.specs import BlockIds, as_block_ids

JobId = int


@dataclass(frozen=True, slots=True)
class JobMetadata:
    """An immutable description of one transfer between the primary tier and a secondary tier.

    ``block_ids[i]`` is the primary-buffer row that holds (store) or receives
    (load) the block ``keys[i]``. ``is_promotion`` is True for loads into the
    primary tier. Construction validates the fields (``ValueError``/``TypeError``
    naming the job) and freezes ``keys`` into a tuple and ``block_ids`` into a
    read-only int64 array.
    """

    job_id: JobId
    keys: tuple[OffloadKey, ...]
    block_ids: BlockIds
    is_promotion: bool
    req_context: ReqContext = field(default_factory=ReqContext)

    def __post_init__(self) -> None:
        if isinstance(self.job_id, bool) or not isinstance(self.job_id, int) or self.job_id < 0:
            raise ValueError(f"job_id must be a non-negative int, got {self.job_id!r}")
        if not isinstance(self.is_promotion, bool):
            raise TypeError(f"job {self.job_id}: is_promotion must be a bool")
        object.__setattr__(self, "keys", tuple(self.keys))
        object.__setattr__(self, "block_ids", as_block_ids(self.block_ids))
        if len(self.keys) != len(self.block_ids):
            raise ValueError(
                f"job {self.job_id}: {len(self.keys)} keys but {len(self.block_ids)} block_ids"
            )


@dataclass(frozen=True, slots=True)
class JobResult:
    """The outcome of one job (successful or failed).

    The seed's two fields come first; the rest are optional details: which
    keys were transferred (a failed job may still have moved some), the bytes
    and seconds it took, for a failure a one-line reason, and whether it
    failed only because blocks were no longer in the tier (evicted or expired
    since the lookup: routine for a bounded or shared tier, not a fault).
    """

    job_id: JobId
    success: bool
    successful_keys: frozenset[OffloadKey] | None = None
    transfer_bytes: int = 0
    transfer_time: float = 0.0
    error: str | None = None
    only_missing_blocks: bool = False


class SecondaryTierManager(ABC):
    """One non-primary tier, as the scheduler sees it (the seed contract).

    Secondary tiers never touch GPU memory: a store reads primary-buffer rows
    (cascade), a load writes them (promotion). Every method runs on the
    scheduler thread and must return at once: ``submit_*`` hand work off and
    ``get_finished`` polls.
    """

    #: What the tier stores on - ``"CPU"`` (host memory) or ``"STORAGE"`` - and where, relative
    #: to this instance - ``"LOCAL"`` or ``"REMOTE"``: matched by a request's ``kv_load_tiers``
    #: and ``kv_store_tiers`` (:mod:`tiering.manager.filters`) and reported in events. None:
    #: undeclared, matches any filter.
    medium: str | None = None
    locality: str | None = None
    #: Whether the manager reports this tier's stored/removed events.
    events_enabled: bool = True

    def __init__(self, primary_kv_view: memoryview, tier_type: str) -> None:
        self._primary_kv_view = primary_kv_view
        self.tier_type = tier_type

    @abstractmethod
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> bool | None:
        """True if present and ready, False if absent, None if in flight (retry later)."""

    @abstractmethod
    def submit_store(self, job_metadata: JobMetadata) -> None:
        """Start copying ``block_ids`` rows of the primary buffer into this tier.

        The rows stay pinned by the framework until this job's result is
        returned by ``get_finished``. Keys already present are skipped.
        """

    @abstractmethod
    def submit_load(self, job_metadata: JobMetadata) -> None:
        """Start copying the keys' blocks into the ``block_ids`` rows of the primary buffer."""

    @abstractmethod
    def get_finished(self) -> Iterable[JobResult]:
        """Results of every job that finished since the last call (never blocks)."""

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:  # noqa: B027
        """Mark blocks as recently used for this tier's eviction policy."""

    def get_num_blocks(self) -> int:
        """Number of blocks currently held by this tier."""
        return 0

    def take_events(self) -> Iterable[tuple[list[OffloadKey], bool]]:
        """``(keys, removed)`` pairs of blocks stored in or dropped from this tier."""
        return ()

    def shutdown(self) -> None:  # noqa: B027
        """Release resources held by this tier (threads, connections, files). Idempotent."""
