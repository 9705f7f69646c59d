"""The state of one tier's loop-thread service, and the records of the jobs it runs.

Owns the data every part of :class:`~tiering.runtime.service.TierService`
works on: the constructor's settings, the *published* views the scheduler
thread reads without a lock (``present``, ``unsettled``, ``absent_at``,
``events``, ``results``, ``counters``), the loop-owned bookkeeping (key
claims, jobs, checksums, queued resolutions and touches), the per-job records
(``_Job``, ``_Batch``) and the small pure helpers the other parts share.
"""

from __future__ import annotations

import asyncio
import logging
import queue
from collections import deque
from dataclasses import dataclass, field

from tiering.core.jobs import JobMetadata, JobResult
from tiering.core.keys import OffloadKey
from tiering.runtime.digests import StoredDigests
from tiering.runtime.limiter import BlockLimiter
from tiering.runtime.presence import KnownPresent
from tiering.runtime.stats import TierCounters
from tiering.tier import AsyncTier

logger = logging.getLogger("tiering.runtime")

#: Most keys one resolution (``contains_many``) round covers.
_RESOLVE_BATCH = 1024

_NO_KEYS: list[OffloadKey] = []  # shared empty result (never mutated)


@dataclass(eq=False, slots=True)
class _Job:
    """One submitted job while the loop owns it."""

    meta: JobMetadata
    rows: list[int]
    is_load: bool
    deadline: float
    task: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    expired: bool = False
    abandoned: bool = False  # its operation ignored cancellation past cancel_grace_s
    published: bool = False
    done_keys: int = 0


@dataclass(slots=True)
class _Batch:
    """What the tier calls of one job did, key by key."""

    ok: list[OffloadKey] = field(default_factory=list)
    errors: dict[OffloadKey, BaseException] = field(default_factory=dict)
    in_flight: set[OffloadKey] = field(default_factory=set)
    # Loads whose bytes differ from the checksum this process stored (verify mode).
    mismatched: list[OffloadKey] = field(default_factory=list)


class _ServiceState:
    """The constructor and the state of :class:`~tiering.runtime.service.TierService`."""

    def __init__(
        self,
        tier: AsyncTier,
        *,
        name: str,
        flat_view: memoryview,
        block_bytes: int,
        job_timeout_s: float,
        cancel_grace_s: float,
        shared_absent_ttl_s: float,
        shared_present_ttl_s: float,
        shared_max_known_keys: int,
        max_events: int,
        verify: bool,
    ) -> None:
        self.tier = tier
        self.verify = verify
        self.name = name
        self.shared = bool(tier.shared)
        self.block_bytes = block_bytes
        self.job_timeout_s = job_timeout_s
        self.cancel_grace_s = cancel_grace_s
        self.shared_absent_ttl_s = shared_absent_ttl_s
        self.max_events = max_events
        self.touch_supported = type(tier).touch is not AsyncTier.touch
        self._flat = flat_view
        self._max_batch = max(1, int(tier.max_concurrency))
        self._limiter = BlockLimiter(self._max_batch)
        # Published (read by the scheduler thread without a lock).
        self.present = (
            KnownPresent(ttl_s=shared_present_ttl_s, max_keys=shared_max_known_keys)
            if self.shared
            else KnownPresent()
        )
        self.unsettled: set[OffloadKey] = set()
        self.absent_at: dict[OffloadKey, float] = {}
        self.events: deque[tuple[list[OffloadKey], bool]] = deque()
        self.results: queue.SimpleQueue[JobResult] = queue.SimpleQueue()
        self.counters = TierCounters()
        # Loop-owned.
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread_id = 0
        self._claims: dict[OffloadKey, asyncio.Future[None]] = {}
        # The latest store of each key that has started and not ended, claimed or still
        # waiting for its claims: a load of the key waits for it (docs/runtime.md).
        self._storing: dict[OffloadKey, asyncio.Future[None]] = {}
        # Checksums of the blocks this runtime stored (verify mode): kept through
        # removals and mismatches, so a key stays verified until stored again.
        self._digests = StoredDigests(shared_max_known_keys if self.shared else None)
        # Keys the tier reported removed while an operation held them.
        self._removed_during_op: set[OffloadKey] = set()
        self._jobs: dict[int, _Job] = {}
        self._to_resolve: dict[OffloadKey, None] = {}
        self._resolver: asyncio.Task[None] | None = None
        self._resolve_wakeup: asyncio.Event | None = None
        self._to_touch: list[OffloadKey] = []
        self._toucher: asyncio.Task[None] | None = None
        self._closing = False


def _describe_errors(errors: dict[OffloadKey, BaseException], total: int, verb: str) -> str:
    key, exc = next(iter(errors.items()))
    return (
        f"{len(errors)} of {total} blocks not {verb}; first: block {key.hex()}: "
        f"{type(exc).__name__}: {exc}"
    )


def _release_views(views: list[memoryview]) -> list[memoryview]:
    """Release ``views``; return those something still holds an export of."""
    held: list[memoryview] = []
    for view in views:
        try:
            view.release()
        except BufferError:
            held.append(view)
    return held
