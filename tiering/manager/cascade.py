"""Cascade: every block stored into the primary tier goes on to each secondary tier.

One store job per tier for a batch of keys. The primary rows are pinned
(``prepare_load``) per tier job until that job's result arrives, so eviction
never frees bytes an in-flight copy still reads; the result releases the pin and
counts what landed.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from tiering.jobs import JobMetadata, JobResult
from tiering.keys import OffloadKey, ReqContext
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
        for position in positions:
            # One pin per tier job, released when that job's result arrives.
            block_ids = block_ids_of(primary.prepare_load(keys, req_context))
            job_id = next(self._job_ids)
            job = Job(JobKind.CASCADE, position, keys, req_context, self._clock())
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

    def _finish_cascade(self, job: Job, result: JobResult) -> None:
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
