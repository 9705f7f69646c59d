"""``TieringOffloadingManager``: the CPU primary tier plus any number of secondary tiers,
behind the scheduler-facing :class:`~tiering.core.contract.OffloadingManager` contract.

Everything here runs on the scheduler thread and never blocks (except
``shutdown``, which waits a bounded time). Secondary tiers are
:class:`~tiering.core.jobs.SecondaryTierManager` objects (normally the async facade,
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

The manager is one class, :class:`TieringOffloadingManager`, built from layers that
each own one responsibility and live in their own module:

* ``state``      the state every layer shares (declared once), job records, step hits
* ``failures``   rate-limited logging of failed jobs
* ``statistics`` counters, transfer accounting and snapshots
* ``cascade``    primary -> secondary store jobs and their pins
* ``promotion``  secondary -> primary load jobs: staging, row reservation, back-off
* ``results``    collecting results from every tier, draining at shutdown
* ``filters``    a request's tier filters (``kv_load_tiers``, ``kv_store_tiers``...)
* ``backpressure`` which tier is behind: cascades to it are dropped and counted
* ``loads``      lookups and the engine's load pins
* ``core``       the public class: construction, the store side, touch, events
"""

from tiering.manager.core import TieringOffloadingManager
from tiering.manager.state import (
    DEFAULT_FAILED_PROMOTION_BACKOFF_S,
    DEFAULT_MAX_PROMOTION_BATCH,
    DEFAULT_SHUTDOWN_TIMEOUT_S,
    PrimaryTier,
)

__all__ = [
    "DEFAULT_FAILED_PROMOTION_BACKOFF_S",
    "DEFAULT_MAX_PROMOTION_BATCH",
    "DEFAULT_SHUTDOWN_TIMEOUT_S",
    "PrimaryTier",
    "TieringOffloadingManager",
]
