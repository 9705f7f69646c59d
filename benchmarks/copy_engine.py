"""Copy-engine throughput against a plain memcpy of the same bytes, in the same run.

Host engine: stores (KV tensor -> primary buffer) and loads (back) of jobs of
``--job-mib`` MiB in blocks of 64 KiB, 256 KiB and 2 MiB at random block ids,
through the public worker API (submit + wait), against ``np.copyto`` of one
contiguous buffer of the same size (the ceiling). Target: >= 70 % of memcpy at
>= 256 KiB. A second set of rows spreads each block over 8 layer tensors
(pages of 1/8 of the block), the shape of a real model's KV cache; those run
once per way of :mod:`tiering.copy.bulk` (``native``, the C extension and
the default where built; ``memmove``, the ctypes fallback; the opt-in
``process_vm`` where the kernel allows it), engine column ``host/<way>``; the
single-layer rows use the default way. Target: >= 70 % of memcpy for every
shape.

The CUDA engine has its own benchmark, ``benchmarks/gpu_copy.py`` (per
strategy, against one pinned ``cudaMemcpyAsync`` and vLLM's worker).

Figures are medians of ``--reps`` runs (31 by default: with 7, one row in
three runs fell 19-46 points below its neighbours' figure from the host's
bursts; a run takes about 20 s either way, most of it building the arrays);
machines are noisy, compare ratios.
Run: ``.venv/bin/python benchmarks/copy_engine.py [--job-mib 64] [--reps 31] [--smoke]``.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import KIB, MIB, print_aligned_table
from tiering.copy import (
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    CopyWorker,
    bulk,
    make_copy_worker,
    required_cpu_block_bytes,
)
from tiering.core.specs import CPULoadStoreSpec, GPULoadStoreSpec
from tiering.primary.host_buffer import HostBuffer

BLOCK_SIZES = (64 * KIB, 256 * KIB, 2 * MIB)


def page_aligned(rows: int, cols: int, seed: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """Random bytes in a page-aligned array, like a real allocator's KV cache.

    numpy's heap arrays start 16 bytes past a page boundary; copying between
    them and the page-aligned host buffer is up to 3x slower on these machines
    (relative misalignment), which would measure numpy's allocator, not the engine.
    """
    raw = np.empty(rows * cols + 4096, dtype=np.uint8)
    start = -raw.ctypes.data % 4096
    arr = raw[start : start + rows * cols].reshape(rows, cols)
    arr[:] = np.random.default_rng(seed).integers(0, 256, arr.shape, dtype=np.uint8)
    return arr


def paired_median_seconds(
    fn: Callable[[], None], ceiling: Callable[[], None], reps: int
) -> tuple[float, float]:
    """Medians of ``fn`` and ``ceiling`` timed alternately, so both see the same machine load."""
    fn()
    ceiling()
    fn_times: list[float] = []
    ceiling_times: list[float] = []
    for _ in range(reps):
        for f, times in ((fn, fn_times), (ceiling, ceiling_times)):
            start = time.perf_counter()
            f()
            times.append(time.perf_counter() - start)
    return statistics.median(fn_times), statistics.median(ceiling_times)


def memcpy_of(nbytes: int) -> Callable[[], None]:
    """A plain memcpy of ``nbytes`` between two page-aligned buffers: the ceiling."""
    src = page_aligned(1, nbytes, 1)
    dst = page_aligned(1, nbytes, 2)
    return lambda: np.copyto(dst, src)


class JobRunner:
    """Submits a store or a load of ``blocks_per_job`` random blocks and waits for it.

    The block ids are drawn up front (a few jobs' worth, reused in turn): they
    are the scheduler's input, and drawing 2 x 1,024 of them costs about
    0.1 ms, which would be charged to the engine.
    """

    DRAWN_JOBS = 16

    def __init__(self, worker: CopyWorker, num_gpu: int, num_cpu: int, per_job: int) -> None:
        self.worker = worker
        rng = np.random.default_rng(7)
        self.jobs = [
            (
                GPULoadStoreSpec(rng.choice(num_gpu, per_job, replace=False)),
                CPULoadStoreSpec(rng.choice(num_cpu, per_job, replace=False)),
            )
            for _ in range(self.DRAWN_JOBS)
        ]
        self.next_id = 0

    def run(self, store: bool) -> None:
        gpu, cpu = self.jobs[self.next_id % self.DRAWN_JOBS]
        self.next_id += 1
        if store:
            ok = self.worker.submit_store(self.next_id, gpu, cpu)
        else:
            ok = self.worker.submit_load(self.next_id, cpu, gpu)
        assert ok, "job rejected"
        self.worker.wait([self.next_id])
        (result,) = self.worker.get_finished()
        assert result.success, result.error


def host_rows_for(
    block: int, layers: int, job_bytes: int, reps: int, engine_label: str = "host"
) -> list[tuple[str, ...]]:
    per_job = max(1, job_bytes // block)
    num_gpu = num_cpu = per_job * 4
    page = block // layers
    tensors = [page_aligned(num_gpu, page, seed) for seed in range(layers)]
    kv = CanonicalKVCaches(
        [CanonicalKVCacheTensor(t, page) for t in tensors],
        [[CanonicalKVCacheRef(i, page) for i in range(layers)]],
    )
    rows: list[tuple[str, ...]] = []
    with HostBuffer.create(num_cpu, required_cpu_block_bytes([page] * layers)) as host:
        host.as_numpy()[:] = 1  # first touch outside the timing
        worker = make_copy_worker(kv, host, engine="host")
        try:
            runner = JobRunner(worker, num_gpu, num_cpu, per_job)
            for label, store in (("store", True), ("load", False)):
                moved = per_job * block
                seconds, memcpy_s = paired_median_seconds(
                    functools.partial(runner.run, store), memcpy_of(moved), reps
                )
                gbps = moved / seconds / 1e9
                ceiling = moved / memcpy_s / 1e9
                rows.append(
                    (
                        engine_label,
                        f"{block // KIB} KiB"
                        + (f" ({layers} x {page // KIB} KiB)" if layers > 1 else ""),
                        label,
                        f"{gbps:6.2f}",
                        f"{ceiling:6.2f}",
                        f"{gbps / ceiling:5.0%}",
                    )
                )
        finally:
            worker.shutdown()
    return rows


def print_table(rows: list[tuple[str, ...]]) -> None:
    print_aligned_table(("engine", "block", "direction", "GB/s", "memcpy GB/s", "ratio"), rows)


def main(argv: Any = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--job-mib", type=int, default=64, help="bytes moved per job (MiB)")
    parser.add_argument("--reps", type=int, default=31, help="timed repetitions per row")
    parser.add_argument("--no-layers", action="store_true", help="skip the 8-layer rows")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: 1 MiB jobs, 1 rep")
    args = parser.parse_args(argv)
    if args.smoke:
        args.job_mib, args.reps = 1, 1
    job_bytes = args.job_mib * MIB
    rows: list[tuple[str, ...]] = []
    for block in BLOCK_SIZES:
        rows += host_rows_for(block, 1, job_bytes, args.reps)
    if not args.no_layers:
        for mode in bulk.MODES:
            bulk._reset_for_tests(mode)
            if bulk.active_mode() != mode:
                why = "not built" if mode == "native" else "refused by this kernel"
                rows.append((f"host/{mode}", "-", "-", "n/a", "", why))
                continue
            for block in BLOCK_SIZES:
                rows += host_rows_for(block, 8, job_bytes, args.reps, f"host/{mode}")
        bulk._reset_for_tests(None)
    print_table(rows)
    print("CUDA engine: benchmarks/gpu_copy.py (against pinned cudaMemcpyAsync and vLLM's worker)")


if __name__ == "__main__":
    main()
