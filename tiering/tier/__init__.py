"""``AsyncTier``: the class a tier author subclasses.

A tier is a coroutine service over its own medium (files, a key-value server,
memory...). The framework runs it on a dedicated event-loop thread and does
everything else: job ids, primary-buffer rows, pins, deadlines, bounding
concurrency, results, presence bookkeeping for lookups, and events.

The implementor's contract
--------------------------
**Construction.** ``__init__`` only validates and stores options (raise
:class:`~tiering.core.errors.ConfigError` for bad ones); it runs on the caller's
thread before the tier's loop exists, so it must not touch a loop, connect or
do I/O. :meth:`AsyncTier.open` does that, on the tier's loop.

**Thread.** Every method of a tier is called on the tier's own event-loop
thread, never concurrently with ``open``/``aclose``, and may be called
concurrently with itself for *different* keys (up to ``max_concurrency``
operations at once). The framework never issues two operations on the same
key at once. Nothing a tier does may block the loop: use native async clients,
``loop.add_reader`` style I/O, or :meth:`AsyncTier.run_in_thread` for
blocking calls. The loop is asyncio run by anyio, so a tier may use anyio's
structured concurrency too (task groups, cancel scopes, ``move_on_after``,
``fail_after``, ``anyio.to_thread``) as well as asyncio's.

**Buffers.** ``data`` (``write``) and ``into`` (``read``) are memoryviews of
exactly ``block_bytes`` bytes, usually rows of the primary tier's host
buffer. They are valid only until the coroutine returns (or is cancelled):
never keep a reference. A ``read`` fills all of ``into`` or raises. If you
hand a buffer to a thread (``asyncio.to_thread``) or to the kernel
(io_uring), do not return, and do not let a cancellation propagate, until that
work has stopped touching the buffer: cancelling an ``await`` does not stop a
thread, and the row may be reused for another block the moment your
coroutine ends. :meth:`AsyncTier.run_in_thread` does this for a blocking call
(``await self.run_in_thread(os.preadv, fd, [into], offset)``), in at most
``max_threads`` threads at once; for io_uring, wait for the completion (or a
successful cancel) of every submitted entry.

**Cancellation.** Any coroutine may be cancelled (deadline expiry, shutdown).
A cancelled ``write`` must never leave a readable partial block: make the
block visible (to ``contains``/``read``) only once all its bytes are durable
in the medium. A cancelled ``read`` may leave ``into`` partly written; the
framework discards it.

**Errors.** Raise, never return sentinels. A missing block raises
:class:`~tiering.core.errors.BlockNotFound`; bytes that fail verification raise
:class:`~tiering.core.errors.CorruptBlock`; anything else (``OSError``,
``TimeoutError``, a client's error) propagates. The framework turns every
error into a failed job, a counter and one log line; a failed load is a miss.

**Evictions.** A bounded tier that drops blocks on its own (eviction,
corruption found, server-side expiry) calls :meth:`AsyncTier.report_removed`
so lookups stop answering True for them.

**What the runtime does with it** (:class:`tiering.runtime.AsyncTierManager`).
After ``open`` it calls ``list_keys`` once to learn what is stored; from then
on, for a tier with ``shared = False``, its own record of writes, removals and
failed reads is authoritative: a lookup never reaches the tier, and a load of
a key it does not know fails without calling ``read``. With ``shared = True``
unknown keys are asked with ``contains_many`` (batched across lookups), a
store first skips keys ``contains_many`` finds, and a present key whose read
raises ``BlockNotFound`` becomes a miss. Jobs reach the tier as ``read_many``
/ ``write_many`` calls of at most ``max_concurrency`` keys; override those to
batch for real (one round trip, one submission). A key whose ``write`` raised
or was cancelled is checked with ``contains`` before lookups see it again.
``touch`` is metadata only: it may run while a data operation on the same key
is in flight. Unless the tier sets ``verifies_reads = True``, the runtime
keeps an xxh3 checksum of every block it stored and fails a load whose bytes
do not match (a ``CorruptBlock`` miss). An ``int`` attribute
``capacity_blocks`` (most blocks held) is
reported in the runtime's statistics when present, and so is
``parts_out_of_service`` (a tier made of parts - drives, shards - that is
serving without some of them; read on the loop thread after each job). Check a tier with
:func:`tiering.testing.conformance.check_tier`.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import anyio
import anyio.to_thread

from tiering.core.errors import PartialBatchError
from tiering.core.keys import OffloadKey


@dataclass(frozen=True, slots=True)
class TierContext:
    """What the framework tells a tier when it opens it.

    ``block_bytes`` is the size of every block. ``layout_fingerprint`` names
    the KV layout (model, dtype, geometry, block size): a persistent tier must
    never serve bytes written under another fingerprint. ``name`` is the
    tier's label in logs and metrics.
    """

    block_bytes: int
    layout_fingerprint: str = ""
    name: str = "tier"


class AsyncTier:
    """Base class of every secondary tier (see the module docstring for the contract).

    Required: :meth:`contains`, :meth:`read`, :meth:`write`. Optional with
    defaults: :meth:`open`, :meth:`delete`, :meth:`contains_many`,
    :meth:`read_many`, :meth:`write_many`, :meth:`list_keys`, :meth:`touch`,
    :meth:`aclose`.
    """

    #: Most operations the framework runs on this tier at once.
    max_concurrency: int = 16
    #: True when other processes may add or drop blocks behind this tier's
    #: back (shared storage): lookups of unknown keys are then resolved with
    #: ``contains_many`` instead of being answered False from local knowledge.
    shared: bool = False
    #: True when ``read`` itself detects damaged or truncated blocks (e.g. a
    #: checksum kept in the medium) and raises ``CorruptBlock``. Otherwise the
    #: runtime checksums every block it stores and verifies it when loaded.
    verifies_reads: bool = False
    #: Most threads :meth:`run_in_thread` occupies at once for this tier
    #: (one ``anyio.CapacityLimiter`` per tier); ``None``: ``max_concurrency``.
    max_threads: int | None = None
    #: What the tier stores blocks on: ``"STORAGE"`` (disks, remote stores) or ``"CPU"``
    #: (host memory). The default of its config's ``medium`` key, which requests'
    #: ``kv_load_tiers`` / ``kv_store_tiers`` match (:mod:`tiering.manager.filters`).
    medium: str = "STORAGE"

    _context: TierContext | None = None
    _thread_limiter: anyio.CapacityLimiter | None = None
    _removed_sink: Callable[[Sequence[OffloadKey]], None] | None = None

    @classmethod
    def check_options(cls, options: Mapping[str, object]) -> None:
        """Check option values when the spec is built, before anything is allocated.

        Optional (the default checks nothing; the constructor still checks
        every value). Override it for what a user should learn at spec
        construction rather than at engine start; raise
        :class:`~tiering.core.errors.ConfigError` naming the option. Runs on the
        caller's thread and must not touch the outside world (no files
        created, no connections).
        """

    @property
    def context(self) -> TierContext:
        """The context given to :meth:`open` (raises before it)."""
        if self._context is None:
            raise RuntimeError(f"{type(self).__name__} has not been opened")
        return self._context

    @property
    def block_bytes(self) -> int:
        return self.context.block_bytes

    async def open(self, context: TierContext) -> None:
        """Prepare the medium (connect, create or recover files). Called once, first.

        Override to do real work; call ``await super().open(context)`` first.
        A failure here fails the tier's construction with the same exception.
        Cancellation: the framework cancels a hung ``open`` at its deadline and
        then calls ``aclose``.
        """
        self._context = context

    async def contains(self, key: OffloadKey) -> bool:
        """Whether ``key``'s block is fully written and readable.

        Cancellation: no side effects, safe to cancel at any point.
        """
        raise NotImplementedError

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        """Copy ``key``'s block into ``into`` (exactly ``block_bytes`` bytes).

        Raises :class:`~tiering.core.errors.BlockNotFound` if absent and
        :class:`~tiering.core.errors.CorruptBlock` if its bytes fail verification.
        Cancellation: ``into`` may be left partly written; it is discarded.
        """
        raise NotImplementedError

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """Store ``data`` as ``key``'s block, replacing any previous one.

        Bounded tiers evict (and :meth:`report_removed`) to make room.
        Cancellation: the block must be either absent or complete afterwards,
        never readable with partial bytes.
        """
        raise NotImplementedError

    async def delete(self, key: OffloadKey) -> None:
        """Drop ``key``'s block if present (no error if absent).

        Default: not supported (raises ``NotImplementedError``).
        Cancellation: the block is either still present and intact, or gone.
        """
        raise NotImplementedError(f"{type(self).__name__} does not support delete")

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark blocks recently used for the tier's eviction policy. Default: nothing."""

    async def list_keys(self) -> Iterable[OffloadKey]:
        """Keys readable right after :meth:`open` (e.g. recovered from disk). Default: none.

        The framework calls it once after ``open`` to seed the presence view
        that answers lookups without a round trip.
        """
        return ()

    async def contains_many(self, keys: Sequence[OffloadKey]) -> list[bool]:
        """``contains`` for several keys at once (one round trip where the medium allows).

        Default: ``contains`` for each key, at most ``max_concurrency`` at once;
        the first error raised by any of them propagates. Cancellation: the
        pending checks are cancelled; no side effects.
        """
        outcomes = await _run_bounded(
            [functools.partial(self.contains, k) for k in keys], self.max_concurrency
        )
        answers: list[bool] = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                raise outcome
            answers.append(outcome)
        return answers

    async def read_many(self, keys: Sequence[OffloadKey], into: Sequence[memoryview]) -> None:
        """``read`` for several keys; batch it where the medium allows.

        Raises :class:`~tiering.core.errors.PartialBatchError` naming the keys that
        succeeded and the error of each one that failed. Default: ``read`` for
        each key concurrently. Cancellation: as for ``read``.
        """
        pairs = list(zip(keys, into, strict=True))
        await _run_batch(
            keys, [functools.partial(self.read, k, b) for k, b in pairs], self.max_concurrency
        )

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        """``write`` for several keys; batch it where the medium allows.

        Raises :class:`~tiering.core.errors.PartialBatchError` like ``read_many``.
        Cancellation: as for ``write``, per block.
        """
        pairs = list(zip(keys, data, strict=True))
        await _run_batch(
            keys, [functools.partial(self.write, k, d) for k, d in pairs], self.max_concurrency
        )

    async def aclose(self) -> None:
        """Release connections, files and tasks. Called once, last; must be idempotent.

        Cancellation: the framework gives it a bounded time, then abandons it.
        """

    # -- provided to tiers by the framework -------------------------------------------------

    def report_removed(self, keys: Sequence[OffloadKey]) -> None:
        """Tell the framework these blocks are gone (evicted, corrupt, expired).

        Call it from the tier's own loop thread; cheap, never blocks.
        """
        if self._removed_sink is not None and keys:
            self._removed_sink(keys)

    @property
    def thread_limiter(self) -> anyio.CapacityLimiter:
        """The ``anyio.CapacityLimiter`` bounding this tier's threads (``max_threads`` tokens).

        Created on first use; pass it to ``anyio.to_thread.run_sync(...,
        limiter=)`` to share the bound with :meth:`run_in_thread`.
        """
        if self._thread_limiter is None:
            bound = self.max_concurrency if self.max_threads is None else self.max_threads
            self._thread_limiter = anyio.CapacityLimiter(max(1, bound))
        return self._thread_limiter

    async def run_in_thread(self, fn: Callable[..., T], *args: object) -> T:
        """Run blocking ``fn(*args)`` in a worker thread, at most ``max_threads`` at once.

        :func:`run_in_thread` with this tier's :attr:`thread_limiter`.
        Cancellation: waits for ``fn`` to return, then raises ``CancelledError``.
        """
        return await run_in_thread(fn, *args, limiter=self.thread_limiter)

    def _bind_removed_sink(self, sink: Callable[[Sequence[OffloadKey]], None]) -> None:
        """Framework hook: where :meth:`report_removed` delivers (the runtime sets it)."""
        self._removed_sink = sink


T = TypeVar("T")


async def run_in_thread(
    fn: Callable[..., T], *args: object, limiter: anyio.CapacityLimiter | None = None
) -> T:
    """Run blocking ``fn(*args)`` in an anyio worker thread and return its result.

    ``anyio.to_thread.run_sync`` under ``limiter`` (default: anyio's
    process-wide limiter of 40 threads; a tier passes its own, see
    :meth:`AsyncTier.run_in_thread`). For tier operations that pass a block
    buffer to a blocking call: a cancellation waits for the thread to finish
    before propagating, so the buffer is never touched after the operation
    ended (see "Buffers" in this module's contract). anyio's own
    ``abandon_on_cancel=False`` holds against anyio cancel scopes but not
    against a plain ``Task.cancel()``, which is how the runtime cancels a job
    at its deadline (the cancelled await returned while the thread still
    ran), hence the shield around it. Cancellation: waits for ``fn`` to
    return, then raises ``CancelledError``.
    """
    work = asyncio.ensure_future(anyio.to_thread.run_sync(fn, *args, limiter=limiter))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        # anyio cancel scopes re-deliver their cancellation on every loop turn; the shielded
        # scope stops that, the loop absorbs repeated Task.cancel() calls.
        with anyio.CancelScope(shield=True):
            while not work.done():
                try:
                    await asyncio.wait([work])
                except asyncio.CancelledError:
                    continue
        if not work.cancelled():
            work.exception()  # retrieved: the cancellation is what propagates
        raise


async def _run_bounded(
    operations: Sequence[Callable[[], Awaitable[T]]], max_concurrency: int
) -> list[T | Exception]:
    """Run ``operations`` with at most ``max_concurrency`` in flight; one outcome per operation.

    Operations are started lazily by a fixed set of worker tasks, so a
    cancelled batch never leaves a created-but-never-awaited coroutine behind
    and a batch of 10,000 keys does not create 10,000 tasks. An operation's
    ``Exception`` becomes its outcome; cancellation cancels every worker (the
    task group) and propagates.
    """
    outcomes: dict[int, T | Exception] = {}
    indices = iter(range(len(operations)))

    async def worker() -> None:
        for i in indices:
            try:
                outcomes[i] = await operations[i]()
            except Exception as exc:
                outcomes[i] = exc

    num_workers = min(max(1, max_concurrency), len(operations))
    async with asyncio.TaskGroup() as group:
        for _ in range(num_workers):
            group.create_task(worker())
    return [outcomes[i] for i in range(len(operations))]


async def _run_batch(
    keys: Sequence[OffloadKey],
    operations: Sequence[Callable[[], Awaitable[None]]],
    max_concurrency: int,
) -> None:
    """Run one operation per key, at most ``max_concurrency`` at once; collect failures."""
    outcomes = await _run_bounded(operations, max_concurrency)
    errors: dict[bytes, BaseException] = {}
    succeeded: list[bytes] = []
    for key, outcome in zip(keys, outcomes, strict=True):
        if isinstance(outcome, BaseException):
            errors[key] = outcome
        else:
            succeeded.append(key)
    if errors:
        raise PartialBatchError(succeeded, errors)
