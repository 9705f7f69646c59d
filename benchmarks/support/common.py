"""The measuring and printing code several benchmarks repeat.

Owns: the percentile every benchmark reports, the two table layouts they print
(Markdown, and right-aligned columns under a dashed rule), the median of timed
repetitions after a warm-up, the pure-Python scheduler-like batch whose slowdown
stands for the scheduler thread's, and the re-execution of a benchmark in an
environment one of the ``scripts/`` builders makes (the vLLM benchmarks).
"""

from __future__ import annotations

import argparse
import heapq
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

#: The repository's root (benchmarks run from anywhere; what they need is under it).
REPO = Path(__file__).resolve().parents[2]
KIB = 1024
MIB = 1024 * KIB


def pct(samples: Sequence[float], q: float) -> float:
    """Percentile ``q`` (0-100) of ``samples``: the sample at that rank, no interpolation."""
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def print_markdown_table(header: Sequence[str], lines: Sequence[Sequence[str]]) -> None:
    """A Markdown table, columns padded to their widest cell (pastes into notes as is)."""
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")


def print_aligned_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Right-aligned columns two spaces apart, a dashed rule under the header."""
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    for line in [header, tuple("-" * w for w in widths), *rows]:
        print("  ".join(c.rjust(w) for c, w in zip(line, widths, strict=True)))


def median_seconds(fn: Callable[[], object], reps: int) -> float:
    """The median wall time of ``reps`` calls of ``fn``, after one untimed warm-up call."""
    fn()  # warm-up: first touch, thread start, caches
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def python_work(rounds: int = 2000) -> int:
    """A pure-Python scheduler-like batch: dict updates and a heap."""
    d: dict[int, int] = {}
    h: list[tuple[int, int]] = []
    acc = 0
    for i in range(rounds):
        d[i & 255] = d.get(i & 255, 0) + i
        heapq.heappush(h, (i * 7919 % 1009, i))
        if len(h) > 64:
            acc += heapq.heappop(h)[1]
    return acc


def scheduler_batches(
    duration: float, between: Callable[[], None] | None = None
) -> tuple[list[float], float]:
    """:func:`python_work` batches back to back for ``duration`` seconds, ``between`` after each.

    Returns each batch's seconds and the mean wall seconds of one iteration
    (the batch, ``between`` and any wait for the GIL either incurs).
    """
    times: list[float] = []
    started = time.perf_counter()
    end = started + duration
    while not times or time.perf_counter() < end:  # one batch at least, however late
        t0 = time.perf_counter()
        python_work()
        times.append(time.perf_counter() - t0)
        if between is not None:
            between()
    return times, (time.perf_counter() - started) / len(times)


def reexec_in_env(builder: str, env: dict[str, str]) -> NoReturn:
    """Run this script again with the python ``scripts/<builder>`` prints (built if needed).

    The repository goes on ``PYTHONPATH`` (the environments do not install it),
    with ``env`` on top of this process's environment.
    """
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / builder)], stdout=subprocess.PIPE, text=True
    )
    if done.returncode != 0:
        sys.exit(f"scripts/{builder} failed; see its log above")
    python = done.stdout.strip().splitlines()[-1]
    os.execve(python, [python, *sys.argv], {**os.environ, "PYTHONPATH": str(REPO), **env})


def add_auth_offload_options(parser: argparse.ArgumentParser) -> None:
    """``--auth-offload-min-kib`` / ``--auth-offload-min-cpus``: where authentication tags run."""
    parser.add_argument(
        "--auth-offload-min-kib",
        type=int,
        default=None,
        help="tag/verify batches of at least this many KiB on the hashing threads "
        "(tiering.tier.auth.OFFLOAD_MIN_BYTES; default: the library's; a huge value keeps "
        "every tag on the tier's loop thread)",
    )
    parser.add_argument(
        "--auth-offload-min-cpus",
        type=int,
        default=None,
        help="use the hashing threads only with at least this many CPUs "
        "(tiering.tier.auth.OFFLOAD_MIN_CPUS; default: the library's)",
    )


def apply_auth_offload_options(args: argparse.Namespace) -> None:
    """Set the library's thresholds from :func:`add_auth_offload_options`' options."""
    from tiering.tier import auth

    if args.auth_offload_min_kib is not None:
        auth.OFFLOAD_MIN_BYTES = args.auth_offload_min_kib * KIB
    if args.auth_offload_min_cpus is not None:
        auth.OFFLOAD_MIN_CPUS = args.auth_offload_min_cpus
