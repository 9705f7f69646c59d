"""Scheduler step time while each tier serves a realistic job mix, against steps alone, in one run.

    .venv/bin/python benchmarks/engine_step.py            # every tier, ~1 minute
    .venv/bin/python benchmarks/engine_step.py --quick    # smaller counts
    .venv/bin/python benchmarks/engine_step.py --smoke    # seconds: spin control, memory tier
    .venv/bin/python benchmarks/engine_step.py --tiers memory fs-threads
    .venv/bin/python benchmarks/engine_step.py --forward-ms 2 --pin both  # GPU waits; pinning
    .venv/bin/python benchmarks/engine_step.py --forward-ms 2 --gil-hold-ms 1 off

The main thread plays an inference engine's scheduler thread. Each step it
runs a fixed pure-Python ``schedule()`` shaped like vLLM's v1 scheduler at a
realistic batch (``--running`` decoding requests, chunked prefill of waiting
ones under a token budget, block allocation from a free queue, prefix-cache
hash lookups, the per-request output dicts, then ``update_from_output``),
and then does what the offloading connector does with a secondary tier
through the real facade (:class:`~tiering.runtime.AsyncTierManager`): prefix
lookups, store (cascade) and load (promotion) jobs kept at ``--in-flight``
jobs per tier (the tier flat out), and ``get_finished``. ``--forward-ms``
adds a GIL-free wait after each step, as a real engine waits for the GPU's
forward pass (default 0: the scheduler thread never rests, the worst case).

For each tier (``memory``, ``fs-threads``, ``fs-uring``, ``redis`` on
loopback with a redis-server started here) the steps run alone and with the
tier, in alternating rounds, and the table reports the ``schedule()`` time
p50/p99 against the alone rounds (targets: p50 <= 1.10x, p99 <= 1.25x,
printed as met/missed), the whole step's wall time (facade calls included),
with ``--forward-ms`` the *wake* latency (how late the scheduler thread got
going after each forward wait: the sleep's overrun, which includes waiting for
the GIL while a tier's thread holds it; ``docs/runtime.md``, "The GIL"), the
tier's blocks/s and the CPU time per block of what runs it (its event-loop
thread; for a tier in a child process, that whole process). Each tier runs
twice by default (``--isolation both``): behind the default facade, its loop
thread in this process, and behind :class:`~tiering.isolation.IsolatedTierManager`,
in a child process attached to the same shared-memory primary rows. A tier that
cannot run here (io_uring unavailable, no redis-server) is skipped with the
reason. ``--pin on|both`` also runs rows with the scheduler thread on one CPU
and the tier on the others (the runtime's ``cpus`` option; ``docs/runtime.md``,
"Pinning"), and ``--gil-hold-ms 1 0.25 off`` a row per value of the runtime's
``max_gil_hold_ms`` (``off``: no GIL hand-offs), and ``--gc-handoff on
off`` a row per value of the runtime's ``gc_handoff`` (``off``: the
collections the tier's allocations call for run wherever CPython starts
them, most often in a scheduler step; ``docs/runtime.md``, "Garbage
collections"); the "GC steps" column counts the steps in which the scheduler
thread ran a collection. Three columns say where a slower step's time went:
"step CPU p50/p99" is the scheduler thread's own CPU time per ``schedule()``
against the alone rounds (a step that ran slower because the machine is
busy: caches and memory shared with the tier's CPU), "waited" the share of
steps in which that thread blocked (a voluntary context switch: waiting for
the GIL or anything else) and "preempted" the share in which the kernel put
another thread on its CPU (an involuntary one). A p50/p99 ratio with the CPU
ratio beside it and no waited or preempted steps is the shared hardware, the
class of the ``copy`` control, not the tier's GIL. "alone A/A" on each alone
row is the noise floor: the alone rounds' even half against their odd half
(identical steps), and a line under the table gives its range over the run's
rows; a tier's ratio inside that range is not told apart from the noise.
"paired p50 ratio" is the median over rounds of a round's p50 over that of
the alone round just before it (on an alone row, alone round against alone
round: the A/A of this estimator), which a drift of the machine slower than a
round does not move; the verdicts stay on the pooled ratios.
Control rows come first
(``--controls spin copy scatter hash disk``, the default): the same steps beside
another process on the other CPU that does no tiering (a pure-Python loop; numpy
copying 64 MiB over and over; random 256 KiB regions copied as a tier copies its
blocks; random 256 KiB regions checksummed and evicted from the caches as a tier
checksums its blocks; random 256 KiB O_DIRECT reads and writes of a file, the fs
tier's disk traffic), the machine's own floor under the tier rows. Figures of a
shared machine are noisy: compare within one run. The note under the table gives,
for a tier on a loop thread, how often the kernel preempted that thread beside the
steps (another thread or process put on its CPU, often while it held the GIL);
``--server-nice 10`` starts the redis rows' redis-server at a lower priority.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.engine_controls import NEIGHBOUR_WORK, NEIGHBOURS, bench_neighbour
from benchmarks.support.engine_report import TierRow, report
from benchmarks.support.rigs import TIERS, JobMix, Skip, open_tier
from benchmarks.support.scheduler import SCHEDULER_COLLECTIONS, Phase, ToyScheduler, run_steps
from tiering.runtime.affinity import allowed_cpus, format_cpu_list
from tiering.runtime.facade import DEFAULT_MAX_GIL_HOLD_MS


def bench_tier(
    kind: str,
    args: argparse.Namespace,
    scratch: Path,
    placement: str,
    pinned: bool = False,
    gil_hold_ms: float | None = DEFAULT_MAX_GIL_HOLD_MS,
    gc_handoff: bool = True,
) -> TierRow:
    where = [
        w
        for w, on in (
            ("child process", placement == "process"),
            ("pinned", pinned),
            ("no GIL hand-off", gil_hold_ms is None),
            (
                f"GIL hand-off {gil_hold_ms} ms",
                gil_hold_ms not in (None, DEFAULT_MAX_GIL_HOLD_MS),
            ),
            ("no GC hand-off", not gc_handoff),
        )
        if on
    ]
    row = TierRow(f"{kind} ({', '.join(where)})" if where else kind, "", placement)
    cpus = args.cpus
    tier_cpus = frozenset(cpus[1:]) if pinned else None
    # This (the scheduler) thread only: on its CPU for a pinned row, back on all for the next.
    os.sched_setaffinity(0, {cpus[0]} if pinned else cpus)
    try:
        with open_tier(kind, args, scratch, placement, tier_cpus, gil_hold_ms, gc_handoff) as rig:
            row.description = rig.description
            scheduler = ToyScheduler(args.running)
            mix = JobMix(rig.manager, args.in_flight, args.blocks_per_job, args.lookups)
            loop_cpu = rig.tier_cpu
            # Warm up: first stores, allocations.
            run_steps(scheduler, args.warm_s, mix.step, Phase())
            mix.finish()
            run_steps(scheduler, args.warm_s, None, Phase())
            blocks0, cpu0, busy_s = mix.blocks_moved, loop_cpu(), 0.0
            preempted, preemptions = 0, rig.loop_preemptions or (lambda: 0)
            for _ in range(args.rounds):
                slice_s, forward_s = args.seconds / args.rounds / 2, args.forward_ms / 1e3
                run_steps(scheduler, slice_s, None, row.alone, forward_s)
                t0, before = time.perf_counter(), preemptions()
                run_steps(scheduler, slice_s, mix.step, row.busy, forward_s)
                busy_s += time.perf_counter() - t0
                preempted += preemptions() - before
                mix.finish()  # between rounds: the alone steps see an idle tier
            if rig.loop_preemptions and busy_s:
                row.loop_preemptions_per_s = preempted / busy_s
            moved = mix.blocks_moved - blocks0
            row.blocks_per_s = moved / busy_s if busy_s else 0.0
            row.loop_cpu_us_per_block = (loop_cpu() - cpu0) / moved * 1e6 if moved else 0.0
            row.failures = mix.failures
    except Skip as exc:
        row.skipped = str(exc)
    return row


def _hold_ms(text: str) -> float | None:
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'off', got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of ms, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.ERROR)
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--tiers",
        nargs="+",
        default=None,
        choices=TIERS,
        help="the tiers to measure (default all; with --smoke, memory)",
    )
    parser.add_argument(
        "--controls",
        nargs="*",
        default=None,
        choices=list(NEIGHBOURS),
        help="control rows first: another process busy on the other CPU with no tier at all ("
        + "; ".join(f"{kind}: {work}" for kind, work in NEIGHBOUR_WORK.items())
        + "), the machine's floor under the tier rows (default all; with --smoke, spin; none "
        "with an empty list)",
    )
    parser.add_argument("--quick", action="store_true", help="short phases (checks the script)")
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds: --quick's sizes, 2 short rounds, the spin control and the memory "
        "tier unless --controls / --tiers say otherwise",
    )
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per tier")
    parser.add_argument(
        "--rounds",
        type=int,
        default=16,
        help="alone/with-tier alternations (default 16: a quarter of a second per phase; "
        "with 4 the alone rounds' A/A reached 1.83x, docs/runtime.md)",
    )
    parser.add_argument("--running", type=int, default=256, help="requests in the batch")
    parser.add_argument("--block-kib", type=int, default=256, help="tier block size (KiB)")
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=16, help="jobs kept in flight per tier")
    parser.add_argument("--lookups", type=int, default=32, help="tier lookups per step")
    parser.add_argument("--tier-mib", type=int, default=512, help="tier capacity (MiB)")
    parser.add_argument("--scratch", type=Path, default=None, help="directory for fs/redis files")
    parser.add_argument(
        "--isolation",
        choices=("thread", "process", "both"),
        default="both",
        help="where each tier runs: a loop thread in this process (the default facade), a "
        "child process (IsolatedTierManager), or both, one after the other (default)",
    )
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="GIL-free wait after each step, as for a GPU forward pass (default 0: the "
        "scheduler thread never rests, the worst case)",
    )
    parser.add_argument(
        "--pin",
        choices=("off", "on", "both"),
        default="off",
        help="on: the scheduler thread on the first CPU this process may use, every tier "
        "(its loop thread and the threads it starts, or its process; redis-server too) on "
        "the others, through the runtime's cpus option; both: every row unpinned, then "
        "pinned (default off)",
    )
    parser.add_argument(
        "--gil-hold-ms",
        nargs="+",
        type=_hold_ms,
        default=[DEFAULT_MAX_GIL_HOLD_MS],
        metavar="MS|off",
        help="the runtime's max_gil_hold_ms for each row, one row per value ('off': no GIL "
        f"hand-offs; default {DEFAULT_MAX_GIL_HOLD_MS:g})",
    )
    parser.add_argument(
        "--gc-handoff",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="the runtime's gc_handoff for each tier row, one row per value (default on)",
    )
    parser.add_argument(
        "--server-nice",
        type=int,
        default=0,
        metavar="N",
        help="the nice value of the redis-server the redis rows start (default 0). Where it "
        "shares the tier's CPU, each time it preempts the tier's loop thread while that holds "
        "the GIL, a scheduler back from the GPU waits out its time slice too (docs/runtime.md, "
        '"A loop thread\'s CPU"); 10 gives the loop thread the larger share',
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (default: leave CPython's 5 ms)",
    )
    args = parser.parse_args(argv)
    cpus = args.cpus = sorted(allowed_cpus())  # before any row pins this thread
    if not 0 <= args.server_nice <= 19:
        parser.error(f"--server-nice must be 0-19 (a lower priority), got {args.server_nice}")
    if args.pin != "off" and len(cpus) < 2:
        parser.error(f"--pin needs at least 2 CPUs; this process may use {cpus}")
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.quick or args.smoke:
        args.seconds, args.rounds, args.running = 1.0, 2, 64
        args.block_kib, args.blocks_per_job, args.in_flight, args.tier_mib = 64, 4, 4, 32
    args.warm_s = 0.2  # warm-up steps of each row before it is measured
    if args.smoke:
        args.seconds, args.warm_s = 0.4, 0.05
    if args.tiers is None:
        args.tiers = ["memory"] if args.smoke else list(TIERS)
    if args.controls is None:
        args.controls = ["spin"] if args.smoke else list(NEIGHBOURS)
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, batch of {args.running} "
        f"requests; tier blocks {args.block_kib} KiB x {args.blocks_per_job} per job, "
        f"{args.in_flight} jobs in flight, {args.lookups} lookups/step, "
        f"{args.forward_ms:g} ms forward wait per step; "
        f"switch interval {sys.getswitchinterval() * 1e3:g} ms; "
        + (
            f"pinned rows: scheduler on CPU {cpus[0]}, tiers on {format_cpu_list(cpus[1:])}. "
            if args.pin != "off"
            else ""
        )
        + "Shared machines are noisy: "
        "compare within one run.\n"
    )
    with (
        tempfile.TemporaryDirectory(prefix="engine-step-", dir=args.scratch) as tmp,
        SCHEDULER_COLLECTIONS,
    ):
        placements = ("thread", "process") if args.isolation == "both" else (args.isolation,)
        pinnings = {"off": (False,), "on": (True,), "both": (False, True)}[args.pin]
        rows = [
            bench_neighbour(kind, args, Path(tmp), pinned)
            for kind in args.controls
            for pinned in pinnings
        ]
        rows += [
            bench_tier(kind, args, Path(tmp), placement, pinned, gil_hold_ms, gc_here == "on")
            for kind in args.tiers
            for placement in placements
            for pinned in pinnings
            for gil_hold_ms in args.gil_hold_ms
            for gc_here in args.gc_handoff
        ]
    report(rows, args)


if __name__ == "__main__":
    main()
