"""Issue 20.4 as a measurement: the memory tier in-process against the same tier in a child process.

    .venv/bin/python benchmarks/isolation.py            # ~30 s
    .venv/bin/python benchmarks/isolation.py --quick    # checks the script
    .venv/bin/python benchmarks/isolation.py --smoke    # the same, shorter

The question: does taking a tier's event-loop thread out of the scheduler's
process (so out of its GIL) bring the scheduler step back to its alone time,
and what does the hand-off cost the scheduler instead? Three phases, in
alternating rounds, the scheduler thread running the vLLM-shaped
``schedule()`` of ``benchmarks/engine_step.py`` (:mod:`benchmarks.support.scheduler`)
back to back:

* ``alone``: steps only;
* ``in-process``: the in-memory tier behind the real facade, flat out
  (``--in-flight`` jobs kept queued), as ``engine_step.py`` runs it;
* ``child process``: the same tier and facade in a child process attached to
  the same shared-memory primary buffer (``HostBuffer.attach``); the
  scheduler sends each job as a small tuple over a pipe and polls the pipe
  for results (a stand-in for the shared-memory ring the issue sketches: one
  system call per message here, where a ring needs none, so the hand-off
  figure is an upper bound).

Reports the ``schedule()`` p50/p99 against alone, the whole step (hand-offs
included), and blocks/s. Keep an isolation mode only if the child row meets
the targets where the in-process row does not. On a machine with fewer cores
than busy threads the child competes for a core instead of for the GIL: the
figures only mean something on a machine with a spare core.
"""

from __future__ import annotations

import argparse
import logging
import multiprocessing as mp
import os
import sys
import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import KIB, pct, print_markdown_table
from benchmarks.support.scheduler import P50_TARGET, P99_TARGET, Phase, ToyScheduler, run_steps
from tiering.core.jobs import JobMetadata
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.primary.host_buffer import HostBuffer, make_shared_name
from tiering.runtime import AsyncTierManager
from tiers.memory import MemoryTier

# A job on the wire: (job_id, keys, first primary row, is_load); a result: (job_id, success).
Job = tuple[int, tuple[OffloadKey, ...], int, bool]


def serve(conn: Connection, shared_name: str, rows: int, block: int, capacity: int) -> None:
    """The child: the tier behind a facade over the shared primary buffer, fed by ``conn``."""
    logging.basicConfig(level=logging.ERROR)
    host = HostBuffer.attach(shared_name, rows, block)
    manager = AsyncTierManager(
        MemoryTier(capacity_blocks=capacity), host.view, "memory", job_timeout_s=120.0
    )
    conn.send("ready")
    try:
        while True:
            # Wait for work (the pipe) or for results, whichever comes first.
            if conn.poll(0.0002):
                message = conn.recv()
                if message is None:
                    break
                for job_id, keys, first_row, load in message:
                    ids = np.arange(first_row, first_row + len(keys), dtype=np.int64)
                    meta = JobMetadata(job_id, keys, ids, load)
                    (manager.submit_load if load else manager.submit_store)(meta)
            done = [(r.job_id, r.success) for r in manager.get_finished()]
            if done:
                conn.send(done)
    finally:
        manager.shutdown()
        host.close()


class Feeder:
    """The scheduler side's job mix (as ``rigs.JobMix``), sending jobs via ``submit``."""

    def __init__(self, in_flight: int, per_job: int, tag: str) -> None:
        self.per_job = per_job
        self.free_slots = list(range(in_flight))
        self.jobs: dict[int, tuple[int, tuple[OffloadKey, ...], bool]] = {}
        self.stored: list[tuple[OffloadKey, ...]] = []
        self.next_job = 0
        self.next_key = 0
        self.blocks_moved = 0
        self.store_next = True
        self.tag = tag.encode()

    def finished(self, results: list[tuple[int, bool]]) -> None:
        for job_id, success in results:
            slot, keys, load = self.jobs.pop(job_id)
            self.free_slots.append(slot)
            if success:
                self.blocks_moved += len(keys)
                if not load:
                    self.stored.append(keys)
                    if len(self.stored) > 256:
                        del self.stored[0]

    def refill(self) -> list[Job]:
        out: list[Job] = []
        while self.free_slots:
            slot = self.free_slots.pop()
            load = not self.store_next and bool(self.stored)
            self.store_next = not self.store_next
            if load:
                keys = self.stored[self.next_job % len(self.stored)]
            else:
                base, self.next_key = self.next_key, self.next_key + self.per_job
                keys = tuple(
                    make_offload_key(self.tag + (base + i).to_bytes(8, "big"), 0)
                    for i in range(self.per_job)
                )
            self.next_job += 1
            self.jobs[self.next_job] = (slot, keys, load)
            out.append((self.next_job, keys, slot * self.per_job, load))
        return out


def in_process_step(manager: AsyncTierManager, feeder: Feeder) -> Callable[[], None]:
    def step() -> None:
        feeder.finished([(r.job_id, r.success) for r in manager.get_finished()])
        for job_id, keys, first_row, load in feeder.refill():
            ids = np.arange(first_row, first_row + len(keys), dtype=np.int64)
            meta = JobMetadata(job_id, keys, ids, load)
            (manager.submit_load if load else manager.submit_store)(meta)

    return step


def child_step(conn: Connection, feeder: Feeder) -> Callable[[], None]:
    def step() -> None:
        while conn.poll():
            feeder.finished(conn.recv())
        jobs = feeder.refill()
        if jobs:
            conn.send(jobs)

    return step


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.ERROR)
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--quick", action="store_true", help="small counts (checks the script)")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: --quick, shorter")
    parser.add_argument("--seconds", type=float, default=24.0, help="measured seconds in all")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--running", type=int, default=256, help="requests in the batch")
    parser.add_argument("--block-kib", type=int, default=256)
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=16)
    parser.add_argument("--capacity-blocks", type=int, default=2048)
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="GIL-free wait after each step (the GPU's forward pass; default 0: never rests)",
    )
    args = parser.parse_args(argv)
    if args.quick or args.smoke:
        args.seconds, args.rounds, args.running = 1.5, 1, 64
        args.block_kib, args.blocks_per_job, args.in_flight, args.capacity_blocks = 64, 4, 4, 256
    if args.smoke:
        args.seconds = 0.6
    block = args.block_kib * KIB
    rows = args.in_flight * args.blocks_per_job
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; memory tier, blocks "
        f"{args.block_kib} KiB x {args.blocks_per_job} per job, {args.in_flight} jobs in flight; "
        f"batch of {args.running} requests. Noisy on shared machines: compare within one run.\n"
    )
    name = make_shared_name("isolation")
    phases = {"alone": Phase(), "in-process": Phase(), "child process": Phase()}
    moved: dict[str, list[float]] = {"in-process": [], "child process": []}
    with HostBuffer.create(rows, block, shared_name=name) as host:
        host.as_numpy()[:] = 7
        parent, child_end = mp.get_context("spawn").Pipe()
        child = mp.get_context("spawn").Process(
            target=serve, args=(child_end, name, rows, block, args.capacity_blocks), daemon=True
        )
        child.start()
        if not parent.poll(120) or parent.recv() != "ready":
            raise RuntimeError("the child process did not start its tier within 120 s")
        manager = AsyncTierManager(
            MemoryTier(capacity_blocks=args.capacity_blocks),
            host.view,
            "memory",
            job_timeout_s=120.0,
        )
        try:
            scheduler = ToyScheduler(args.running)
            slice_s = args.seconds / args.rounds / 3
            for round_ in range(args.rounds):
                run_steps(scheduler, slice_s, None, phases["alone"], args.forward_ms / 1e3)
                for label in ("in-process", "child process"):
                    feeder = Feeder(args.in_flight, args.blocks_per_job, f"{label}-{round_}")
                    step: Callable[[], None]
                    if label == "in-process":
                        step = in_process_step(manager, feeder)
                    else:
                        step = child_step(parent, feeder)
                    t0 = time.perf_counter()
                    run_steps(scheduler, slice_s, step, phases[label], args.forward_ms / 1e3)
                    moved[label].append(feeder.blocks_moved / (time.perf_counter() - t0))
                    _settle(label, manager, parent, feeder)
        finally:
            manager.shutdown()
            parent.send(None)
            child.join(30)
            if child.is_alive():
                child.kill()
            host.unlink()
    report(phases, moved)


def _settle(label: str, manager: AsyncTierManager, conn: Connection, feeder: Feeder) -> None:
    """Let the phase's jobs finish before the next phase (they must not overlap)."""
    deadline = time.monotonic() + 120
    while feeder.jobs and time.monotonic() < deadline:
        if label == "in-process":
            feeder.finished([(r.job_id, r.success) for r in manager.get_finished()])
        elif conn.poll(0.01):
            feeder.finished(conn.recv())
        time.sleep(0.001)


def report(phases: dict[str, Phase], moved: dict[str, list[float]]) -> None:
    alone = phases["alone"]
    a50, a99 = pct(alone.schedule_s, 50), pct(alone.schedule_s, 99)
    header = ("where the tier runs", "schedule p50 us", "p50 ratio", "schedule p99 us",
              "p99 ratio", "step p50/p99 us", "blocks/s", "targets (p50/p99)")  # fmt: skip
    lines: list[tuple[str, ...]] = []
    for label, phase in phases.items():
        b50, b99 = pct(phase.schedule_s, 50), pct(phase.schedule_s, 99)
        rate: Any = moved.get(label)
        lines.append(
            (
                label,
                f"{b50 * 1e6:.0f}",
                f"{b50 / a50:.2f}x",
                f"{b99 * 1e6:.0f}",
                f"{b99 / a99:.2f}x",
                f"{pct(phase.step_s, 50) * 1e6:.0f} / {pct(phase.step_s, 99) * 1e6:.0f}",
                f"{np.median(rate):,.0f}" if rate else "-",
                "-"
                if label == "alone"
                else f"{'met' if b50 / a50 <= P50_TARGET else 'missed'} / "
                f"{'met' if b99 / a99 <= P99_TARGET else 'missed'}",
            )
        )
    print_markdown_table(header, lines)


if __name__ == "__main__":
    main()
