"""CPU time per block on each tier's event-loop thread: the Python a tier costs the GIL.

    .venv/bin/python benchmarks/loop_cost.py            # every tier
    .venv/bin/python benchmarks/loop_cost.py --quick    # small counts (checks the script)
    .venv/bin/python benchmarks/loop_cost.py --smoke    # the same, for the smoke test

Every microsecond a tier's loop thread spends running Python is a microsecond
the scheduler thread cannot run (one GIL). For each tier (``memory``,
``fs-threads``, ``fs-uring``, ``redis`` on loopback) this stores and then loads
``--jobs`` jobs of ``--blocks-per-job`` blocks through the real facade, with
``--in-flight`` jobs outstanding, and reports CPU microseconds per block:

* on the tier's event-loop thread (``pthread_getcpuclockid``): the facade's
  service, the tier's coroutines, and whatever the tier runs inline (copies,
  checksums, system calls); the figure to keep small;
* on the calling (scheduler) thread: ``submit_*`` and ``get_finished``;
* on every other thread of the process (I/O worker threads, copy lanes).

Each block size starts with the floor, measured in the same run: a null tier
(it keeps keys, moves and checksums no bytes) through the same facade and jobs,
what the facade's service and the asyncio loop cost the loop thread per block
whatever the tier does; "loop x floor" is each tier's loop-thread figure over it.

Small blocks show the per-block Python (the part that does not shrink with
bytes), large blocks the per-byte part. A tier that cannot run here is
skipped with the reason. CPU times are less noisy than wall times on a shared
machine, but still compare within one run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import print_markdown_table
from benchmarks.support.rigs import NULL_TIER, TIERS, Skip, open_tier, thread_cpu
from tiering.core.jobs import JobMetadata
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.runtime import AsyncTierManager


def run_jobs(
    manager: AsyncTierManager,
    jobs: list[tuple[OffloadKey, ...]],
    in_flight: int,
    per_job: int,
    *,
    load: bool,
    first_id: int,
) -> int:
    """Run ``jobs`` with ``in_flight`` outstanding; return the blocks that moved."""
    free = list(range(in_flight))
    pending: dict[int, int] = {}
    moved = 0
    next_job = 0
    while next_job < len(jobs) or pending:
        while free and next_job < len(jobs):
            slot = free.pop()
            rows = np.arange(slot * per_job, (slot + 1) * per_job, dtype=np.int64)
            job_id = first_id + next_job
            meta = JobMetadata(job_id, jobs[next_job], rows, load)
            pending[job_id] = slot
            (manager.submit_load if load else manager.submit_store)(meta)
            next_job += 1
        results = list(manager.get_finished())
        if not results:
            time.sleep(0.0002)  # the scheduler between steps: no GIL held
        for result in results:
            free.append(pending.pop(result.job_id))
            if result.success:
                moved += len(jobs[result.job_id - first_id])
    return moved


@dataclass
class Cost:
    """CPU time per block moved in one direction, on each kind of thread."""

    direction: str
    moved: int
    asked: int
    loop_us: float
    scheduler_us: float
    other_us: float
    blocks_per_s: float


def measure(kind: str, args: argparse.Namespace, scratch: Path) -> list[Cost] | str:
    """Store then load ``args.jobs`` jobs through ``kind``'s facade (a reason if it is skipped)."""
    try:
        with open_tier(kind, args, scratch) as rig:
            manager = rig.manager
            loop_cpu = thread_cpu(manager._thread.thread)
            main_cpu: Callable[[], float] = time.thread_time
            per_job = args.blocks_per_job
            jobs = [
                tuple(
                    make_offload_key(f"loop-cost-{kind}-{j}-{i}".encode(), 0)
                    for i in range(per_job)
                )
                for j in range(args.jobs)
            ]
            warm = [tuple(make_offload_key(f"warm-{kind}-{i}".encode(), 0) for i in range(per_job))]
            run_jobs(manager, warm, 1, per_job, load=False, first_id=10**9)
            costs = []
            for load in (False, True):
                t_loop, t_main, t_proc = loop_cpu(), main_cpu(), time.process_time()
                wall = time.perf_counter()
                moved = run_jobs(
                    manager, jobs, args.in_flight, per_job, load=load, first_id=1 + load * 10**6
                )
                wall = time.perf_counter() - wall
                d_loop, d_main = loop_cpu() - t_loop, main_cpu() - t_main
                d_other = time.process_time() - t_proc - d_loop - d_main
                per = 1e6 / moved if moved else float("nan")
                costs.append(
                    Cost(
                        "load" if load else "store",
                        moved,
                        len(jobs) * per_job,
                        d_loop * per,
                        d_main * per,
                        max(0.0, d_other) * per,
                        moved / wall,
                    )
                )
            return costs
    except Skip as exc:
        return str(exc)


def cells(label: str, cost: Cost, floor: Cost | None) -> tuple[str, ...]:
    ratio = "-"
    if floor is not None and floor.loop_us > 0:
        ratio = f"{cost.loop_us / floor.loop_us:.2f}x"
    return (
        label,
        cost.direction,
        f"{cost.moved}/{cost.asked}",
        f"{cost.loop_us:.1f}",
        ratio,
        f"{cost.scheduler_us:.1f}",
        f"{cost.other_us:.1f}",
        f"{cost.blocks_per_s:,.0f}",
    )


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.ERROR)
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tiers", nargs="+", default=list(TIERS), choices=TIERS)
    parser.add_argument("--quick", action="store_true", help="small counts (checks the script)")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: --quick's counts")
    parser.add_argument("--block-kib", type=int, nargs="+", default=[16, 256])
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--jobs", type=int, default=400, help="jobs per direction")
    parser.add_argument("--in-flight", type=int, default=8)
    parser.add_argument("--tier-mib", type=int, default=0, help="tier capacity (0: fits all)")
    parser.add_argument("--scratch", type=Path, default=None, help="directory for fs/redis files")
    parser.set_defaults(server_nice=0)  # open_tier's redis-server priority: left alone here
    args = parser.parse_args(argv)
    if args.quick or args.smoke:
        args.block_kib, args.jobs, args.blocks_per_job, args.in_flight = [16], 20, 4, 2
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, {args.jobs} jobs x "
        f"{args.blocks_per_job} blocks per direction, {args.in_flight} in flight. "
        f"CPU microseconds per block moved (threads alive now: {threading.active_count()}).\n"
    )
    header = ("tier", "direction", "blocks ok", "loop thread us/block", "loop x floor",
              "scheduler us/block", "other threads us/block", "blocks/s")  # fmt: skip
    lines: list[tuple[str, ...]] = []
    skipped: dict[str, str] = {}
    floors: dict[int, list[Cost]] = {}
    for block_kib in args.block_kib:
        args.block_kib = block_kib
        need = (args.jobs + 1) * args.blocks_per_job * block_kib // 1024 + 16
        args.tier_mib = max(args.tier_mib, need)
        with tempfile.TemporaryDirectory(prefix="loop-cost-", dir=args.scratch) as tmp:
            floor = measure(NULL_TIER, args, Path(tmp))
            if isinstance(floor, str):
                raise SystemExit(f"the null tier (the floor) did not run: {floor}")
            floors[block_kib] = floor
            by_direction = {cost.direction: cost for cost in floor}
            lines += [cells(f"floor: null tier ({block_kib} KiB)", c, c) for c in floor]
            for kind in args.tiers:
                got = measure(kind, args, Path(tmp))
                if isinstance(got, str):
                    skipped[kind] = got
                    continue
                label = f"{kind} ({block_kib} KiB)"
                lines += [cells(label, c, by_direction.get(c.direction)) for c in got]
    print_markdown_table(header, lines)
    print()
    for block_kib, floor in floors.items():
        figures = ", ".join(f"{c.direction} {c.loop_us:.1f}" for c in floor)
        print(
            f"floor ({block_kib} KiB): a null tier (keys only: no bytes moved or checksummed) "
            f"through the same facade and jobs costs the loop thread {figures} us/block in this "
            f"run; 'loop x floor' is each tier's loop-thread figure over it"
        )
    for kind, reason in skipped.items():
        print(f"\n- {kind}: skipped: {reason}")


if __name__ == "__main__":
    main()
