"""LoopThread (an anyio blocking portal), run_in_thread (anyio.to_thread) and the BlockLimiter."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Awaitable, Callable

import anyio
import anyio.to_thread
import pytest

from tiering.core.errors import TierClosedError
from tiering.runtime import LoopThread, WrongThreadError
from tiering.runtime.limiter import BlockLimiter
from tiering.runtime.mailbox import Mailbox
from tiering.tier import AsyncTier, run_in_thread


async def _add(a: int, b: int) -> int:
    await asyncio.sleep(0)
    return a + b


class Boom(Exception):
    pass


async def _fail() -> None:
    raise Boom("from the loop")


def test_call_runs_on_the_named_thread_and_keeps_exception_types() -> None:
    with LoopThread("test-loop") as portal:
        assert portal.call(_add, 2, 3) == 5
        assert portal.thread.name == "test-loop" and portal.thread.is_alive()

        async def where() -> str:
            return threading.current_thread().name

        assert portal.call(where) == "test-loop"
        with pytest.raises(Boom, match="from the loop"):
            portal.call(_fail)
    assert not portal.thread.is_alive() and portal.loop.is_closed()


def test_a_call_from_the_loop_thread_itself_is_refused() -> None:
    with LoopThread("reentrant") as portal:

        async def reenter() -> None:
            portal.call(_add, 1, 1)

        with pytest.raises(WrongThreadError, match="would deadlock"):
            portal.call(reenter)


def test_call_timeout_cancels_the_coroutine() -> None:
    cancelled = threading.Event()

    async def forever() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    with LoopThread("timeout") as portal:
        with pytest.raises(TimeoutError, match=r"did not finish within 0\.05 s"):
            portal.call(forever, timeout=0.05)
        assert cancelled.wait(5)


def test_close_cancels_leftover_tasks_joins_executor_threads_and_is_idempotent() -> None:
    before = set(threading.enumerate())
    portal = LoopThread("closing")
    stopped = threading.Event()

    async def spawn() -> None:
        async def lingering() -> None:
            try:
                await asyncio.sleep(3600)
            finally:
                stopped.set()

        asyncio.get_running_loop().create_task(lingering())
        await asyncio.to_thread(lambda: None)  # starts a default-executor thread

    portal.call(spawn)
    portal.close()
    portal.close()
    assert stopped.is_set()
    assert set(threading.enumerate()) == before
    with pytest.raises(TierClosedError):
        portal.call(_add, 1, 2)
    with pytest.raises(TierClosedError):
        portal.call_soon(print)


def test_mailbox_delivers_every_post_in_order_from_several_threads() -> None:
    with LoopThread("mailbox") as portal:
        box = Mailbox(portal.loop)
        got: list[tuple[int, int]] = []
        done = threading.Event()
        total = 4 * 5000

        def record(item: tuple[int, int]) -> None:
            got.append(item)
            if len(got) == total:
                done.set()

        def poster(t: int) -> None:
            for i in range(5000):
                box.post(record, (t, i))

        threads = [threading.Thread(target=poster, args=(t,)) for t in range(4)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert done.wait(10)
        for t in range(4):
            assert [i for (tt, i) in got if tt == t] == list(range(5000))
    box.close()


def test_a_busy_loop_runs_a_post_only_once_the_scheduler_lets_go_of_the_gil() -> None:
    """A post returns without running anything and without handing the loop the GIL: a
    busy loop thread (a task spinning in pure Python between turns) runs the item only
    once the posting thread blocks (here: waiting on an Event), never in the middle of
    its step. (What the GIL-holding wake-up saves a real scheduler is measured by
    ``benchmarks/backpressure.py``; see tiering/runtime/mailbox.py.)"""
    interval = sys.getswitchinterval()
    stop = threading.Event()

    async def spin() -> None:
        while not stop.is_set():
            deadline = time.perf_counter() + 0.0001
            while time.perf_counter() < deadline:
                pass
            await asyncio.sleep(0)

    with LoopThread("mailbox-gil") as portal:
        box = Mailbox(portal.loop)
        portal.call(asyncio.sleep, 0)  # the loop has run its turn: it watches the pipe
        portal.call_soon(lambda: portal.loop.create_task(spin()))
        ran = threading.Event()
        sys.setswitchinterval(5.0)  # no forced GIL switch within this test's step
        try:
            time.sleep(0.01)  # the spinner runs; back from sleep, this thread holds the GIL
            box.post(lambda _: ran.set(), None)
            during_post = ran.is_set()
            deadline = time.perf_counter() + 0.05
            while time.perf_counter() < deadline:  # the rest of the step: pure Python
                pass
            during_step = ran.is_set()
        finally:
            sys.setswitchinterval(interval)
            stop.set()
        assert ran.wait(10)  # the scheduler blocks: the loop runs the item now
    box.close()
    assert not during_post and not during_step


async def test_limiter_grants_in_arrival_order_and_never_exceeds_capacity() -> None:
    limiter = BlockLimiter(4)
    order: list[str] = []
    await limiter.acquire(3)

    async def take(name: str, n: int) -> None:
        await limiter.acquire(n)
        order.append(name)

    big = asyncio.ensure_future(take("big", 4))
    await asyncio.sleep(0)
    small = asyncio.ensure_future(take("small", 1))  # fits now, but must queue behind big
    await asyncio.sleep(0)
    assert order == [] and limiter.in_use == 3
    limiter.release(3)
    await asyncio.gather(big)
    assert order == ["big"] and limiter.in_use == 4
    limiter.release(4)
    await small
    assert order == ["big", "small"] and limiter.in_use == 1
    limiter.release(1)
    assert limiter.in_use == 0


async def test_limiter_cancelled_waiter_takes_nothing_and_unblocks_others() -> None:
    limiter = BlockLimiter(2)
    await limiter.acquire(2)
    head = asyncio.ensure_future(limiter.acquire(2))
    await asyncio.sleep(0)
    behind = asyncio.ensure_future(limiter.acquire(1))
    await asyncio.sleep(0)
    head.cancel()
    with pytest.raises(asyncio.CancelledError):
        await head
    limiter.release(1)
    await behind
    assert limiter.in_use == 2
    limiter.release(2)
    assert limiter.in_use == 0
    with pytest.raises(ValueError, match="cannot acquire 3"):
        await limiter.acquire(3)


async def test_limiter_granted_then_cancelled_gives_units_back() -> None:
    limiter = BlockLimiter(1)
    await limiter.acquire(1)
    waiter = asyncio.ensure_future(limiter.acquire(1))
    await asyncio.sleep(0)
    limiter.release(1)  # grants the waiter...
    waiter.cancel()  # ...which is cancelled before it runs
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert limiter.in_use == 0


def _on_a_loop_thread(body: Callable[[], Awaitable[None]]) -> None:
    """Run an async test body on a LoopThread, whose close joins anyio's worker threads.

    (Under pytest-asyncio's loop they would outlive the test, still exiting, and
    show up in the thread-leak checks of later tests.)
    """
    with LoopThread("test-body") as portal:
        portal.call(body)


def _blocking_call() -> tuple[threading.Event, threading.Event, list[bool], Callable[[], None]]:
    """A blocking function that signals ``started``, waits for ``release``, records finishing."""
    started, release = threading.Event(), threading.Event()
    finished: list[bool] = []

    def blocking() -> None:
        started.set()
        release.wait(5)
        finished.append(True)

    return started, release, finished, blocking


def test_run_in_thread_returns_and_waits_for_the_thread_when_cancelled() -> None:
    _on_a_loop_thread(_returns_and_waits_for_the_thread_when_cancelled)


async def _returns_and_waits_for_the_thread_when_cancelled() -> None:
    assert await run_in_thread(sum, [1, 2, 3]) == 6
    started, release, finished, blocking = _blocking_call()

    task = asyncio.ensure_future(run_in_thread(blocking))
    await asyncio.to_thread(started.wait, 5)
    task.cancel()
    await asyncio.sleep(0.05)
    assert not task.done()  # the thread still uses its arguments: the task waits for it
    release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished == [True]


def test_run_in_thread_waits_for_the_thread_when_an_anyio_scope_cancels_it() -> None:
    _on_a_loop_thread(_waits_for_the_thread_when_an_anyio_scope_cancels_it)


async def _waits_for_the_thread_when_an_anyio_scope_cancels_it() -> None:
    started, release, finished, blocking = _blocking_call()

    async def release_soon() -> None:
        await asyncio.to_thread(started.wait, 5)
        await asyncio.sleep(0.05)
        release.set()

    releaser = asyncio.ensure_future(release_soon())
    with anyio.move_on_after(0.01) as scope:
        await run_in_thread(blocking)
    # The scope's deadline passed long before the thread ended, yet the call returned only
    # once it had: an anyio cancellation does not abandon the thread either.
    assert scope.cancelled_caught and finished == [True]
    await releaser


class _ThreadedTier(AsyncTier):
    max_concurrency = 8
    max_threads = 2


def test_a_tier_runs_at_most_max_threads_blocking_calls_at_once() -> None:
    _on_a_loop_thread(_at_most_max_threads_blocking_calls_at_once)


async def _at_most_max_threads_blocking_calls_at_once() -> None:
    tier = _ThreadedTier()
    lock = threading.Lock()
    active, peak = [0], [0]

    def blocking() -> None:
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        time.sleep(0.01)
        with lock:
            active[0] -= 1

    await asyncio.gather(*(tier.run_in_thread(blocking) for _ in range(8)))
    assert peak[0] == 2 and tier.thread_limiter.total_tokens == 2
    assert tier.thread_limiter is tier.thread_limiter  # one limiter per tier
    assert AsyncTier().thread_limiter.total_tokens == AsyncTier.max_concurrency


def test_close_joins_anyio_worker_threads_and_the_portal_runs_calls() -> None:
    before = set(threading.enumerate())
    portal = LoopThread("anyio-workers")

    async def use_anyio_threads() -> str:
        await anyio.to_thread.run_sync(time.sleep, 0)
        return await run_in_thread(lambda: threading.current_thread().name)

    assert portal.call(use_anyio_threads) == "AnyIO worker thread"
    assert portal.portal.call(_add, 1, 2) == 3  # the anyio portal itself is usable too
    assert len(set(threading.enumerate()) - before) >= 2  # the loop and a worker
    portal.close()
    assert not set(threading.enumerate()) - before  # the loop thread and anyio's workers joined
