"""The loop-thread side of a secondary tier: jobs, key claims, presence, resolution, events.

Everything here runs on the tier's event-loop thread, and this object is the
only writer of the state the scheduler thread reads without a lock (the
*published* state, safe to read under the GIL because each read is one
atomic operation on a set, dict or deque):

``present``      keys known to be readable in the tier (lookup True); for a shared
                 tier, recent knowledge (see :mod:`tiering.runtime.presence`)
``unsettled``    keys whose presence is being checked (lookup None)
``absent_at``    shared tiers: keys found absent, with when (lookup False for a while)
``events``       ``(keys, removed)`` pairs waiting for ``take_events``
``results``      finished ``JobResult`` objects waiting for ``get_finished``

Rules it enforces for every tier:

* at most ``tier.max_concurrency`` block operations at once (a weighted
  limiter; jobs are split into batch calls of at most that many keys);
* never two operations on the same key at once: a job *claims* its keys and
  waits for earlier claims on any of them. A load of a key whose store is in
  flight therefore waits for the store and then reads it (within the load's
  own deadline);
* every job has a deadline; at the deadline its operations are cancelled and
  it fails. A tier that ignores cancellation past ``cancel_grace_s`` is
  logged (it broke its contract), and its job is reported only when the
  operation really ends: until then it may still touch the job's primary
  rows, and a job stays in flight while any of its rows is still held;
* a key whose write did not end cleanly (error, cancellation) is *unsettled*:
  lookups answer None until ``contains`` says what is there.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from tiering.errors import BlockNotFound, CorruptBlock, PartialBatchError
from tiering.jobs import JobMetadata, JobResult
from tiering.keys import OffloadKey
from tiering.runtime.digests import StoredDigests, block_checksum
from tiering.runtime.limiter import BlockLimiter
from tiering.runtime.presence import KnownPresent
from tiering.runtime.stats import TierCounters, count_job_seconds
from tiering.tier import AsyncTier, TierContext

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


class TierService:
    """Runs one :class:`AsyncTier` on the current event loop for a facade (loop thread only)."""

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

    # -- life cycle --------------------------------------------------------------------------

    async def open(self, context: TierContext) -> None:
        """Open the tier and seed the presence view from ``list_keys``.

        Cancellation (open deadline): propagates; the facade then closes the tier.
        """
        self._loop = asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._resolve_wakeup = asyncio.Event()
        self.tier._bind_removed_sink(self._on_removed)
        await self.tier.open(context)
        for count, key in enumerate(await self.tier.list_keys(), 1):
            self._learn_present(key)
            if count % 65536 == 0:
                await asyncio.sleep(0)  # a big recovered index must not stall the loop
        self._resolver = self._loop.create_task(
            self._resolve_forever(), name=f"{self.name}-resolve"
        )

    async def close_tier_only(self, timeout_s: float) -> None:
        """Close the tier after a failed open (bounded). Cancellation: abandons the close."""
        try:
            await asyncio.wait_for(self.tier.aclose(), max(0.001, timeout_s))
        except Exception:
            logger.exception("tier %s: aclose after a failed open raised", self.name)

    async def aclose(self, budget_s: float) -> None:
        """Drain in-flight jobs, cancel what is left, stop helpers, close the tier.

        Half of ``budget_s`` goes to letting jobs finish, the rest to
        cancellation and ``tier.aclose``. Cancellation: stops waiting; the
        loop thread's own close then cancels what is left.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        self._closing = True
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=budget_s / 2)
            for task in pending:
                task.cancel()
            if pending:
                grace = max(0.001, min(self.cancel_grace_s, (deadline - loop.time()) / 2))
                await asyncio.wait(pending, timeout=grace)
        # Jobs still running ignored cancellation: report them failed now.
        for job in list(self._jobs.values()):
            self._publish(job, self._failure(job, f"cancelled: tier {self.name} shut down"))
        helpers = [t for t in (self._resolver, self._toucher) if t is not None and not t.done()]
        for task in helpers:
            task.cancel()
        if helpers:
            await asyncio.wait(helpers, timeout=max(0.001, min(1.0, deadline - loop.time())))
        try:
            await asyncio.wait_for(self.tier.aclose(), max(0.001, deadline - loop.time()))
        except TimeoutError:
            logger.error("tier %s: aclose did not finish within the shutdown budget", self.name)
        except Exception:
            logger.exception("tier %s: aclose raised", self.name)

    # -- entry points from the mailbox (loop thread) ----------------------------------------

    def start_job(self, job: _Job) -> None:
        """Start a job handed over by the scheduler thread."""
        loop = self._loop
        assert loop is not None
        if self._closing:
            self._publish(job, self._failure(job, f"cancelled: tier {self.name} shut down"))
            return
        self._jobs[job.meta.job_id] = job
        job.task = loop.create_task(self._run_job(job))
        # Relative to now: the deadline is on time.monotonic(), whatever clock the loop uses.
        job.timer = loop.call_later(max(0.0, job.deadline - time.monotonic()), self._expire, job)

    def request_resolve(self, key: OffloadKey) -> None:
        """Find out whether ``key`` is in the (shared) tier; the lookup view gets the answer."""
        if key in self.present or self._closing:
            return
        self.unsettled.add(key)
        self._to_resolve[key] = None
        assert self._resolve_wakeup is not None
        self._resolve_wakeup.set()

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Queue keys for ``tier.touch`` (batched; metadata only, so it takes no claims)."""
        if self._closing:
            return
        self._to_touch.extend(keys)
        if self._toucher is None or self._toucher.done():
            assert self._loop is not None
            self._toucher = self._loop.create_task(self._touch_all(), name=f"{self.name}-touch")

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

    def _failure(self, job: _Job, error: str) -> JobResult:
        return JobResult(job.meta.job_id, False, successful_keys=frozenset(), error=error)

    def _publish(self, job: _Job, result: JobResult) -> None:
        """Hand ``result`` to the scheduler thread (once per job) and count it."""
        if job.published:
            return
        job.published = True
        self.results.put(result)
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

    # -- presence resolution, touch, removals ---------------------------------------------

    async def _resolve_forever(self) -> None:
        """Answer ``contains`` for unsettled keys in batches; age a shared tier's answers.

        Cancellation: stops (shutdown).
        """
        wakeup = self._resolve_wakeup
        assert wakeup is not None
        present = self.present
        period = None if present.ttl_s is None else max(0.01, present.ttl_s / 4)
        while True:
            if period is None:
                await wakeup.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(period):
                        await wakeup.wait()
                # Aged answers are asked again; checksums stay (see StoredDigests).
                present.expire()
            wakeup.clear()
            while self._to_resolve:
                await self._resolve_some()

    def _learn_present(self, key: OffloadKey) -> None:
        """``key`` is readable in the tier (a shared tier may forget older answers for room).

        Forgotten answers are asked again when needed; their checksums stay.
        """
        self.present.add(key)

    async def _resolve_some(self) -> None:
        batch: list[OffloadKey] = []
        for key in list(self._to_resolve):
            del self._to_resolve[key]
            if key in self._claims:
                continue  # the operation holding it settles it (and re-queues if still unsure)
            if key not in self.unsettled:
                continue
            batch.append(key)
            if len(batch) == _RESOLVE_BATCH:
                break
        if not batch:
            return
        assert self._loop is not None
        mine = self._loop.create_future()
        for key in batch:
            self._claims[key] = mine
        answers: list[bool] | None = None
        try:
            async with asyncio.timeout(self.job_timeout_s):
                answers = await self._contains_all(batch)
        except Exception as exc:
            logger.warning(
                "tier %s: checking presence of %d blocks failed (%r); treating them as absent",
                self.name,
                len(batch),
                exc,
            )
        finally:
            self._settle_resolved(batch, answers)
            for key in batch:
                if self._claims.get(key) is mine:
                    del self._claims[key]
            mine.set_result(None)

    async def _contains_all(self, keys: list[OffloadKey]) -> list[bool]:
        answers: list[bool] = []
        for start in range(0, len(keys), self._max_batch):
            chunk = keys[start : start + self._max_batch]
            await self._limiter.acquire(len(chunk))
            try:
                answers.extend(await self.tier.contains_many(chunk))
            finally:
                self._limiter.release(len(chunk))
        return answers

    def _settle_resolved(self, keys: list[OffloadKey], answers: list[bool] | None) -> None:
        now = time.monotonic()
        if self.shared:
            self._prune_absent(now)
        for i, key in enumerate(keys):
            self.unsettled.discard(key)
            if answers is not None and answers[i]:
                self._learn_present(key)
                self.absent_at.pop(key, None)
            else:
                self.present.discard(key)
                if self.shared:
                    self.absent_at.pop(key, None)  # re-insert at the end (pruning order)
                    self.absent_at[key] = now

    def _prune_absent(self, now: float) -> None:
        """Drop expired absent answers (oldest first: the dict is in insertion order)."""
        absent_at = self.absent_at
        horizon = now - self.shared_absent_ttl_s
        expired = []
        for key, when in absent_at.items():
            if when >= horizon:
                break
            expired.append(key)
        for key in expired:
            del absent_at[key]

    async def _touch_all(self) -> None:
        """Forward queued touches in batches. Cancellation: stops (shutdown)."""
        while self._to_touch:
            keys, self._to_touch = self._to_touch, []
            if not self.shared:
                keys = [k for k in keys if k in self.present]
            if not keys:
                continue
            try:
                async with asyncio.timeout(self.job_timeout_s):  # inline: keeps mailbox order
                    await self.tier.touch(keys)
            except Exception as exc:
                logger.warning("tier %s: touch of %d blocks failed: %r", self.name, len(keys), exc)

    def _on_removed(self, keys: Sequence[OffloadKey]) -> None:
        """The tier's ``report_removed``: the blocks are gone for lookups; emit an event."""
        if threading.get_ident() != self._thread_id and self._loop is not None:
            # Misplaced call (e.g. from an executor thread): move it to the loop.
            self._loop.call_soon_threadsafe(self._on_removed, list(keys))
            return
        now = time.monotonic()
        removed = [k for k in keys if k in self.present]
        claims = self._claims
        # A private tier's removed key can only come back through our own store; a
        # shared tier's may come back written by anyone, so its checksum stays.
        digests = None if self.shared else self._digests
        for key in keys:
            self.present.discard(key)
            if digests is not None:
                digests.forget(key)
            if key in claims:  # e.g. evicted by a later write of the same batch
                self._removed_during_op.add(key)
            if self.shared:
                self.absent_at[key] = now
        if removed:
            self.counters.blocks_removed += len(removed)
            self._add_event(removed, removed=True)

    def _add_event(self, keys: list[OffloadKey], *, removed: bool) -> None:
        if len(self.events) >= self.max_events:
            self.counters.events_dropped += len(keys)
            return
        self.events.append((keys, removed))


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
