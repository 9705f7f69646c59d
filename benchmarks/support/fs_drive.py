"""Driving the filesystem tier through the facade for ``benchmarks/fs_tier.py``.

Owns the page-aligned primary rows, the :class:`Workload` of jobs of unique keys,
:func:`run_jobs` (every job submitted, a few in flight, completions polled as a
scheduler polls them), the tier behind a facade (:func:`make_manager`), the GIL
probe (batches/s of a pure-Python loop on another thread, alone or while the tier
works) and the authenticated-blocks comparison (``auth_key_env`` on and off).
"""

from __future__ import annotations

import argparse
import heapq
import mmap
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.support.common import KIB, MIB
from benchmarks.support.fs_ceilings import Figure, measure, median_figure
from tiering.core.jobs import JobMetadata
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.runtime import AsyncTierManager
from tiers.fs import FileSystemTier

# -- driving the tier through the facade ---------------------------------------------------


class Primary:
    """Page-aligned primary rows, faulted in before timing (fresh memory is slow on this VM)."""

    def __init__(self, rows: int, block: int) -> None:
        self.map = mmap.mmap(-1, rows * block)
        array = np.frombuffer(self.map, dtype=np.uint8)
        array[:] = np.random.default_rng(1).integers(0, 256, array.size, dtype=np.uint8)
        del array
        self.rows, self.block = rows, block

    def view(self) -> memoryview:
        return memoryview(self.map)


@dataclass
class Workload:
    """Jobs of ``job_blocks`` unique keys; job ``j`` uses primary rows of its in-flight slot."""

    block: int
    total: int
    job_blocks: int
    in_flight: int
    tag: str
    jobs: list[tuple[list[OffloadKey], int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        blocks = self.total // self.block
        for j in range(blocks // self.job_blocks):
            keys = [
                make_offload_key(f"{self.tag}-{j}-{i}".encode(), 0) for i in range(self.job_blocks)
            ]
            self.jobs.append((keys, j))

    @property
    def nbytes(self) -> int:
        return len(self.jobs) * self.job_blocks * self.block


def run_jobs(manager: AsyncTierManager, work: Workload, load: bool, poll_s: float) -> Figure:
    """Submit every job, ``in_flight`` at once, polling completions like a scheduler."""
    pending = deque(work.jobs)
    slots_free = deque(range(work.in_flight))
    running: dict[int, int] = {}
    failures = 0
    with measure(work.nbytes) as figure:
        while pending or running:
            while pending and slots_free:
                keys, job_id = pending.popleft()
                slot = slots_free.popleft()
                first = slot * work.job_blocks
                meta = JobMetadata(
                    job_id,
                    tuple(keys),
                    np.arange(first, first + work.job_blocks, dtype=np.int64),
                    is_promotion=load,
                )
                (manager.submit_load if load else manager.submit_store)(meta)
                running[job_id] = slot
            finished = list(manager.get_finished())
            for result in finished:
                slots_free.append(running.pop(result.job_id))
                failures += not result.success
            if not finished:
                time.sleep(poll_s)
    if failures:
        raise RuntimeError(f"{failures} {'load' if load else 'store'} jobs failed")
    return figure


def make_manager(
    root: Path,
    primary: Primary,
    total: int,
    block: int,
    args: argparse.Namespace,
    direct: bool,
    backend: str,
    **tier_options: Any,
) -> AsyncTierManager:
    tier = FileSystemTier(
        root_dir=root,
        capacity_bytes=total + 64 * MIB,
        io_backend=backend,
        direct_io=direct,
        queue_depth=args.queue_depth,
        max_io_bytes=args.max_io_kib * KIB,
        **tier_options,
    )
    return AsyncTierManager(
        tier,
        primary.view(),
        "fs",
        block_bytes=block,
        job_timeout_s=120.0,
        layout_fingerprint=f"bench-{block}",
    )


# -- the GIL probe ---------------------------------------------------------------------------


def loop_batches(stop: threading.Event, counts: list[int]) -> None:
    """A pure-Python scheduler stand-in: heap pushes/pops and dict updates in batches."""
    heap: list[tuple[int, int]] = []
    table: dict[int, int] = {}
    push, pop = heapq.heappush, heapq.heappop
    while not stop.is_set():
        for i in range(2000):
            push(heap, ((i * 7919) % 1000, i))
            table[i & 511] = i
            if len(heap) > 64:
                pop(heap)
        counts[0] += 1


def python_loop_rate(seconds: float, during: Callable[[], None] | None = None) -> float:
    stop, counts = threading.Event(), [0]
    thread = threading.Thread(target=loop_batches, args=(stop, counts), name="py-loop")
    thread.start()
    t0 = time.perf_counter()
    if during is None:
        time.sleep(seconds)
    else:
        while time.perf_counter() - t0 < seconds:
            during()
    stop.set()
    thread.join()
    return counts[0] / (time.perf_counter() - t0)


# -- authenticated blocks (auth_key_*) ------------------------------------------------------

MAC_KEY_ENV = "KV_TIERING_BENCH_MAC_KEY"


#: The tier's MACs measured beside the plain tier: the default first.
MACS = ("ghash-aes", "blake3", "hmac-sha256")


def bench_mac(name: str, block: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Store and load GB/s through the facade without ``auth_key_env`` and with it, under each
    ``auth_mac``, alternating.

    The tag is computed on the tier's loop thread: on store while the write is in flight, on
    load after the read.
    """
    total = args.total_mib * MIB
    primary = Primary(args.job_blocks * args.jobs_in_flight, block)
    os.environ[MAC_KEY_ENV] = os.urandom(32).hex()
    samples: dict[str, list[Figure]] = {}
    for label in ("plain", *MACS) * args.reps:
        root = scratch / f"tier-{name}-{label}"
        options = {} if label == "plain" else {"auth_key_env": MAC_KEY_ENV, "auth_mac": label}
        with make_manager(root, primary, total, block, args, True, "auto", **options) as manager:
            work = Workload(block, total, args.job_blocks, args.jobs_in_flight, f"{name}-{label}")
            store = run_jobs(manager, work, load=False, poll_s=args.poll_s)
            load = run_jobs(manager, work, load=True, poll_s=args.poll_s)
        samples.setdefault(f"store_{label}", []).append(store)
        samples.setdefault(f"load_{label}", []).append(load)
        shutil.rmtree(root, ignore_errors=True)
    medians = {label: median_figure(figures) for label, figures in samples.items()}
    return {k: {"gbps": f.gbps, "cpu_s_per_gb": f.cpu_per_gb} for k, f in medians.items()}


def report_mac(mac: dict[str, dict[str, Any]], reps: int) -> None:
    for name, r in mac.items():
        for phase in ("store", "load"):
            plain = r[f"{phase}_plain"]
            for label in MACS:
                keyed = r[f"{phase}_{label}"]
                print(
                    f"MAC {name} {phase:<5} {label:<12}: {plain['gbps']:.2f} GB/s without "
                    f"auth_key_*, {keyed['gbps']:.2f} with "
                    f"({keyed['gbps'] / (plain['gbps'] or 1):.2f}x); "
                    f"CPU s/GB {plain['cpu_s_per_gb']:.3f} -> {keyed['cpu_s_per_gb']:.3f} "
                    f"(O_DIRECT, median of {reps} alternating runs)"
                )
