"""Jobs of a tier's loop-thread service: claims, deadlines, stores, loads and their results.

Owns a job from its task's start to its one ``JobResult``: claiming its keys
(no two operations on one key at once), its deadline and what happens to a
tier that ignores the cancellation, what a store skips and a load refuses,
settling the presence view after the transfer, and publishing the result.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from tiering.core.errors import BlockNotFound, CorruptBlock
from tiering.core.jobs import JobResult
from tiering.core.keys import OffloadKey
from tiering.runtime.service_state import _NO_KEYS, _Batch, _describe_errors, _Job, logger
from tiering.runtime.stats import count_job_seconds
from tiering.runtime.transfer import _Transfers


class _JobRunner(_Transfers):
    """Jobs, claims and results (a part of ``TierService``)."""

    # -- jobs --------------------------------------------------------------------------------

    async def _run_job(self, job: _Job) -> None:
        try:
            if job.is_load:
                result = await self._load(job)
            else:
                result = await self._store(job)
        except asyncio.CancelledError:
            if job.expired:
                self.counters.timeouts += 1
                stubborn = " and the tier ignored cancellation" if job.abandoned else ""
                result = self._failure(
                    job,
                    f"missed its deadline of {self.job_timeout_s:g} s{stubborn} "
                    f"({job.done_keys} of {len(job.meta.keys)} blocks done)",
                )
            else:
                result = self._failure(job, f"cancelled: tier {self.name} shut down")
        except Exception as exc:  # a bug in the runtime: still one clean failure
            logger.exception("tier %s: job %d crashed", self.name, job.meta.job_id)
            result = self._failure(job, f"internal error: {exc!r}")
        finally:
            if job.timer is not None:
                job.timer.cancel()
            # An abandoned job's id may already belong to a newer job: remove only our own.
            if self._jobs.get(job.meta.job_id) is job:
                del self._jobs[job.meta.job_id]
        self._publish(job, result)

    def _expire(self, job: _Job) -> None:
        """The job's deadline: cancel it, and give a stubborn tier ``cancel_grace_s`` more."""
        if job.task is None or job.task.done():
            return
        job.expired = True
        job.task.cancel()
        assert self._loop is not None
        job.timer = self._loop.call_later(self.cancel_grace_s, self._abandon, job)

    def _abandon(self, job: _Job) -> None:
        """The tier ignored cancellation for ``cancel_grace_s``: say so, keep waiting.

        The job is not reported before its operation ends: until then the tier
        may still read or write the job's primary rows, and a reported job
        hands its rows back to the scheduler for reuse (a wrong hit, or a
        corrupt store, if the operation then touched them).
        """
        if job.task is None or job.task.done() or job.published:
            return
        job.abandoned = True
        self.counters.abandoned_jobs += 1
        logger.error(
            "tier %s: job %d ignored cancellation for %g s after its deadline; it is reported "
            "failed once the operation ends, and its primary rows stay in use until then "
            "(the tier breaks the AsyncTier contract)",
            self.name,
            job.meta.job_id,
            self.cancel_grace_s,
        )

    async def _claim(self, keys: Sequence[OffloadKey]) -> asyncio.Future[None]:
        """Wait until no other operation holds any of ``keys``, then hold them all.

        Cancellation: holds nothing.
        """
        claims = self._claims
        while True:
            held = next((claims[k] for k in keys if k in claims), None)
            if held is None:
                break
            await asyncio.wait((held,))  # never cancels ``held`` if we are cancelled
        assert self._loop is not None
        mine: asyncio.Future[None] = self._loop.create_future()
        for key in keys:
            claims[key] = mine
        return mine

    def _release(self, keys: Sequence[OffloadKey], mine: asyncio.Future[None]) -> None:
        claims = self._claims
        gone = self._removed_during_op
        for key in keys:
            if claims.get(key) is mine:
                del claims[key]
            if gone:
                gone.discard(key)
            if key in self.unsettled and not self._closing:
                self._to_resolve[key] = None
        if self._to_resolve and self._resolve_wakeup is not None:
            self._resolve_wakeup.set()
        mine.set_result(None)

    async def _store(self, job: _Job) -> JobResult:
        """Store ``job``'s blocks; a load of one of them started meanwhile waits for it."""
        keys = job.meta.keys
        assert self._loop is not None
        done: asyncio.Future[None] = self._loop.create_future()
        storing = self._storing
        for key in keys:
            storing[key] = done
        try:
            return await self._store_claimed(job)
        finally:
            for key in keys:
                if storing.get(key) is done:
                    del storing[key]
            done.set_result(None)

    async def _store_claimed(self, job: _Job) -> JobResult:
        keys = job.meta.keys
        mine = await self._claim(keys)
        batch = _Batch()
        now_present: list[OffloadKey] = []
        try:
            present = self.present
            todo = [i for i, key in enumerate(keys) if key not in present]
            if todo and self.shared:
                todo = await self._skip_present(keys, todo)
            started = time.monotonic()
            if todo:
                await self._transfer(job, todo, batch, load=False)
            elapsed = time.monotonic() - started
        finally:
            # Before releasing: unsettled keys get re-checked, and what the tier
            # evicted during this job is still known (``_release`` forgets it).
            now_present = self._settle_written(batch)
            self._release(keys, mine)
        written = batch.ok
        if now_present:
            # Only blocks still there: one the tier wrote and evicted within this
            # job was never announced, so it gets no removal event either.
            self._add_event(now_present, removed=False)
        nbytes = len(written) * self.block_bytes
        counters = self.counters
        counters.blocks_stored += len(written)
        counters.bytes_stored += nbytes
        counters.store_seconds += elapsed
        count_job_seconds(counters.store_seconds_counts, elapsed)
        failed = batch.errors
        ok_keys = frozenset(k for k in keys if k not in failed)
        if failed:
            return JobResult(
                job.meta.job_id,
                False,
                successful_keys=ok_keys,
                transfer_bytes=nbytes,
                transfer_time=elapsed,
                error=_describe_errors(failed, len(keys), "stored"),
            )
        return JobResult(
            job.meta.job_id,
            True,
            successful_keys=ok_keys,
            transfer_bytes=nbytes,
            transfer_time=elapsed,
        )

    def _settle_written(self, batch: _Batch) -> list[OffloadKey]:
        """Publish what a store's writes did: written keys present, the rest unsettled.

        Returns the written keys that are present now.
        """
        gone = self._removed_during_op
        now_present: list[OffloadKey] = []
        for key in batch.ok:
            if gone and key in gone:
                continue  # written, then evicted before the batch returned
            self._learn_present(key)
            self.unsettled.discard(key)
            self.absent_at.pop(key, None)
            now_present.append(key)
        # A write that raised or was cancelled left the block absent or complete;
        # ``contains`` will tell which.
        for key in batch.in_flight:
            self.unsettled.add(key)
        for key in batch.errors:
            self.unsettled.add(key)
        batch.in_flight.clear()
        return now_present

    async def _skip_present(self, keys: Sequence[OffloadKey], todo: list[int]) -> list[int]:
        """Shared tiers: drop keys another process already stored (errors: write anyway)."""
        candidates = [keys[i] for i in todo]
        found: list[bool] = []
        for start in range(0, len(candidates), self._max_batch):
            chunk = candidates[start : start + self._max_batch]
            await self._limiter.acquire(len(chunk))
            try:
                found.extend(await self.tier.contains_many(chunk))
            except Exception:
                found.extend([False] * len(chunk))
            finally:
                self._limiter.release(len(chunk))
        keep: list[int] = []
        for i, is_there in zip(todo, found, strict=True):
            if is_there:
                self._learn_present(keys[i])
                self.unsettled.discard(keys[i])
            else:
                keep.append(i)
        return keep

    async def _load(self, job: _Job) -> JobResult:
        keys = job.meta.keys
        storing = self._storing
        if storing:  # stores of these keys submitted before: they land first
            pending = {storing[k] for k in keys if k in storing}
            if pending:
                await asyncio.wait(pending)
        # A private tier's presence view is authoritative: a job with nothing to read
        # fails without I/O (a key with an operation in flight is judged once that
        # operation ends); one missing some keys loads the others (a partial result:
        # a block evicted since the lookup must not cost the rest of the promotion).
        missing = self._missing(keys, self._claims)
        if len(missing) == len(keys):
            return self._missing_result(job, missing)
        mine = await self._claim(keys)
        batch = _Batch()
        try:
            missing = self._missing(keys, {})
            if len(missing) == len(keys):
                return self._missing_result(job, missing)
            todo = list(range(len(keys)))
            if missing:
                absent = set(missing)
                todo = [i for i in todo if keys[i] not in absent]
                for key in missing:
                    batch.errors[key] = BlockNotFound(key)
            started = time.monotonic()
            await self._transfer(job, todo, batch, load=True)
            elapsed = time.monotonic() - started
            if batch.mismatched:
                await self._delete_mismatched(batch.mismatched)
        finally:
            self._release(keys, mine)
        loaded = batch.ok
        if self.shared:
            for key in loaded:
                self._learn_present(key)
                self.unsettled.discard(key)
        nbytes = len(loaded) * self.block_bytes
        counters = self.counters
        counters.blocks_loaded += len(loaded)
        counters.bytes_loaded += nbytes
        counters.load_seconds += elapsed
        count_job_seconds(counters.load_seconds_counts, elapsed)
        if batch.errors:
            self._forget_unreadable(batch.errors)
            return JobResult(
                job.meta.job_id,
                False,
                successful_keys=frozenset(loaded),
                transfer_bytes=nbytes,
                transfer_time=elapsed,
                error=_describe_errors(batch.errors, len(keys), "loaded"),
                only_missing_blocks=all(
                    isinstance(e, BlockNotFound) for e in batch.errors.values()
                ),
            )
        return JobResult(
            job.meta.job_id,
            True,
            successful_keys=frozenset(loaded),
            transfer_bytes=nbytes,
            transfer_time=elapsed,
        )

    async def _delete_mismatched(self, keys: list[OffloadKey]) -> None:
        """Delete blocks whose bytes differ from what this process stored (verify mode).

        A value someone else wrote over ours would otherwise be found again by
        every engine sharing the tier. Runs while the load still holds the keys.
        Best effort: a tier without ``delete`` keeps the value (this process
        still never serves it: the checksum stays). Another engine's rewrite
        landing between the read and the delete is deleted too, unless the
        tier's ``delete`` spares it (the Redis tier's does): one more miss,
        never a wrong hit. Cancellation (the job's deadline): stops deleting.
        """
        outcomes = await asyncio.gather(
            *(self.tier.delete(key) for key in keys), return_exceptions=True
        )
        failed = [o for o in outcomes if isinstance(o, BaseException)]
        if failed and not isinstance(failed[0], NotImplementedError):
            logger.warning(
                "tier %s: could not delete %d of %d block(s) that failed verification: %r",
                self.name,
                len(failed),
                len(keys),
                failed[0],
            )

    def _missing(self, keys: Sequence[OffloadKey], busy: object) -> list[OffloadKey]:
        """Keys a private tier certainly lacks (none for a shared tier: it must be asked)."""
        present = self.present
        if self.shared or present.issuperset(keys):
            return _NO_KEYS
        unsettled = self.unsettled
        return [
            k
            for k in keys
            if k not in present and k not in unsettled and k not in busy  # type: ignore[operator]
        ]

    def _missing_result(self, job: _Job, missing: list[OffloadKey]) -> JobResult:
        self.counters.missing_reads += len(missing)
        return JobResult(
            job.meta.job_id,
            False,
            successful_keys=frozenset(),
            error=f"{len(missing)} of {len(job.meta.keys)} blocks are not in tier {self.name} "
            f"(first: {missing[0].hex()})",
            only_missing_blocks=True,
        )

    def _forget_unreadable(self, errors: dict[OffloadKey, BaseException]) -> None:
        """Blocks that are missing or corrupt are gone for lookups (a miss, never a wrong hit)."""
        gone: list[OffloadKey] = []
        now = time.monotonic()
        for key, exc in errors.items():
            if isinstance(exc, CorruptBlock):
                self.counters.corrupt_reads += 1
            elif isinstance(exc, BlockNotFound):
                self.counters.missing_reads += 1
            else:
                continue
            if key in self.present:
                gone.append(key)
                self.present.discard(key)
            # The checksum stays: a key that failed verification must not be
            # served unverified by a later load (another writer's value may remain).
            self.unsettled.discard(key)
            if self.shared:
                self.absent_at[key] = now
        if gone:
            self.counters.blocks_removed += len(gone)
            self._add_event(gone, removed=True)

    def _failure(self, job: _Job, error: str) -> JobResult:
        return JobResult(job.meta.job_id, False, successful_keys=frozenset(), error=error)

    def _publish(self, job: _Job, result: JobResult) -> None:
        """Hand ``result`` to the scheduler thread (once per job) and count it."""
        if job.published:
            return
        job.published = True
        self.results.put(result)
        parts = getattr(self.tier, "parts_out_of_service", 0)
        self.counters.parts_out_of_service = parts if isinstance(parts, int) else 0
        if result.success:
            self.counters.jobs_succeeded += 1
        else:
            self.counters.jobs_failed += 1
            logger.log(
                # Blocks gone since the lookup: routine for a bounded or shared tier.
                logging.INFO if result.only_missing_blocks else logging.WARNING,
                "tier %s: %s job %d failed: %s",
                self.name,
                "load" if job.is_load else "store",
                job.meta.job_id,
                result.error,
            )
