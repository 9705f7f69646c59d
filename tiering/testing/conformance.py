"""The tier conformance kit: the generic behaviour suite every tier must pass.

One call runs it against any tier factory (a callable returning a fresh,
unopened :class:`~tiering.tier.AsyncTier`, sync or async)::

    report = await check_tier(lambda: MyTier(root=tmp_dir))
    report.raise_for_failures()        # AssertionError listing every failed check

or, in a pytest module, one line generates one test function per check::

    from tiering.testing.conformance import conformance_tests
    globals().update(conformance_tests(lambda tmp_path: MyTier(root=tmp_path)))

The factory's parameters become the generated tests' parameters, so pytest
fixtures (``tmp_path``, a server fixture...) are injected by name. Generated
tests are plain synchronous functions (each runs its check under
``asyncio.run``), so they need no pytest-asyncio.

Each check gets fresh tiers from the factory and random keys, so checks never
see each other's blocks even on a shared medium. The checks (:data:`CHECKS`):

``round_trip``            bytes written are the bytes read; ``contains`` agrees.
``missing_key``           ``read`` of an absent key raises ``BlockNotFound``.
``overwrite``             a second write replaces the block.
``concurrent_distinct_keys``  ``max_concurrency`` writes and reads at once, and
                          the batch forms, all keep every key's own bytes.
``batch_partial_failure`` ``read_many`` with an absent key raises
                          ``PartialBatchError`` naming what succeeded and failed.
``delete``                a deleted block is gone; deleting an absent key is no
                          error (skipped when the tier does not support delete).
``cancelled_write``       a write cancelled at any point leaves the block absent
                          or complete, never readable with partial bytes (also
                          for an overwrite: old or new bytes, nothing else).
``cancelled_read``        a read cancelled at any point leaves the stored block intact,
                          and nothing writes into its buffer once it has ended.
``buffers_released_after_write``  once a write returned or was cancelled, its
                          source buffer is the caller's: reusing it at once never
                          changes what the tier stores.
``touch_and_list``        ``touch`` of present and absent keys is no error;
                          ``list_keys`` returns keys.
``close_idempotent``      ``aclose`` twice is no error.
``persistence``           (with ``persistent=True``) a block written before
                          ``aclose`` is listed and readable by a new tier.
``loop_not_blocked``      a ticker task keeps running during a burst of
                          operations: the tier never blocks the event loop for
                          more than ``max_loop_lag_s``.
``deadline_through_facade``  through :class:`~tiering.runtime.AsyncTierManager`,
                          a job whose operation hangs fails cleanly at its
                          deadline, and the next jobs still round-trip bytes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import inspect
import os
import time
import traceback
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tiering.errors import BlockNotFound, PartialBatchError
from tiering.keys import OffloadKey, make_offload_key
from tiering.tier import AsyncTier, TierContext

#: Returns a fresh, unopened tier (sync or async). See :func:`check_tier`.
TierFactory = Callable[[], AsyncTier | Awaitable[AsyncTier]]


@dataclass(frozen=True)
class KitOptions:
    """How the kit exercises a tier.

    ``block_bytes``: block size used by every check. ``layout_fingerprint``:
    given to ``open``. ``persistent``: run the ``persistence`` check (the
    factory must return tiers over the same medium). ``max_loop_lag_s``: the
    longest the loop may stall in ``loop_not_blocked`` (generous: it catches
    blocking calls, not slow machines). ``concurrency``: parallel operations
    in the concurrency checks (default: the tier's ``max_concurrency``, at
    most 64). ``job_timeout_s``: the deadline used in
    ``deadline_through_facade``.
    """

    block_bytes: int = 16384
    layout_fingerprint: str = "conformance-kit"
    persistent: bool = False
    max_loop_lag_s: float = 0.5
    concurrency: int | None = None
    job_timeout_s: float = 0.3


@dataclass(frozen=True)
class CheckOutcome:
    """One check's result: ``passed``, or the failure's one-line reason and traceback."""

    name: str
    passed: bool
    skipped: bool = False
    detail: str = ""
    seconds: float = 0.0


@dataclass
class ConformanceReport:
    """Outcomes of every check run (see :func:`check_tier`)."""

    tier_name: str
    outcomes: list[CheckOutcome] = field(default_factory=list)

    @property
    def failures(self) -> list[CheckOutcome]:
        return [o for o in self.outcomes if not o.passed]

    @property
    def ok(self) -> bool:
        return not self.failures

    def raise_for_failures(self) -> None:
        """Raise ``AssertionError`` listing every failed check (nothing if all passed)."""
        if self.failures:
            raise AssertionError(str(self))

    def __str__(self) -> str:
        lines = [f"conformance of {self.tier_name}:"]
        for o in self.outcomes:
            status = "skip" if o.skipped else ("ok" if o.passed else "FAIL")
            first = o.detail.strip().splitlines()[-1] if o.detail.strip() else ""
            lines.append(f"  {status:4} {o.name:26} {o.seconds * 1e3:7.1f} ms  {first}")
        return "\n".join(lines)


class _Skip(Exception):
    """Raised by a check that does not apply to this tier."""


class _Kit:
    """Per-run state shared by the checks: options, factory and key/data generation."""

    def __init__(self, factory: TierFactory, options: KitOptions) -> None:
        self.factory = factory
        self.options = options
        self._run_id = os.urandom(8)
        self._counter = 0

    def key(self) -> OffloadKey:
        """A key no other check of any run uses."""
        self._counter += 1
        return make_offload_key(self._run_id + self._counter.to_bytes(8, "big"), 0)

    def data(self) -> bytearray:
        return bytearray(os.urandom(self.options.block_bytes))

    def context(self) -> TierContext:
        return TierContext(
            block_bytes=self.options.block_bytes,
            layout_fingerprint=self.options.layout_fingerprint,
            name="conformance",
        )

    async def new_tier(self, *, open_it: bool = True) -> AsyncTier:
        made = self.factory()
        tier = await made if inspect.isawaitable(made) else made
        if not isinstance(tier, AsyncTier):
            raise TypeError(f"the factory returned {type(tier).__name__}, not an AsyncTier")
        if open_it:
            await tier.open(self.context())
        return tier

    def concurrency(self, tier: AsyncTier) -> int:
        if self.options.concurrency is not None:
            return self.options.concurrency
        return max(2, min(64, tier.max_concurrency))

    async def read_back(self, tier: AsyncTier, key: OffloadKey) -> bytes:
        into = bytearray(self.options.block_bytes)
        await tier.read(key, memoryview(into))
        return bytes(into)


def _check(fn: Callable[[_Kit, AsyncTier], Awaitable[None]]) -> Callable[[_Kit], Awaitable[None]]:
    """Wrap a check taking an opened tier: open a fresh tier, run, always close it."""

    @functools.wraps(fn)
    async def run(kit: _Kit) -> None:
        tier = await kit.new_tier()
        try:
            await fn(kit, tier)
        finally:
            await tier.aclose()

    return run


@_check
async def _round_trip(kit: _Kit, tier: AsyncTier) -> None:
    key, data = kit.key(), kit.data()
    await tier.write(key, memoryview(data))
    assert await tier.contains(key), "contains() is False right after write()"
    assert await kit.read_back(tier, key) == data, "read() returned other bytes than written"
    assert await tier.contains_many([key, kit.key()]) == [True, False], "contains_many() wrong"


@_check
async def _missing_key(kit: _Kit, tier: AsyncTier) -> None:
    key = kit.key()
    assert not await tier.contains(key), "contains() is True for a key never written"
    try:
        await kit.read_back(tier, key)
    except BlockNotFound:
        return
    raise AssertionError("read() of an absent key did not raise BlockNotFound")


@_check
async def _overwrite(kit: _Kit, tier: AsyncTier) -> None:
    key, first, second = kit.key(), kit.data(), kit.data()
    await tier.write(key, memoryview(first))
    await tier.write(key, memoryview(second))
    assert await kit.read_back(tier, key) == second, "read() after overwrite: not the new bytes"


@_check
async def _concurrent_distinct_keys(kit: _Kit, tier: AsyncTier) -> None:
    n = kit.concurrency(tier)
    keys = [kit.key() for _ in range(n)]
    blocks = [kit.data() for _ in range(n)]
    await asyncio.gather(*(tier.write(k, memoryview(d)) for k, d in zip(keys, blocks, strict=True)))
    outs = [bytearray(kit.options.block_bytes) for _ in range(n)]
    await asyncio.gather(*(tier.read(k, memoryview(o)) for k, o in zip(keys, outs, strict=True)))
    for i, (out, data) in enumerate(zip(outs, blocks, strict=True)):
        assert out == data, f"concurrent read {i} returned another key's or partial bytes"
    # The batch forms, too.
    more = [kit.key() for _ in range(n)]
    more_blocks = [kit.data() for _ in range(n)]
    await tier.write_many(more, [memoryview(d) for d in more_blocks])
    outs = [bytearray(kit.options.block_bytes) for _ in range(n)]
    await tier.read_many(more, [memoryview(o) for o in outs])
    assert outs == more_blocks, "read_many() after write_many() returned other bytes"
    assert await tier.contains_many(more) == [True] * n, "contains_many() after write_many()"


@_check
async def _batch_partial_failure(kit: _Kit, tier: AsyncTier) -> None:
    present, absent = kit.key(), kit.key()
    data = kit.data()
    await tier.write(present, memoryview(data))
    outs = [bytearray(kit.options.block_bytes) for _ in range(2)]
    try:
        await tier.read_many([present, absent], [memoryview(o) for o in outs])
    except PartialBatchError as exc:
        assert present in exc.succeeded, "PartialBatchError.succeeded lacks the present key"
        assert absent not in exc.succeeded, "PartialBatchError.succeeded has the absent key"
        assert isinstance(exc.errors.get(absent), BlockNotFound), (
            f"the absent key's error is {exc.errors.get(absent)!r}, not BlockNotFound"
        )
        assert outs[0] == data, "the present key's bytes are wrong in a partial batch"
        return
    raise AssertionError("read_many() with an absent key did not raise PartialBatchError")


@_check
async def _delete(kit: _Kit, tier: AsyncTier) -> None:
    key = kit.key()
    await tier.write(key, memoryview(kit.data()))
    try:
        await tier.delete(key)
    except NotImplementedError as exc:
        raise _Skip(f"delete not supported: {exc}") from None
    assert not await tier.contains(key), "contains() is True after delete()"
    try:
        await kit.read_back(tier, key)
    except BlockNotFound:
        pass
    else:
        raise AssertionError("read() after delete() did not raise BlockNotFound")
    await tier.delete(kit.key())  # absent: no error


async def _cancel_after(operation: Awaitable[None], steps: int, wall_s: float) -> bool:
    """Run ``operation`` as a task, cancel it after ``steps`` loop turns plus ``wall_s``.

    Returns whether the operation was really cancelled (False: it had finished).
    """
    task = asyncio.ensure_future(operation)
    for _ in range(steps):
        await asyncio.sleep(0)
    if wall_s:
        await asyncio.sleep(wall_s)
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        return True
    return False


# Cancel points: loop turns, then a little wall time (for tiers doing real I/O).
_CANCEL_POINTS = [(s, 0.0) for s in range(8)] + [(0, 0.0005), (0, 0.002), (1, 0.005)]


@_check
async def _cancelled_write(kit: _Kit, tier: AsyncTier) -> None:
    for steps, wall_s in _CANCEL_POINTS:
        key, data = kit.key(), kit.data()
        await _cancel_after(tier.write(key, memoryview(data)), steps, wall_s)
        where = f"(cancelled after {steps} loop turns + {wall_s * 1e3:.1f} ms)"
        if await tier.contains(key):
            got = await kit.read_back(tier, key)
            assert got == data, f"a cancelled write left a readable partial block {where}"
        else:
            try:
                got = await kit.read_back(tier, key)
            except BlockNotFound:
                pass
            else:
                assert got == data, f"a cancelled write left partial bytes readable {where}"
        # A cancelled overwrite: the old bytes or the new ones, nothing else.
        old, new = kit.data(), kit.data()
        await tier.write(key, memoryview(old))
        await _cancel_after(tier.write(key, memoryview(new)), steps, wall_s)
        try:
            got = await kit.read_back(tier, key)
        except BlockNotFound:
            continue  # dropping the block is allowed; serving mixed bytes is not
        assert got in (old, new), f"a cancelled overwrite left mixed bytes {where}"


#: How long the buffer checks watch a buffer after its operation ended.
_AFTERLIFE_S = 0.03


@_check
async def _cancelled_read(kit: _Kit, tier: AsyncTier) -> None:
    key, data = kit.key(), kit.data()
    await tier.write(key, memoryview(data))
    sentinel = b"\xa5" * kit.options.block_bytes
    for steps, wall_s in _CANCEL_POINTS:
        into = bytearray(kit.options.block_bytes)
        await _cancel_after(tier.read(key, memoryview(into)), steps, wall_s)
        where = f"(cancelled after {steps} loop turns + {wall_s * 1e3:.1f} ms)"
        # The buffer is the caller's again: nothing (a thread, the kernel) may write it now.
        into[:] = sentinel
        await asyncio.sleep(_AFTERLIFE_S)
        assert into == sentinel, f"a cancelled read wrote into its buffer after it ended {where}"
        assert await kit.read_back(tier, key) == data, "a cancelled read damaged the stored block"


@_check
async def _buffers_released_after_write(kit: _Kit, tier: AsyncTier) -> None:
    """A write's source buffer is the caller's once the write returns or is cancelled."""
    for steps, wall_s in [(0, 0.0), (2, 0.0), (0, 0.002), (None, 0.0)]:
        key, data = kit.key(), kit.data()
        source = bytearray(data)
        if steps is None:
            await tier.write(key, memoryview(source))
        else:
            await _cancel_after(tier.write(key, memoryview(source)), steps, wall_s)
        source[:] = b"\x5a" * kit.options.block_bytes  # reused for another block at once
        await asyncio.sleep(_AFTERLIFE_S)
        try:
            got = await kit.read_back(tier, key)
        except BlockNotFound:
            assert steps is not None, "a completed write is not readable"
            continue
        assert got == data, "the tier read a write's buffer after the write ended"


@_check
async def _touch_and_list(kit: _Kit, tier: AsyncTier) -> None:
    key = kit.key()
    await tier.write(key, memoryview(kit.data()))
    await tier.touch([key, kit.key()])
    listed = await tier.list_keys()
    for listed_key in listed:
        assert isinstance(listed_key, bytes), f"list_keys() yielded {type(listed_key).__name__}"


async def _close_idempotent(kit: _Kit) -> None:
    tier = await kit.new_tier()
    await tier.write(kit.key(), memoryview(kit.data()))
    await tier.aclose()
    await tier.aclose()
    unopened = await kit.new_tier(open_it=False)
    await unopened.aclose()  # closing a tier that never opened is no error either


async def _persistence(kit: _Kit) -> None:
    if not kit.options.persistent:
        raise _Skip("the tier is not declared persistent (KitOptions.persistent)")
    key, data = kit.key(), kit.data()
    tier = await kit.new_tier()
    try:
        await tier.write(key, memoryview(data))
    finally:
        await tier.aclose()
    again = await kit.new_tier()
    try:
        assert key in set(await again.list_keys()), "a block written before aclose is not listed"
        assert await again.contains(key), "a block written before aclose is not contained"
        assert await kit.read_back(again, key) == data, "a reopened tier returned other bytes"
    finally:
        await again.aclose()


@_check
async def _loop_not_blocked(kit: _Kit, tier: AsyncTier) -> None:
    # A tier that blocks the loop stalls it on every attempt; a busy machine
    # rarely does three times in a row. Pass as soon as one attempt is clean.
    limit = kit.options.max_loop_lag_s
    stalls = []
    for _ in range(3):
        stall = await _worst_loop_stall(kit, tier)
        if stall <= limit:
            return
        stalls.append(stall)
    raise AssertionError(
        f"the event loop stalled for {', '.join(f'{s * 1e3:.0f}' for s in stalls)} ms in "
        f"3 attempts (limit {limit * 1e3:.0f} ms): the tier blocks the loop "
        "(use async I/O or tiering.tier.run_in_thread)"
    )


async def _worst_loop_stall(kit: _Kit, tier: AsyncTier) -> float:
    """Longest stall of a 1 ms ticker while ``tier`` serves a burst of operations."""
    worst = 0.0
    stop = asyncio.Event()

    async def ticker() -> None:
        nonlocal worst
        last = time.perf_counter()
        while not stop.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            worst = max(worst, now - last - 0.001)
            last = now

    ticking = asyncio.ensure_future(ticker())
    try:
        await asyncio.sleep(0.005)
        n = kit.concurrency(tier)
        for _ in range(3):
            if worst > kit.options.max_loop_lag_s:
                break  # already failed: don't make a blocking tier stall the test for long
            keys = [kit.key() for _ in range(n)]
            blocks = [kit.data() for _ in range(n)]
            await asyncio.gather(
                *(tier.write(k, memoryview(d)) for k, d in zip(keys, blocks, strict=True))
            )
            outs = [bytearray(kit.options.block_bytes) for _ in range(n)]
            await asyncio.gather(
                *(tier.read(k, memoryview(o)) for k, o in zip(keys, outs, strict=True))
            )
            await tier.contains_many(keys)
    finally:
        stop.set()
        await ticking
    return worst


async def _deadline_through_facade(kit: _Kit) -> None:
    # Imported here: the runtime imports this package's siblings, not the reverse.
    import numpy as np

    from tiering.jobs import JobMetadata
    from tiering.runtime import AsyncTierManager
    from tiering.testing.faults import FaultPlan, FaultyTier

    hung_key = kit.key()
    tier = FaultyTier(
        await kit.new_tier(open_it=False),
        FaultPlan(hang_rate=1.0, keys={hung_key}, ops={"write", "read", "contains"}),
    )
    rows = np.zeros((4, kit.options.block_bytes), dtype=np.uint8)
    manager = await asyncio.to_thread(
        AsyncTierManager,
        tier,
        rows.data,
        "conformance",
        layout_fingerprint=kit.options.layout_fingerprint,
        job_timeout_s=kit.options.job_timeout_s,
    )
    try:
        rows[0] = np.frombuffer(os.urandom(kit.options.block_bytes), dtype=np.uint8)
        manager.submit_store(JobMetadata(1, (hung_key,), _ids(0), is_promotion=False))
        await asyncio.to_thread(manager.drain, 30.0)
        (result,) = manager.get_finished()
        assert not result.success, "a store whose write hangs did not fail at its deadline"
        assert result.error and "deadline" in result.error, f"unexpected error: {result.error}"
        assert manager.lookup(hung_key, _no_context()) is not True, "a timed-out key is a hit"
        # The tier still works after a timed-out job.
        good_key = kit.key()
        rows[1] = np.frombuffer(os.urandom(kit.options.block_bytes), dtype=np.uint8)
        manager.submit_store(JobMetadata(2, (good_key,), _ids(1), is_promotion=False))
        await asyncio.to_thread(manager.drain, 30.0)
        (stored,) = manager.get_finished()
        assert stored.success, f"a store after a timed-out job failed: {stored.error}"
        manager.submit_load(JobMetadata(3, (good_key,), _ids(2), is_promotion=True))
        await asyncio.to_thread(manager.drain, 30.0)
        (loaded,) = manager.get_finished()
        assert loaded.success, f"a load after a timed-out job failed: {loaded.error}"
        assert bytes(rows[2]) == bytes(rows[1]), "the load returned other bytes than stored"
    finally:
        await asyncio.to_thread(manager.shutdown)


def _ids(*block_ids: int) -> Any:
    import numpy as np

    return np.array(block_ids, dtype=np.int64)


def _no_context() -> Any:
    from tiering.keys import NO_CONTEXT

    return NO_CONTEXT


#: Every check, by name, in the order they run.
CHECKS: dict[str, Callable[[_Kit], Awaitable[None]]] = {
    "round_trip": _round_trip,
    "missing_key": _missing_key,
    "overwrite": _overwrite,
    "concurrent_distinct_keys": _concurrent_distinct_keys,
    "batch_partial_failure": _batch_partial_failure,
    "delete": _delete,
    "cancelled_write": _cancelled_write,
    "cancelled_read": _cancelled_read,
    "buffers_released_after_write": _buffers_released_after_write,
    "touch_and_list": _touch_and_list,
    "close_idempotent": _close_idempotent,
    "persistence": _persistence,
    "loop_not_blocked": _loop_not_blocked,
    "deadline_through_facade": _deadline_through_facade,
}


async def run_check(
    name: str, factory: TierFactory, options: KitOptions | None = None, **option_kwargs: Any
) -> CheckOutcome:
    """Run the one check called ``name`` (see :data:`CHECKS`) and return its outcome.

    Cancellation: cancels the check; tiers it opened are closed on the way out.
    """
    if name not in CHECKS:
        raise KeyError(f"no conformance check {name!r}; checks: {', '.join(CHECKS)}")
    kit = _Kit(factory, _options(options, option_kwargs))
    started = time.perf_counter()
    try:
        await CHECKS[name](kit)
    except _Skip as skip:
        return CheckOutcome(name, True, True, str(skip), time.perf_counter() - started)
    except Exception:
        return CheckOutcome(
            name, False, False, traceback.format_exc(), time.perf_counter() - started
        )
    return CheckOutcome(name, True, False, "", time.perf_counter() - started)


async def check_tier(
    factory: TierFactory,
    options: KitOptions | None = None,
    *,
    only: Iterable[str] | None = None,
    raise_on_failure: bool = True,
    **option_kwargs: Any,
) -> ConformanceReport:
    """Run the conformance suite against tiers made by ``factory``.

    ``options`` (or the same fields as keywords, e.g. ``block_bytes=4096``)
    tune the run; ``only`` restricts it to some checks. Raises
    ``AssertionError`` listing every failed check unless ``raise_on_failure``
    is False; returns the report either way. Cancellation: stops after
    closing the tiers of the running check.
    """
    opts = _options(options, option_kwargs)
    names = list(CHECKS) if only is None else list(only)
    report = ConformanceReport(tier_name=_factory_name(factory))
    for name in names:
        report.outcomes.append(await run_check(name, factory, opts))
    if raise_on_failure:
        report.raise_for_failures()
    return report


def conformance_tests(
    factory: Callable[..., AsyncTier | Awaitable[AsyncTier]],
    options: KitOptions | None = None,
    *,
    prefix: str = "test_conformance_",
    skip: Sequence[str] = (),
    **option_kwargs: Any,
) -> dict[str, Callable[..., None]]:
    """One pytest test function per check, keyed by test name; ``globals().update(...)`` them.

    The factory's parameters (e.g. ``tmp_path``) become each test's
    parameters, so pytest injects those fixtures. ``skip`` leaves checks out.
    """
    opts = _options(options, option_kwargs)
    signature = inspect.signature(factory)
    tests: dict[str, Callable[..., None]] = {}
    for name in CHECKS:
        if name in skip:
            continue

        def test(*args: Any, _name: str = name, **kwargs: Any) -> None:
            bound = functools.partial(factory, *args, **kwargs)
            outcome = asyncio.run(run_check(_name, bound, opts))
            if outcome.skipped:
                _pytest_skip(outcome.detail)
            if not outcome.passed:
                raise AssertionError(f"conformance check {_name} failed:\n{outcome.detail}")

        test.__name__ = test.__qualname__ = prefix + name
        test.__doc__ = f"Conformance check {name!r} of {_factory_name(factory)}."
        test.__signature__ = signature  # type: ignore[attr-defined]
        tests[prefix + name] = test
    return tests


def _pytest_skip(reason: str) -> None:
    import pytest

    pytest.skip(reason)


def _options(options: KitOptions | None, overrides: dict[str, Any]) -> KitOptions:
    base = options or KitOptions()
    if not overrides:
        return base
    unknown = set(overrides) - {f.name for f in dataclasses.fields(KitOptions)}
    if unknown:
        raise TypeError(f"unknown conformance kit options: {sorted(unknown)}")
    return dataclasses.replace(base, **overrides)


def _factory_name(factory: Callable[..., Any]) -> str:
    return getattr(factory, "__qualname__", None) or repr(factory)


__all__ = [
    "CHECKS",
    "CheckOutcome",
    "ConformanceReport",
    "KitOptions",
    "TierFactory",
    "check_tier",
    "conformance_tests",
    "run_check",
]
