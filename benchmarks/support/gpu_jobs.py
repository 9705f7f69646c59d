"""Driving a copy worker by block ids, and timing its jobs: one at a time or several in flight.

Shared by ``benchmarks/gpu_copy.py``'s rows for our engine and for vLLM's worker.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np

from tiering.copy import CopyWorker
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec

#: Jobs submitted before waiting, for the ``4 in flight`` column.
PIPELINE_DEPTH = 4


def draw_jobs(num_gpu: int, num_cpu: int, per_job: int) -> list[tuple[list[int], list[int]]]:
    """Block ids drawn before timing (they are the scheduler's input, not the engine's work)."""
    rng = np.random.default_rng(7)
    return [
        (
            rng.choice(num_gpu, per_job, replace=False).tolist(),
            rng.choice(num_cpu, per_job, replace=False).tolist(),
        )
        for _ in range(8)
    ]


def time_worker(
    submit: Callable[[int, bool, list[int], list[int]], None],
    wait: Callable[[int], None],
    jobs: list[tuple[list[int], list[int]]],
    store: bool,
    reps: int,
    ceiling: Callable[[bool], float],
) -> tuple[float, float]:
    """Median wall seconds of one job (submit, then wait) and of the ceiling copy between jobs.

    The two alternate, so a slow spell of the bus or the host slows both alike.
    """
    counter = iter(range(1, 1 << 30))

    def one() -> None:
        job_id = next(counter)
        gpu_ids, cpu_ids = jobs[job_id % len(jobs)]
        submit(job_id, store, gpu_ids, cpu_ids)
        wait(job_id)

    one()  # warm-up: first touch, thread start, caches
    ceiling(store)
    jobs_s, ceilings_s = [], []
    for _ in range(reps):
        begin = time.perf_counter()
        one()
        jobs_s.append(time.perf_counter() - begin)
        ceilings_s.append(ceiling(store))
    return statistics.median(jobs_s), statistics.median(ceilings_s)


def time_pipelined(
    submit: Callable[[int, bool, list[int], list[int]], None],
    wait_all: Callable[[list[int]], None],
    jobs: list[tuple[list[int], list[int]]],
    store: bool,
    reps: int,
) -> float:
    """Median wall seconds per job when PIPELINE_DEPTH jobs are submitted, then waited for.

    The jobs of one lane run in submission order on its stream, so overlapping
    blocks between them are copied as a sequence would copy them.
    """
    counter = iter(range(1 << 30, 1 << 31))  # ids apart from time_worker's
    per_job = []
    for _ in range(max(2, reps // PIPELINE_DEPTH)):
        ids = [next(counter) for _ in range(PIPELINE_DEPTH)]
        begin = time.perf_counter()
        for job_id in ids:
            gpu_ids, cpu_ids = jobs[job_id % len(jobs)]
            submit(job_id, store, gpu_ids, cpu_ids)
        wait_all(ids)
        per_job.append((time.perf_counter() - begin) / PIPELINE_DEPTH)
    return statistics.median(per_job[1:])  # the first group warms up


class OurWorker:
    """Submits and waits for jobs of our worker by block ids."""

    def __init__(self, worker: CopyWorker) -> None:
        self.worker = worker
        #: Event-timed seconds of every job waited for (``transfer_time``).
        self.gpu_seconds: list[float] = []

    def submit(self, job_id: int, store: bool, gpu_ids: list[int], cpu_ids: list[int]) -> None:
        gpu, cpu = GPULoadStoreSpec(gpu_ids), CPULoadStoreSpec(cpu_ids)
        if store:
            ok = self.worker.submit_store(job_id, gpu, cpu)
        else:
            ok = self.worker.submit_load(job_id, cpu, gpu)
        assert ok, "job rejected"

    def wait(self, job_id: int) -> None:
        self.worker.wait([job_id])
        (result,) = self.worker.get_finished()
        assert result.success, result.error
        self.gpu_seconds.append(result.transfer_time)

    def wait_all(self, job_ids: list[int]) -> None:
        self.worker.wait(job_ids)
        results = self.worker.get_finished()
        assert sorted(r.job_id for r in results) == sorted(job_ids), "missing results"
        assert all(r.success for r in results), [r.error for r in results]
