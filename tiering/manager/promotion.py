"""Promotion: a block found in a secondary tier is loaded back into the primary tier.

A lookup that hits a secondary tier promises the key a primary row (checked in
O(1)) and stages it; staged keys of one request are submitted as one load job
per tier, which reserves its rows then (``prepare_store``, possibly evicting).
The rows stay unreadable until the job's result: success commits them, failure
frees them and answers the keys as misses for ``failed_promotion_backoff_s``.
A block promoted from tier *i* is also cascaded to the tiers before *i*.

Back-pressure: a hit in a tier that is behind (its jobs in flight pin its share
of the primary tier, see :mod:`tiering.manager.backpressure`) is answered as a miss
and counted in ``promotion_no_room``: the promotion would wait behind that
tier's backlog holding a primary row.
"""

from __future__ import annotations

from tiering.core.jobs import JobMetadata, JobResult
from tiering.core.keys import OffloadKey, ReqContext
from tiering.core.specs import BlockIds, trusted_block_ids
from tiering.manager.cascade import CascadeMixin
from tiering.manager.state import MAX_BACKOFF_KEYS, Job, JobKind, StagedBatch, block_ids_of


class PromotionMixin(CascadeMixin):
    """Load jobs from the secondary tiers into the primary tier."""

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
        if self._behind(position, 1):
            if self._jobs:
                self._poll(landed_only=True)
            if self._behind(position, 1):
                # Back-pressure: the tier is behind, its jobs already pin its share of the
                # primary tier. A promotion would wait behind them holding one more row.
                self._no_room += 1
                self._primary_counters.misses += 1
                return False
        needed = self._num_staged + 1
        if primary.num_free() < needed:
            # An eviction will be needed: release finished pins first, and pin this step's
            # hits (the engine may be about to load them) so they are not counted as victims.
            if self._jobs:
                self._poll(landed_only=True)
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
        batches.append(StagedBatch(req_context, [key]))
        self._num_staged += 1

    def _flush_staged(self) -> None:
        if not self._num_staged:
            return
        for position, batches in enumerate(self._staged):
            while batches:
                self._submit_promotion(position, batches.pop(0))

    def _reserve(
        self, keys: list[OffloadKey], req_context: ReqContext
    ) -> tuple[tuple[OffloadKey, ...], BlockIds]:
        """Reserve primary rows for a batch: the keys that got one, and their rows."""
        primary = self._primary
        if primary.num_free() < len(keys):
            # An eviction decision: first collect finished jobs, whose cascade pins may be
            # all that keeps rows from being evictable.
            self._poll(landed_only=True)
            self._protect_step_hits()
        output = primary.prepare_store(keys, req_context)
        if output is not None:
            if output.evicted_keys:
                self._primary_counters.evictions += len(output.evicted_keys)
            # The spec's rows are a validated array already: the job takes it as it is.
            return tuple(output.keys_to_store), block_ids_of(output.store_spec)
        # Room shrank since the lookups (the engine pinned blocks): as many as fit.
        got: list[OffloadKey] = []
        rows: list[int] = []
        for key in keys:
            single = primary.prepare_store((key,), req_context)
            if single is None:
                break
            if single.evicted_keys:
                self._primary_counters.evictions += len(single.evicted_keys)
            got.extend(single.keys_to_store)
            rows.extend(block_ids_of(single.store_spec).tolist())
        return tuple(got), trusted_block_ids(rows)

    def _submit_promotion(self, position: int, batch: StagedBatch) -> None:
        self._num_staged -= len(batch.keys)
        try:
            keys, rows = self._reserve(batch.keys, batch.req_context)
        except Exception:
            self._internal_error("reserving primary blocks for a promotion")
            keys, rows = (), trusted_block_ids([])
        if len(keys) < len(batch.keys):
            reserved = set(keys)
            for key in batch.keys:
                if key not in reserved:
                    del self._promoting[key]
                    self._no_room += 1
            if not keys:
                return
        job_id = next(self._job_ids)
        job = Job(JobKind.PROMOTION, position, keys, batch.req_context, self._clock())
        # The rows are held until the result: counted for back-pressure, released there.
        self._in_flight[position].started(job_id, len(keys), job.submitted_at)
        try:
            metadata = JobMetadata(job_id, keys, rows, True, batch.req_context)
            self._jobs[job_id] = job
            self._tier_counters[position].jobs_in_flight += 1
            self._tiers[position].submit_load(metadata)
        except Exception as exc:
            if self._jobs.pop(job_id, None) is not None:
                self._tier_counters[position].jobs_in_flight -= 1
            self._internal_error(f"submitting promotion job {job_id}")
            self._finish_promotion(job, JobResult(job_id, False, error=f"submit failed: {exc!r}"))

    def _finish_promotion(self, job: Job, result: JobResult) -> None:
        counters = self._tier_counters[job.tier]
        self._in_flight[job.tier].finished(result.job_id)
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
            counters.routine_failures += result.only_missing_blocks
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
            positions = self._store_positions(range(job.tier), job.req_context)
            self._cascade(tuple(committed), positions, job.req_context)

    def _drop_staged(self) -> None:
        # Staged promotions hold no primary row yet: forgetting them is enough.
        for batches in self._staged:
            while batches:
                for key in batches.pop().keys:
                    del self._promoting[key]
        self._num_staged = 0
