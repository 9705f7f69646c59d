"""Sections 3 and 6 of ``benchmarks/facade.py``: what the facade's calls cost the scheduler.

Owns section 3, :class:`~tiering.runtime.AsyncTierManager` over the memory tier:
``submit_store``/``submit_load`` while the loop is busy, ``lookup``, an empty
``get_finished``, each against its target, and jobs/s end to end; and section 6,
the anyio replacements (``LoopThread.call`` against a bare
``run_coroutine_threadsafe`` round trip, ``AsyncTier.run_in_thread`` against the
``asyncio.to_thread`` it replaced). Also the keys and the verdict the GIL sections
(:mod:`benchmarks.support.facade_gil`) use.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.support.common import pct
from tiering.core.jobs import JobMetadata
from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.runtime import AsyncTierManager, LoopThread
from tiers.memory import MemoryTier

Row = tuple[str, ...]


def verdict(value: float, target: float) -> str:
    return "ok" if value <= target else "OVER"


# -- 3. the facade ---------------------------------------------------------------------------


def keys_for(job: int, per_job: int) -> tuple[OffloadKey, ...]:
    return tuple(
        make_offload_key(job.to_bytes(8, "big") + i.to_bytes(4, "big"), 0) for i in range(per_job)
    )


def bench_facade(jobs: int, per_job: int, block_bytes: int) -> tuple[list[Row], list[Row]]:
    # Memory stays bounded whatever the block size: <= 256 MiB of primary rows,
    # <= 512 MiB of tier.
    rows_count = max(2 * per_job + 64, min(256, (256 << 20) // block_bytes))
    buf = np.random.default_rng(0).integers(0, 256, (rows_count, block_bytes), dtype=np.uint8)
    store_metas = [
        JobMetadata(j, keys_for(j, per_job), np.arange(j, j + per_job) % rows_count, False)
        for j in range(jobs)
    ]
    # Loads read the most recent stores (still held: 256 jobs fit the tier's capacity).
    recent = max(16, min(256, (256 << 20) // (per_job * block_bytes)))
    load_metas = [
        JobMetadata(
            jobs + j,
            keys_for(jobs - 1 - j % recent, per_job),
            (np.arange(per_job) + 7 * j) % rows_count,
            True,
        )
        for j in range(jobs)
    ]
    capacity = 2 * recent * per_job
    tier = MemoryTier(capacity_blocks=capacity)
    with AsyncTierManager(tier, buf.data, "memory", job_timeout_s=60) as manager:
        # Warm up (thread start, first allocations).
        warm = JobMetadata(10**9, keys_for(10**9, per_job), np.arange(per_job), False)
        manager.submit_store(warm)
        manager.drain(30)
        manager.get_finished()

        store_ns = _timed_submits(manager, manager.submit_store, store_metas)
        t0 = time.perf_counter()
        manager.drain(120)
        manager.get_finished()
        load_ns = _timed_submits(manager, manager.submit_load, load_metas)
        manager.drain(120)
        manager.get_finished()

        # Lookups while the loop is busy with a fresh stream of stores.
        present = keys_for(0, per_job)
        absent = keys_for(10**8, per_job)
        busy = [
            JobMetadata(2 * jobs + j, keys_for(2 * jobs + j, per_job), np.arange(per_job), False)
            for j in range(jobs // 2)
        ]
        for meta in busy:
            manager.submit_store(meta)
        lookup_ns = []
        for i in range(20000):
            k = present[i % per_job] if i % 2 else absent[i % per_job]
            t1 = time.perf_counter_ns()
            manager.lookup(k, NO_CONTEXT)
            lookup_ns.append(time.perf_counter_ns() - t1)
        manager.drain(120)
        manager.get_finished()
        empty_ns = []
        for _ in range(20000):
            t1 = time.perf_counter_ns()
            manager.get_finished()
            empty_ns.append(time.perf_counter_ns() - t1)

        # End to end: submit store+load jobs as fast as possible, drain, count.
        e2e_jobs = jobs
        e2e = [
            JobMetadata(
                5 * jobs + j, keys_for(5 * jobs + j, per_job), np.arange(per_job) + 16, False
            )
            for j in range(e2e_jobs)
        ]
        t0 = time.perf_counter()
        for meta in e2e:
            manager.submit_store(meta)
        manager.drain(120)
        finished = list(manager.get_finished())
        store_elapsed = time.perf_counter() - t0
        back = [
            JobMetadata(7 * jobs + j, e2e[-1 - j % recent].keys, np.arange(per_job) + 64, True)
            for j in range(e2e_jobs)
        ]
        t0 = time.perf_counter()
        for meta in back:
            manager.submit_load(meta)
        manager.drain(120)
        finished += list(manager.get_finished())
        load_elapsed = time.perf_counter() - t0
        assert all(r.success for r in finished), [r for r in finished if not r.success][:3]

    costs = [
        ("submit_store (loop busy)", store_ns, 10, 50),
        ("submit_load (loop busy)", load_ns, 10, 50),
        ("lookup (hit/miss mix, loop busy)", lookup_ns, 2, None),
        ("get_finished, nothing ready", empty_ns, 2, None),
    ]
    cost_rows: list[Row] = []
    for name, samples, median_target, p99_target in costs:
        med, p99 = pct(samples, 50) / 1000, pct(samples, 99) / 1000
        cost_rows.append(
            (
                name,
                f"{med:.2f}",
                f"{p99:.2f}",
                f"<= {median_target}" + (f" / <= {p99_target}" if p99_target else ""),
                verdict(med, median_target)
                + ("" if p99_target is None else "/" + verdict(p99, p99_target)),
            )
        )
    job_bytes = per_job * block_bytes
    throughput_rows: list[Row] = [
        (
            "store",
            f"{e2e_jobs / store_elapsed:,.0f}",
            f"{e2e_jobs * per_job / store_elapsed:,.0f}",
            f"{e2e_jobs * job_bytes / store_elapsed / 1e9:.2f}",
        ),
        (
            "load",
            f"{e2e_jobs / load_elapsed:,.0f}",
            f"{e2e_jobs * per_job / load_elapsed:,.0f}",
            f"{e2e_jobs * job_bytes / load_elapsed / 1e9:.2f}",
        ),
    ]
    return cost_rows, throughput_rows


def _timed_submits(
    manager: AsyncTierManager, submit: Callable[[JobMetadata], None], metas: list[JobMetadata]
) -> list[int]:
    samples = []
    for i, meta in enumerate(metas):
        t0 = time.perf_counter_ns()
        submit(meta)
        samples.append(time.perf_counter_ns() - t0)
        if i % 64 == 63:
            manager.get_finished()  # as a scheduler would, between steps
    return samples


# -- 6. anyio replacements: control calls and blocking calls in threads -------------------------


async def _noop() -> None:
    pass


def bench_anyio(n: int) -> list[Row]:
    """Round trips of LoopThread.call and run_in_thread, against what they replaced."""
    rows: list[Row] = []
    with LoopThread("bench-anyio") as portal:
        loop = portal.loop
        calls: dict[str, Callable[[], object]] = {
            "LoopThread.call (anyio portal start_task_soon)": lambda: portal.call(_noop),
            "run_coroutine_threadsafe(...).result() (before)": lambda: (
                asyncio.run_coroutine_threadsafe(_noop(), loop).result()
            ),
        }
        for name, call in calls.items():
            for _ in range(min(200, n)):
                call()
            samples = []
            for _ in range(n // 5):
                t0 = time.perf_counter_ns()
                call()
                samples.append(time.perf_counter_ns() - t0)
            rows.append((name, f"{pct(samples, 50) / 1000:.1f}", f"{pct(samples, 99) / 1000:.1f}"))

        async def in_threads(run: Callable[[], Any]) -> list[int]:
            samples = []
            for _ in range(n // 5):
                t0 = time.perf_counter_ns()
                await run()
                samples.append(time.perf_counter_ns() - t0)
            return samples

        limiter_tier = MemoryTier()
        runs: dict[str, Callable[[], Any]] = {
            "AsyncTier.run_in_thread (anyio.to_thread, tier limiter)": lambda: (
                limiter_tier.run_in_thread(int, 1)
            ),
            "asyncio.to_thread + shield (before)": lambda: _shielded_to_thread(int, 1),
        }
        for name, run in runs.items():
            samples = portal.call(in_threads, run)
            rows.append((name, f"{pct(samples, 50) / 1000:.1f}", f"{pct(samples, 99) / 1000:.1f}"))
    return rows


async def _shielded_to_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """What run_in_thread did before anyio: asyncio.to_thread, waited for when cancelled."""
    work = asyncio.ensure_future(asyncio.to_thread(fn, *args))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        await asyncio.wait([work])
        raise
