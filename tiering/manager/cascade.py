"""Cascade: every block stored into the primary tier goes on to each secondary tier.

One store job per tier for a batch of keys. The primary rows are pinned
(``prepare_load``) per tier job until that job's result arrives, so eviction
never frees bytes an in-flight copy still reads; the result releases the pin and
counts what landed.

Back-pressure (:mod:`tiering.manager.backpressure`): while a tier is behind, its
cascades are dropped and counted (``dropped``) and its hits answered as misses
(``promotion_no_room``, see :mod:`tiering.manager.promotion`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping, Sequence

from tiering.core.jobs import JobMetadata, JobResult
from tiering.core.keys import NO_CONTEXT, OffloadKey, ReqContext
from tiering.manager.filters import TierFilter
from tiering.manager.state import Job, JobKind, block_ids_of
from tiering.manager.statistics import StatisticsMixin

# Every part logs as "tiering.manager", the name operators filter on.
logger = logging.getLogger("tiering.manager")


class CascadeMixin(StatisticsMixin):
    """Store jobs from the primary tier to the secondary tiers."""

    def _cascade(
        self, keys: tuple[OffloadKey, ...], positions: Iterable[int], req_context: ReqContext
    ) -> None:
        if self._backoff:
            for key in keys:
                self._backoff.pop(key, None)  # the tiers are about to hold it again
        primary = self._primary
        polled = False
        for position in positions:
            counters = self._tier_counters[position]
            if self._behind(position, len(keys)) and not polled:
                self._poll(landed_only=True)  # results since the step began make room
                polled = True
            if self._behind(position, len(keys)):
                counters.dropped += len(keys)  # back-pressure: the tier is behind
                continue
            # One pin per tier job, released when that job's result arrives.
            block_ids = block_ids_of(primary.prepare_load(keys, req_context))
            job_id = next(self._job_ids)
            job = Job(JobKind.CASCADE, position, keys, req_context, self._clock())
            try:
                metadata = JobMetadata(job_id, keys, block_ids, False, req_context)
                self._jobs[job_id] = job
                counters.jobs_in_flight += 1
                self._in_flight[position].started(job_id, len(keys), job.submitted_at)
                self._tiers[position].submit_store(metadata)
            except Exception as exc:
                if self._jobs.pop(job_id, None) is not None:
                    counters.jobs_in_flight -= 1
                    self._in_flight[position].finished(job_id)
                self._internal_error(f"submitting cascade job {job_id} to tier {counters.name}")
                primary.complete_load(keys)
                counters.failures += 1
                self._failure_log.failed(counters.name, f"cascade job {job_id}", repr(exc))

    def _cascade_filtered(
        self, keys: Sequence[OffloadKey], filters: Mapping[OffloadKey, TierFilter]
    ) -> None:
        """Cascade each key to the tiers its request's ``kv_store_tiers`` allows."""
        for position, tier in enumerate(self._tiers):
            allowed = tuple(k for k in keys if filters[k].allows(tier.medium, tier.locality))
            if allowed:
                self._cascade(allowed, (position,), NO_CONTEXT)

    def _store_positions(self, positions: Iterable[int], req_context: ReqContext) -> list[int]:
        """The tiers of ``positions`` the request's ``kv_store_tiers`` lets its blocks go to.

        For the cascades made in a request's context after its store completed:
        an admission policy's late cascade on its use, a backfill after its load.
        """
        store_filter = self._filters.of(req_context)[1]
        tiers = self._tiers
        return [p for p in positions if store_filter.allows(tiers[p].medium, tiers[p].locality)]

    def _behind(self, position: int, rows: int) -> bool:
        """Whether ``rows`` more would find tier ``position`` behind (back-pressure)."""
        return self._in_flight[position].behind(rows, self._cascade_budget, self._clock)

    def _finish_cascade(self, job: Job, result: JobResult) -> None:
        self._primary.complete_load(job.keys)
        counters = self._tier_counters[job.tier]
        self._in_flight[job.tier].finished(result.job_id)
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
