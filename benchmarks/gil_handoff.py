"""How long a thread back from a GIL-free wait waits for the GIL while a tier's loop is busy.

    .venv/bin/python benchmarks/gil_handoff.py            # ~1 minute
    .venv/bin/python benchmarks/gil_handoff.py --quick    # checks the script
    .venv/bin/python benchmarks/gil_handoff.py --smoke    # a few seconds

The main thread plays the scheduler: it sleeps ``--forward-ms`` (the GPU's
forward pass; the GIL is free), then runs ``--step-us`` of pure Python (its
``schedule()``), again and again. Meanwhile a real
:class:`~tiering.runtime.LoopThread` runs a busy workload: callbacks of
``--callback-us`` of Python each, either yielding to the loop (``await
asyncio.sleep(0)``: a non-blocking poll per iteration) or echoing a small
message over a socket pair (the loop finds I/O ready at each poll, as a tier
busy with network replies does). Each row is one ``max_gil_hold_ms`` value
(``off``: a plain asyncio loop, CPython's GIL alone) and reports:

* the **wake** latency of the scheduler thread: how much later than asked it
  got going after each sleep (p50 / p99 / max), which is the time it waited
  for the GIL; with nothing running it is the sleep's own overrun (the
  ``alone`` row);
* the loop's **work** rate with the scheduler running, and without it
  (nobody waiting for the GIL), each against the ``off`` row's: what the
  hand-offs cost the tier.

A row's measurement lasts ``--seconds`` however long each wake takes: with
hand-offs off a single wake can take seconds. ``docs/runtime.md``, "The GIL",
explains the mechanism. Figures of a shared machine are noisy: compare rows
of one run.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import pct, print_markdown_table
from tiering.runtime import LoopThread
from tiering.runtime.facade import DEFAULT_MAX_GIL_HOLD_MS

WORKLOADS = ("yield", "socket")


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


async def busy_loop(
    stop: threading.Event, callback_s: float, workload: str, done: list[int]
) -> None:
    """Callbacks of ``callback_s`` of Python until ``stop``, counted in ``done[0]``."""
    if workload == "yield":
        while not stop.is_set():
            spin(callback_s)
            done[0] += 1
            await asyncio.sleep(0)
        return
    left, right = socket.socketpair()
    reader, writer = await asyncio.open_connection(sock=left)
    peer_reader, peer_writer = await asyncio.open_connection(sock=right)
    try:
        while not stop.is_set():
            writer.write(b"x" * 64)
            await writer.drain()
            await peer_reader.readexactly(64)
            spin(callback_s)
            done[0] += 1
    finally:
        for stream in (writer, peer_writer):
            stream.close()
        del reader


@dataclass
class Row:
    label: str
    wake_s: list[float]
    work_per_s: float = 0.0
    work_alone_per_s: float = 0.0


def scheduler_steps(seconds: float, forward_s: float, step_s: float) -> list[float]:
    """Sleep, then Python, for ``seconds``; each sleep's overrun."""
    wakes: list[float] = []
    end = time.perf_counter() + seconds
    while not wakes or time.perf_counter() < end:  # one step at least, however late
        slept = time.perf_counter()
        time.sleep(forward_s)
        wakes.append(time.perf_counter() - slept - forward_s)
        spin(step_s)
    return wakes


def run_loop(hold_ms: float | None, args: argparse.Namespace, with_scheduler: bool) -> Row:
    label = "off" if hold_ms is None else f"{hold_ms:g} ms"
    hold_s = None if hold_ms is None else hold_ms / 1e3
    stop = threading.Event()
    done = [0]  # written by the loop thread only; read here at the window's two ends
    with LoopThread(f"bench-gil-{label}", max_gil_hold_s=hold_s) as portal:
        future = portal.portal.start_task_soon(
            busy_loop, stop, args.callback_us / 1e6, args.workload, done
        )
        time.sleep(0.05)  # the loop is busy before the scheduler starts
        started, done_before = time.perf_counter(), done[0]
        if with_scheduler:
            wakes = scheduler_steps(args.seconds, args.forward_ms / 1e3, args.step_us / 1e6)
        else:
            wakes = []
            time.sleep(args.seconds)
        elapsed, work = time.perf_counter() - started, done[0] - done_before
        stop.set()
        future.result(timeout=60)
    return Row(label, wakes, work_per_s=work / elapsed)


def _ratio(value: float, base: float) -> str:
    return f"{value / base:.2f}x" if base else "-"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=3.0, help="measured seconds per row")
    parser.add_argument("--forward-ms", type=float, default=2.0, help="the scheduler's sleep")
    parser.add_argument("--step-us", type=float, default=500.0, help="the scheduler's Python")
    parser.add_argument("--callback-us", type=float, default=100.0, help="Python per loop callback")
    parser.add_argument("--workload", choices=WORKLOADS, nargs="+", default=list(WORKLOADS))
    parser.add_argument(
        "--holds",
        nargs="+",
        default=["off", "2", f"{DEFAULT_MAX_GIL_HOLD_MS:g}", "0.5"],
        help="max_gil_hold_ms values, one row each ('off': no hand-offs)",
    )
    parser.add_argument("--quick", action="store_true", help="short rows (checks the script)")
    parser.add_argument("--smoke", action="store_true", help="a few seconds: shorter rows still")
    args = parser.parse_args(argv)
    if args.quick:
        args.seconds = 0.3
    if args.smoke:
        args.seconds = 0.1
    holds = [None if h == "off" else float(h) for h in args.holds]
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; scheduler: "
        f"{args.forward_ms:g} ms sleep + {args.step_us:g} us Python per step; loop callbacks "
        f"{args.callback_us:g} us; switch interval {sys.getswitchinterval() * 1e3:g} ms; "
        f"{args.seconds:g} s per row. Shared machines are noisy: compare rows of one run.\n"
    )
    alone = scheduler_steps(args.seconds, args.forward_ms / 1e3, args.step_us / 1e6)
    for workload in args.workload:
        args.workload = workload
        rows = []
        for hold in holds:
            row = run_loop(hold, args, with_scheduler=True)
            row.work_alone_per_s = run_loop(hold, args, with_scheduler=False).work_per_s
            rows.append(row)
        base = next((r for r in rows if r.label == "off"), rows[0])
        print(f"workload: {workload}")
        header = (
            "max_gil_hold_ms",
            "wakes",
            "wake p50 us",
            "wake p99 us",
            "wake max us",
            "loop work with scheduler",
            "loop work alone",
        )
        lines = [
            (
                "(scheduler alone)",
                f"{len(alone)}",
                f"{pct(alone, 50) * 1e6:,.0f}",
                f"{pct(alone, 99) * 1e6:,.0f}",
                f"{max(alone) * 1e6:,.0f}",
                "-",
                "-",
            )
        ]
        for row in rows:
            lines.append(
                (
                    row.label,
                    f"{len(row.wake_s)}",
                    f"{pct(row.wake_s, 50) * 1e6:,.0f}",
                    f"{pct(row.wake_s, 99) * 1e6:,.0f}",
                    f"{max(row.wake_s) * 1e6:,.0f}",
                    f"{row.work_per_s:,.0f}/s ({_ratio(row.work_per_s, base.work_per_s)})",
                    f"{row.work_alone_per_s:,.0f}/s "
                    f"({_ratio(row.work_alone_per_s, base.work_alone_per_s)})",
                )
            )
        print_markdown_table(header, lines)
        print()


if __name__ == "__main__":
    main()
