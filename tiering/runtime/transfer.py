"""Block transfers of a tier's loop-thread service: batch calls, row views, verification.

Owns the I/O of one job: splitting its blocks into ``read_many`` /
``write_many`` calls of at most ``max_concurrency`` keys under the weighted
limiter, handing the tier memoryviews of the primary rows and taking them back
(a job ends only once nothing holds a row), and checking loaded blocks
against the checksums taken when they were stored.
"""

from __future__ import annotations

import asyncio

from tiering.core.errors import CorruptBlock, PartialBatchError
from tiering.core.keys import OffloadKey
from tiering.runtime.digests import block_checksum
from tiering.runtime.resolver import _PresenceKeeping
from tiering.runtime.service_state import _Batch, _Job, _release_views, logger


class _Transfers(_PresenceKeeping):
    """Block transfers (a part of ``TierService``)."""

    async def _transfer(self, job: _Job, indices: list[int], batch: _Batch, *, load: bool) -> None:
        """Move the blocks ``indices`` of ``job`` in batch calls of at most ``max_concurrency``.

        Cancellation: cancels every batch call; ``batch.in_flight`` then holds
        the keys whose operation was interrupted.
        """
        step = self._max_batch
        if len(indices) <= step:
            await self._transfer_chunk(job, indices, batch, load)
            return
        chunks = [indices[i : i + step] for i in range(0, len(indices), step)]
        await asyncio.gather(*(self._transfer_chunk(job, c, batch, load) for c in chunks))

    async def _transfer_chunk(
        self, job: _Job, indices: list[int], batch: _Batch, load: bool
    ) -> None:
        """One ``read_many``/``write_many`` call; records outcomes in ``batch``, never raises.

        With verification on, a store records each block's checksum (taken
        from the primary row, which the job pins) and a load compares the
        bytes it read against it. Cancellation: propagates after recording
        the interrupted keys.
        """
        all_keys, all_rows = job.meta.keys, job.rows
        if len(indices) == len(all_keys):  # the common case: the whole job in one call
            keys, row_ids = list(all_keys), all_rows
        else:
            keys, row_ids = [all_keys[i] for i in indices], [all_rows[i] for i in indices]
        await self._limiter.acquire(len(keys))
        flat, size = self._flat, self.block_bytes
        rows = [flat[r * size : r * size + size] for r in row_ids]
        if self.verify and not load:
            # Whatever the write's outcome, a block under these keys can only hold
            # these bytes (a failed or cancelled write leaves it absent or complete).
            self._digests.record(keys, rows)
        if not load:
            batch.in_flight.update(keys)
        ok: list[OffloadKey] | None = None
        try:
            if load:
                await self.tier.read_many(keys, rows)
            else:
                await self.tier.write_many(keys, rows)
        except PartialBatchError as exc:
            ok = []
            for key in keys:
                if key in exc.errors:
                    batch.errors[key] = exc.errors[key]
                elif key in exc.succeeded:
                    ok.append(key)
                else:
                    batch.errors[key] = RuntimeError("the tier reported no outcome for this key")
        except asyncio.CancelledError:
            self._limiter.release(len(keys))
            await self._let_go(job, rows)
            raise
        except Exception as exc:
            ok = []
            for key in keys:
                batch.errors[key] = exc
        else:
            ok = keys
        try:
            if self.verify and ok and load:
                ok = self._verified(keys, rows, ok, batch)
        finally:
            self._limiter.release(len(keys))
            await self._let_go(job, rows)
        batch.ok.extend(ok)
        if not load:
            batch.in_flight.difference_update(keys)
        job.done_keys += len(keys)

    async def _let_go(self, job: _Job, rows: list[memoryview]) -> None:
        """Release the job's row views, waiting while anything still holds one.

        A tier call can return (or be cancelled) while a thread it started
        still reads or writes a row, e.g. a cancelled ``await
        asyncio.to_thread(os.preadv, ...)``: the row is exported until that
        thread ends. The job must not end before, or its rows would be reused
        under the thread. Cancellation: stops waiting (shutdown).
        """
        held = _release_views(rows)
        if not held:
            return
        logger.error(
            "tier %s: job %d: a buffer of a primary row is still in use after the tier's call "
            "ended (a thread it started, or a view it kept); the job ends when it is released",
            self.name,
            job.meta.job_id,
        )
        delay = 0.0005
        while held:
            await asyncio.sleep(delay)
            delay = min(2 * delay, 0.05)
            held = _release_views(held)

    def _verified(
        self,
        keys: list[OffloadKey],
        rows: list[memoryview],
        ok: list[OffloadKey],
        batch: _Batch,
    ) -> list[OffloadKey]:
        """The keys of ``ok`` whose bytes match their stored checksum; the rest become errors.

        Keys with no checksum (found by ``list_keys`` or stored by another
        process) are trusted to the tier's own checks. Mismatches are also
        listed in ``batch.mismatched`` (the load deletes them from the tier).
        """
        digests = self._digests
        read_ok = set(ok) if len(ok) != len(keys) else None
        good: list[OffloadKey] = []
        for key, row in zip(keys, rows, strict=True):
            if read_ok is not None and key not in read_ok:
                continue
            expected = digests.get(key)
            if expected is not None and block_checksum(row) != expected:
                batch.errors[key] = CorruptBlock(
                    key, "the bytes read back differ from those stored (checksum mismatch)"
                )
                batch.mismatched.append(key)
            else:
                good.append(key)
        return good
