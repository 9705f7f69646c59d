"""Scheduler-thread costs of the async tier facade, and the hand-off choices behind it.

    .venv/bin/python benchmarks/facade.py            # full run (~1 minute)
    .venv/bin/python benchmarks/facade.py --quick    # smaller counts
    .venv/bin/python benchmarks/facade.py --smoke    # a few seconds (checks the script)

Sections (every figure measured in this run, on this machine):

1. Hand-off scheduler -> loop: cost of one submit on the scheduler thread while
   the loop is busy with earlier jobs, and pipelined jobs/s, for
   anyio's ``BlockingPortal.start_task_soon``, ``run_coroutine_threadsafe``,
   ``call_soon_threadsafe`` per job, ``janus`` and the
   :class:`~tiering.runtime.mailbox.Mailbox` the facade uses.
2. Hand-back loop -> scheduler: the loop's cost to publish one result, the
   scheduler's cost to poll an empty channel and to drain one item, for
   ``queue.SimpleQueue`` (used), ``collections.deque``, ``janus`` and an
   ``asyncio.Queue`` (read from the scheduler with a round trip).
3. The facade with the in-memory tier: ``submit_store``/``submit_load``
   median and p99 while the loop is busy, ``lookup``, ``get_finished`` with
   nothing ready, and jobs/s end to end. Targets: submit <= 10 us median and
   <= 50 us p99, lookup and empty get_finished <= 2 us.
4. GIL: how much a pure-Python loop on the scheduler thread slows down while
   the in-memory tier runs flat out (target <= 1.25x), against the same loop
   alone, measured in the same run; the alone row is that loop against itself
   (A/A: the later alone run of each round against the earlier one), the run's
   own noise held to the same target.
5. GIL per bulk call: the same scheduler batches while one call that moves or
   hashes block bytes runs flat out on another thread: checksums (xxh3, as
   the runtime's verify mode and the fs/Redis tiers use them), the memory
   tier's copies and the host copy engine's, each before (the Python-level
   loop of copies it replaced) and after (one bulk call per job:
   ``tiering.copy.bulk.copy_regions``). Slowdowns of the batch's p50 and p99.
6. anyio replacements: ``LoopThread.call`` (anyio's blocking portal) against
   a bare ``run_coroutine_threadsafe`` round trip (the control path: open,
   shutdown), and ``AsyncTier.run_in_thread`` (``anyio.to_thread`` under the
   tier's ``CapacityLimiter``) against the ``asyncio.to_thread`` it replaced.

The machine is shared and noisy: compare figures within one run.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.support.common import print_markdown_table
from benchmarks.support.facade_calls import bench_anyio, bench_facade
from benchmarks.support.facade_gil import bench_bulk_gil, bench_gil
from benchmarks.support.facade_handoffs import bench_handback, bench_handoff

Row = tuple[str, ...]


def table(title: str, header: Row, rows: list[Row]) -> None:
    print(f"\n## {title}\n")
    print_markdown_table(header, rows)


def main() -> None:
    logging.basicConfig(level=logging.ERROR)
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="smaller counts (~15 s)")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: tiny counts")
    parser.add_argument("--block-kib", type=int, default=64, help="block size in KiB (default 64)")
    parser.add_argument("--blocks-per-job", type=int, default=8)
    parser.add_argument(
        "--only-bulk", action="store_true", help="only section 5 (GIL per bulk call)"
    )
    args = parser.parse_args()
    n = 5000 if args.quick else 20000
    jobs = 2000 if args.quick else 10000
    seconds = 1.5 if args.quick else 4.0
    if args.smoke:
        n, jobs, seconds = 300, 100, 0.3
    block_bytes = args.block_kib * 1024
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, blocks {args.block_kib} KiB x "
        f"{args.blocks_per_job} per job; shared machine: figures are noisy, compare within a run"
    )
    if args.only_bulk:
        _bulk_table(seconds, args.blocks_per_job, block_bytes)
        return

    table(
        "1. Hand-off scheduler -> loop (cost per submit on the scheduler, loop busy)",
        ("method", "submit p50 us", "submit p99 us", "pipelined jobs/s"),
        bench_handoff(n),
    )
    table(
        "2. Hand-back loop -> scheduler (per result)",
        (
            "method",
            "loop put us",
            "scheduler drain us/item",
            "empty poll p50 us",
            "empty poll p99 us",
        ),
        bench_handback(n * 5),
    )
    cost_rows, throughput_rows = bench_facade(jobs, args.blocks_per_job, block_bytes)
    table(
        "3a. AsyncTierManager over MemoryTier: scheduler-thread cost per call",
        ("call", "p50 us", "p99 us", "target us", "verdict"),
        cost_rows,
    )
    table(
        "3b. End to end with MemoryTier (submit all, drain)",
        ("direction", "jobs/s", "blocks/s", "GB/s"),
        throughput_rows,
    )
    table(
        "4. GIL: pure-Python scheduler batches while the memory tier works",
        (
            "scenario",
            "work p50 us",
            "work p99 us",
            "work slowdown",
            "wall slowdown",
            "tier jobs/s",
            "<= 1.25x",
        ),
        bench_gil(seconds, args.blocks_per_job, block_bytes),
    )
    _bulk_table(seconds, args.blocks_per_job, block_bytes)
    table(
        "6. anyio replacements: control round trip (scheduler) and a blocking call in a thread",
        ("call", "p50 us", "p99 us"),
        bench_anyio(n),
    )


def _bulk_table(seconds: float, per_job: int, block_bytes: int) -> None:
    table(
        "5. GIL per bulk call: scheduler batches while one call runs flat out on another thread",
        (
            "call (back to back on another thread)",
            "batch p50 us",
            "batch p99 us",
            "p50 slowdown",
            "p99 slowdown",
            "call GB/s",
            "p99 <= 1.25x",
        ),
        bench_bulk_gil(seconds, per_job, block_bytes),
    )


if __name__ == "__main__":
    main()
