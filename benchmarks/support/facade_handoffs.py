"""Sections 1 and 2 of ``benchmarks/facade.py``: how jobs reach the loop and results come back.

Owns the hand-off candidates (scheduler -> loop: anyio's ``start_task_soon``,
``run_coroutine_threadsafe``, ``call_soon_threadsafe``, ``janus`` and the
:class:`~tiering.runtime.mailbox.Mailbox` the facade uses), timed per submit with
the loop busy and as pipelined jobs/s, and the hand-back candidates (loop ->
scheduler: ``queue.SimpleQueue``, ``deque``, ``janus``, an ``asyncio.Queue`` read
with a round trip), timed per put, per drained item and per empty poll.
"""

from __future__ import annotations

import asyncio
import queue
import statistics
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from benchmarks.support.common import pct
from tiering.runtime import LoopThread
from tiering.runtime.mailbox import Mailbox

Row = tuple[str, ...]


# -- 1. hand-off scheduler -> loop ---------------------------------------------------------


def bench_handoff(n: int) -> list[Row]:
    rows: list[Row] = []
    for name, make in HANDOFFS.items():
        costs, rate = [], []
        for _ in range(3):
            c, r = _run_handoff(make, n)
            costs.append(c)
            rate.append(r)
        merged = [x for c in costs for x in c]
        rows.append(
            (
                name,
                f"{pct(merged, 50) / 1000:.2f}",
                f"{pct(merged, 99) / 1000:.2f}",
                f"{statistics.median(rate):,.0f}",
            )
        )
    return rows


def _run_handoff(
    make: Callable[[LoopThread, Callable[[], None]], Any], n: int
) -> tuple[list[int], float]:
    done = threading.Event()
    count = [0]

    def finished() -> None:
        count[0] += 1
        if count[0] == n:
            done.set()

    with LoopThread("bench-handoff") as portal:
        submit, cleanup = make(portal, finished)
        costs = []
        started = time.perf_counter()
        for _ in range(n):
            t0 = time.perf_counter_ns()
            submit()
            costs.append(time.perf_counter_ns() - t0)
        if not done.wait(60):
            raise RuntimeError("hand-off benchmark lost jobs")
        elapsed = time.perf_counter() - started
        cleanup()
    return costs, n / elapsed


async def _job(finished: Callable[[], None]) -> None:
    finished()


def _rcts(portal: LoopThread, finished: Callable[[], None]) -> Any:
    loop = portal.loop
    return (lambda: asyncio.run_coroutine_threadsafe(_job(finished), loop)), (lambda: None)


def _csts(portal: LoopThread, finished: Callable[[], None]) -> Any:
    loop = portal.loop

    def start() -> None:
        loop.create_task(_job(finished))

    return (lambda: loop.call_soon_threadsafe(start)), (lambda: None)


def _mailbox(portal: LoopThread, finished: Callable[[], None]) -> Any:
    box = Mailbox(portal.loop)
    loop = portal.loop

    def start(_: object) -> None:
        loop.create_task(_job(finished))

    return (lambda: box.post(start, None)), (lambda: None)


def _janus(portal: LoopThread, finished: Callable[[], None]) -> Any:
    import janus

    async def make_queue() -> Any:
        return janus.Queue()

    q = portal.call(make_queue)
    loop = portal.loop

    async def worker() -> None:
        while True:
            await q.async_q.get()
            loop.create_task(_job(finished))

    async def start_worker() -> asyncio.Task[None]:
        return asyncio.get_running_loop().create_task(worker())

    task = portal.call(start_worker)

    async def stop() -> None:
        task.cancel()
        q.close()
        await q.wait_closed()

    return (lambda: q.sync_q.put_nowait(None)), (lambda: portal.call(stop))


def _portal_task(portal: LoopThread, finished: Callable[[], None]) -> Any:
    # anyio's BlockingPortal: start_task_soon waits for the loop to spawn the task.
    return (lambda: portal.portal.start_task_soon(_job, finished)), (lambda: None)


HANDOFFS = {
    "anyio BlockingPortal.start_task_soon (per job)": _portal_task,
    "run_coroutine_threadsafe (per job)": _rcts,
    "call_soon_threadsafe + create_task (per job)": _csts,
    "janus sync_q.put + loop worker": _janus,
    "Mailbox: deque + coalesced wake-up (used)": _mailbox,
}


# -- 2. hand-back loop -> scheduler --------------------------------------------------------


def bench_handback(n: int) -> list[Row]:
    rows: list[Row] = []
    for name, (make, poll, drain_one) in HANDBACKS.items():
        with LoopThread("bench-handback") as portal:
            channel = make(portal)
            put = channel[0]

            async def produce(put: Callable[[int], None] = put) -> float:
                t0 = time.perf_counter_ns()
                for i in range(n):
                    put(i)
                return (time.perf_counter_ns() - t0) / n / 1000

            put_us = portal.call(produce)
            t0 = time.perf_counter_ns()
            for _ in range(n):
                drain_one(channel)
            drain_us = (time.perf_counter_ns() - t0) / n / 1000
            polls = []
            for _ in range(n):
                t1 = time.perf_counter_ns()
                poll(channel)
                polls.append(time.perf_counter_ns() - t1)
            if len(channel) > 2:
                portal.call(channel[2])
        rows.append(
            (
                name,
                f"{put_us:.2f}",
                f"{drain_us:.2f}",
                f"{pct(polls, 50) / 1000:.2f}",
                f"{pct(polls, 99) / 1000:.2f}",
            )
        )
    return rows


def _simplequeue(portal: LoopThread) -> tuple[Any, ...]:
    q: queue.SimpleQueue[int] = queue.SimpleQueue()
    return (q.put, q)


def _deque(portal: LoopThread) -> tuple[Any, ...]:
    d: deque[int] = deque()
    return (d.append, d)


def _janus_back(portal: LoopThread) -> tuple[Any, ...]:
    import janus

    async def make_queue() -> Any:
        return janus.Queue()

    q = portal.call(make_queue)

    async def stop() -> None:
        q.close()
        await q.wait_closed()

    return (q.async_q.put_nowait, q, stop)


def _asyncio_queue_back(portal: LoopThread) -> tuple[Any, ...]:
    # An asyncio.Queue is not thread-safe: the scheduler reads it with a round trip.
    async def make_queue() -> asyncio.Queue[int]:
        return asyncio.Queue()

    async def stop() -> None:
        pass

    q = portal.call(make_queue)
    return (q.put_nowait, q, stop, portal.loop)


async def _queue_empty(q: asyncio.Queue[int]) -> bool:
    return q.empty()


def _asyncio_queue_poll(channel: tuple[Any, ...]) -> bool:
    return bool(asyncio.run_coroutine_threadsafe(_queue_empty(channel[1]), channel[3]).result())


def _asyncio_queue_drain(channel: tuple[Any, ...]) -> Any:
    return asyncio.run_coroutine_threadsafe(channel[1].get(), channel[3]).result()


def _janus_poll(channel: tuple[Any, ...]) -> bool:
    return bool(channel[1].sync_q.empty())


def _janus_drain(channel: tuple[Any, ...]) -> Any:
    return channel[1].sync_q.get_nowait()


HANDBACKS: dict[
    str, tuple[Callable[..., tuple[Any, ...]], Callable[..., Any], Callable[..., Any]]
] = {
    "queue.SimpleQueue (used)": (_simplequeue, lambda c: c[1].empty(), lambda c: c[1].get_nowait()),
    "collections.deque": (_deque, lambda c: not c[1], lambda c: c[1].popleft()),
    "janus (async put / sync get)": (_janus_back, _janus_poll, _janus_drain),
    "asyncio.Queue (scheduler reads via run_coroutine_threadsafe)": (
        _asyncio_queue_back,
        _asyncio_queue_poll,
        _asyncio_queue_drain,
    ),
}
