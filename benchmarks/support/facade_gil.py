"""Sections 4 and 5 of ``benchmarks/facade.py``: the GIL, seen from the scheduler thread.

Owns section 4, pure-Python scheduler batches alone and while the memory tier
works (one store and one load per batch, or 64 jobs kept in flight), in rounds
where each scenario is compared with the alone runs around it, the alone runs
against each other (A/A: the noise floor of the same run); and section 5, the same
batches while one bulk call (checksums, the memory tier's and the host copy
engine's copies, before and after the bulk copy) runs flat out on another thread.
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from benchmarks.support.common import pct, scheduler_batches
from benchmarks.support.facade_calls import keys_for, verdict
from tiering.core.jobs import JobMetadata
from tiering.runtime import AsyncTierManager
from tiers.memory import MemoryTier

Row = tuple[str, ...]


def bench_gil(seconds: float, per_job: int, block_bytes: int) -> list[Row]:
    """Scheduler batches of pure-Python work, alone and while the memory tier works.

    Slowdowns are medians over rounds of the ratio to the alone runs of the
    same round. *work slowdown* compares the mean time of the pure-Python batch itself;
    *wall slowdown* the mean wall time per loop iteration, which also
    includes building and submitting jobs and collecting results (and any
    wait for the GIL those calls incur). The tier's jobs/s alone is the same
    refill loop without the pure-Python batches. The alone row is the A/A of
    the same run: in each round the alone run after the scenarios against the
    one before them (the larger over the smaller), so its verdict says whether
    the machine's own noise stays within the target the other rows are held to.
    """

    buf = np.zeros((2 * per_job, block_bytes), dtype=np.uint8)
    capacity = max(64 * per_job, (512 << 20) // block_bytes)
    counter = [0]

    def next_job(load: bool) -> JobMetadata:
        counter[0] += 1
        j = counter[0]
        if load:
            keys = keys_for(max(1, j - 3), per_job)  # the store two steps back
            return JobMetadata(j, keys, np.arange(per_job) + per_job, True)
        return JobMetadata(j, keys_for(j, per_job), np.arange(per_job), False)

    def saturated(work: bool) -> tuple[list[float], float, float]:
        """The scheduler itself keeps 64 store jobs in flight (refilled after every batch)."""
        with AsyncTierManager(MemoryTier(capacity_blocks=capacity), buf.data, "memory") as manager:
            in_flight, done = [0], [0]

            def refill() -> None:
                finished = len(list(manager.get_finished()))
                done[0] += finished
                in_flight[0] -= finished
                while in_flight[0] < 64:
                    manager.submit_store(next_job(False))
                    in_flight[0] += 1

            t0 = time.perf_counter()
            if work:
                times, wall = scheduler_batches(seconds / 3, refill)
            else:
                times, wall = [], 0.0
                end = t0 + seconds / 3
                while time.perf_counter() < end:
                    refill()
                    time.sleep(0.0005)
            manager.drain(60)
            done[0] += len(list(manager.get_finished()))
            return times, wall, done[0] / (time.perf_counter() - t0)

    def engine() -> tuple[list[float], float, float]:
        with AsyncTierManager(MemoryTier(capacity_blocks=capacity), buf.data, "memory") as manager:
            done = [0]

            def step() -> None:
                manager.submit_store(next_job(False))
                manager.submit_load(next_job(True))
                done[0] += len(list(manager.get_finished()))

            t0 = time.perf_counter()
            times, wall = scheduler_batches(seconds / 3, step)
            manager.drain(60)
            done[0] += len(list(manager.get_finished()))
            return times, wall, done[0] / (time.perf_counter() - t0)

    # Rounds of (alone, engine, saturated, alone): each scenario is compared
    # with the alone runs around it, so slow drifts of a shared machine cancel.
    rounds = 3  # each scenario runs seconds / 3 per round
    work_ratio: dict[str, list[float]] = {"engine": [], "saturated": [], "alone": []}
    wall_ratio: dict[str, list[float]] = {"engine": [], "saturated": [], "alone": []}
    samples: dict[str, list[float]] = {"alone": [], "engine": [], "saturated": []}
    rates: dict[str, list[float]] = {"engine": [], "saturated": [], "tier alone": []}
    for _ in range(rounds):
        before, wall_before = scheduler_batches(seconds / rounds)
        runs = {"engine": engine(), "saturated": saturated(work=True)}
        after, wall_after = scheduler_batches(seconds / rounds)
        base = statistics.fmean(before + after)
        base_wall = (wall_before + wall_after) / 2
        samples["alone"] += before + after
        work_ratio["alone"].append(_spread(statistics.fmean(after), statistics.fmean(before)))
        wall_ratio["alone"].append(_spread(wall_after, wall_before))
        for name, (times, wall, rate) in runs.items():
            samples[name] += times
            work_ratio[name].append(statistics.fmean(times) / base)
            wall_ratio[name].append(wall / base_wall)
            rates[name].append(rate)
        rates["tier alone"].append(saturated(work=False)[2])

    def row(name: str, key: str, rate: str) -> Row:
        times = samples[key]
        work, wall = statistics.median(work_ratio[key]), statistics.median(wall_ratio[key])
        return (
            name,
            f"{statistics.median(times) * 1e6:.0f}",
            f"{pct(times, 99) * 1e6:.0f}",
            f"{work:.2f}x",
            f"{wall:.2f}x",
            rate,
            verdict(max(work, wall), 1.25),
        )

    median_rate = {k: statistics.median(v) for k, v in rates.items()}
    return [
        row("scheduler loop alone: A/A, later run vs earlier", "alone", "-"),
        row(
            "engine step: +1 store +1 load job per batch",
            "engine",
            f"{median_rate['engine']:,.0f}",
        ),
        row(
            "tier flat out: 64 jobs kept in flight",
            "saturated",
            f"{median_rate['saturated']:,.0f} (alone: {median_rate['tier alone']:,.0f})",
        ),
    ]


def _spread(a: float, b: float) -> float:
    """How far apart two runs of the same thing measure: the larger over the smaller."""
    low, high = sorted((a, b))
    return high / low if low > 0 else float("inf")


# -- 5. GIL per bulk call ---------------------------------------------------------------------


def bench_bulk_gil(seconds: float, per_job: int, block_bytes: int) -> list[Row]:
    """Scheduler batches alone and while each bulk call runs back to back on another thread."""
    import xxhash

    from tiering.copy import bulk

    rng = np.random.default_rng(3)
    slots = max(4 * per_job, 64)
    src = _page_aligned(slots * block_bytes)
    dst = _page_aligned(slots * block_bytes)
    src[:] = rng.integers(0, 256, src.size, dtype=np.uint8)
    src_rows = [src.data[i * block_bytes : (i + 1) * block_bytes] for i in range(slots)]
    dst_rows = [dst.data[i * block_bytes : (i + 1) * block_bytes] for i in range(slots)]
    layers = 8
    page = block_bytes // layers
    src_base, dst_base = int(src.ctypes.data), int(dst.ctypes.data)

    def job_table(n_blocks: int, region: int) -> tuple[Any, Any, Any]:
        count = n_blocks * block_bytes // region
        s = rng.choice(slots * block_bytes // region, count, replace=False)
        d = rng.choice(slots * block_bytes // region, count, replace=False)
        return (
            (s * region + src_base).astype(np.uint64),
            (d * region + dst_base).astype(np.uint64),
            np.full(count, region, dtype=np.uint64),
        )

    block_table = job_table(per_job, block_bytes)
    page_table = job_table(per_job, page)

    def blocks_slices() -> None:  # the memory tier before: one slice assignment per block
        for i in range(per_job):
            dst_rows[(i * 7) % slots][:] = src_rows[(i * 13) % slots]

    def pages_numpy() -> None:  # the host engine before: one numpy slice per page
        s_off = (page_table[0] - np.uint64(src_base)).tolist()
        d_off = (page_table[1] - np.uint64(dst_base)).tolist()
        for a, b in zip(s_off, d_off, strict=True):
            dst[b : b + page] = src[a : a + page]

    def hashing(fn: Callable[[memoryview], int]) -> Callable[[], None]:
        def run() -> None:
            for i in range(per_job):
                fn(src_rows[i])

        return run

    shape = f"{layers} x {page // 1024} KiB"
    # (label, call, bulk-copy way it needs or None)
    cases: list[tuple[str, Callable[[], None], str | None]] = [
        ("checksum xxh3_64 per block (xxhash >= 3.0: GIL released)",
         hashing(xxhash.xxh3_64_intdigest), None),
        ("checksum xxh3_128 per block", hashing(xxhash.xxh3_128_intdigest), None),
        ("memory tier copies, before: memoryview slice per block", blocks_slices, None),
        *[(f"memory tier copies, after: one copy_regions per call ({way})",
           lambda: bulk.copy_regions(*block_table), way) for way in bulk.MODES],
        (f"host engine {shape}, before: numpy slice per page", pages_numpy, None),
        *[(f"host engine {shape}, after: one copy_regions per job ({way})",
           lambda: bulk.copy_regions(*page_table), way) for way in bulk.MODES],
    ]  # fmt: skip

    def batches(duration: float) -> list[float]:
        return scheduler_batches(duration)[0]

    def while_running(call: Callable[[], None], duration: float) -> tuple[list[float], float]:
        stop = threading.Event()
        calls = [0]

        def spin() -> None:
            while not stop.is_set():
                call()
                calls[0] += 1

        worker = threading.Thread(target=spin, name="bulk-call", daemon=True)
        t0 = time.perf_counter()
        worker.start()
        try:
            times = batches(duration)
        finally:
            stop.set()
            worker.join()
        return times, calls[0] / (time.perf_counter() - t0)

    per_case = seconds / 2
    alone = batches(per_case / 2)
    rows: list[Row] = []
    results = []
    for name, call, way in cases:
        if way is not None:
            bulk._reset_for_tests(way)
            if bulk.active_mode() != way:
                continue  # not built, or refused by this kernel: the other rows stand
        call()  # warm up
        times, rate = while_running(call, per_case)
        alone += batches(per_case / 4)  # alone runs between cases: drifts of the machine cancel
        results.append((name, times, rate))
    bulk._reset_for_tests(None)
    a50, a99 = statistics.median(alone), pct(alone, 99)
    rows.append(("scheduler batches alone", f"{a50 * 1e6:.0f}", f"{a99 * 1e6:.0f}", "1.00x",
                 "1.00x", "-", ""))  # fmt: skip
    for name, times, rate in results:
        b50, b99 = statistics.median(times), pct(times, 99)
        rows.append(
            (
                name,
                f"{b50 * 1e6:.0f}",
                f"{b99 * 1e6:.0f}",
                f"{b50 / a50:.2f}x",
                f"{b99 / a99:.2f}x",
                f"{rate * per_job * block_bytes / 1e9:.2f}",
                verdict(b99 / a99, 1.25),
            )
        )
    return rows


def _page_aligned(nbytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    raw = np.empty(nbytes + 4096, dtype=np.uint8)
    start = -int(raw.ctypes.data) % 4096
    return raw[start : start + nbytes]
