"""Filesystem tier throughput against the disk's ceiling and vLLM's own tier, in one run.

    .venv/bin/python benchmarks/fs_tier.py                 # full run (a few minutes)
    .venv/bin/python benchmarks/fs_tier.py --quick         # 256 MiB per case, no vLLM
    .venv/bin/python benchmarks/fs_tier.py --json out.json

For 2 MiB and 64 KiB blocks, on the same disk (a scratch directory, default
under $TMPDIR):

* **store** (primary rows -> tier) and **load** (tier -> primary rows) through
  the runtime facade (:class:`~tiering.runtime.AsyncTierManager`), as the
  scheduler drives it: jobs of ``--job-blocks`` blocks, ``--jobs-in-flight``
  at once, completions polled. O_DIRECT (cold by construction: no page cache),
  and the buffered fallback cold (after fdatasync + ``posix_fadvise(DONTNEED)``)
  and warm (page cache);
* the **raw ceiling**: plain O_DIRECT writes and reads of the same bytes, in
  block-sized ops at the tier's queue depth, on a preallocated file: Python
  io_uring, and fio (io_uring engine) where installed; the ratio uses the
  better of the two. Raw and tier runs alternate ``--reps`` times (the virtual
  disk serves recently written data faster, so each reads data written moments
  before) and medians are compared;
* **CPU seconds per GB** (user+sys of this process, all threads; also without
  the scheduler thread's own polling);
* **GIL**: batches/s of a pure-Python loop (heap and dict work, like a
  scheduler) on another thread, alone and while the tier stores and loads flat
  out;
* **vLLM**: in the environment ``scripts/vllm_env.sh`` builds (or reuses), vLLM's
  own filesystem tier on the same workload through its harness
  (``drive_fs_tier.py --json`` in a subprocess), and the ratios ours/vLLM.

Targets: >= 85 % of the raw ceiling for 2 MiB blocks, >= 70 % for 64 KiB,
<= 0.2 CPU s/GB, <= 1.25x slowdown of the Python loop, >= 1.0x vLLM at 2 MiB
and >= 3x at 64 KiB. The machine is shared and the virtual disk bursts:
compare figures within one run only.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import logging
import mmap
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from tiering.jobs import JobMetadata
from tiering.keys import OffloadKey, make_offload_key
from tiering.runtime import AsyncTierManager
from tiers.fs import FileSystemTier

MiB = 1024 * 1024
KiB = 1024
VLLM_ENV_BUILDER = Path(__file__).resolve().parents[1] / "scripts" / "vllm_env.sh"
VLLM_DRIVER = Path(__file__).resolve().parents[2] / "shared" / "vllm-harness" / "drive_fs_tier.py"
CASES = {"2MiB": 2 * MiB, "64KiB": 64 * KiB}
TARGET_RAW = {"2MiB": 0.85, "64KiB": 0.70}
TARGET_VLLM = {"2MiB": 1.0, "64KiB": 3.0}


# -- measuring ---------------------------------------------------------------------------


@dataclass
class Figure:
    """One measured phase: bytes moved, wall seconds, CPU seconds (process and scheduler)."""

    nbytes: int = 0
    wall_s: float = 0.0
    cpu_s: float = 0.0
    sched_cpu_s: float = 0.0

    @property
    def gbps(self) -> float:
        return self.nbytes / self.wall_s / 1e9 if self.wall_s else 0.0

    @property
    def cpu_per_gb(self) -> float:
        return self.cpu_s / (self.nbytes / 1e9) if self.nbytes else 0.0

    @property
    def tier_cpu_per_gb(self) -> float:
        return (self.cpu_s - self.sched_cpu_s) / (self.nbytes / 1e9) if self.nbytes else 0.0


@contextlib.contextmanager
def measure(nbytes: int) -> Iterator[Figure]:
    figure = Figure(nbytes=nbytes)
    cpu0, sched0, t0 = _process_cpu(), time.thread_time(), time.perf_counter()
    yield figure
    figure.wall_s = time.perf_counter() - t0
    figure.cpu_s = _process_cpu() - cpu0
    figure.sched_cpu_s = time.thread_time() - sched0


def _process_cpu() -> float:
    t = os.times()
    return t.user + t.system


def median_figure(figures: list[Figure]) -> Figure:
    """The run with the median throughput (its CPU figures come with it)."""
    return sorted(figures, key=lambda f: f.gbps)[len(figures) // 2]


def drop_cache(paths: list[Path]) -> None:
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


# -- the raw ceiling ---------------------------------------------------------------------


def raw_uring(path: Path, block: int, total: int, depth: int, write: bool) -> Figure:
    """O_DIRECT block-sized ops at queue depth ``depth`` with io_uring (blocking waits: no GIL
    contention matters here, nothing else runs)."""
    import liburing as uring

    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buf = mmap.mmap(-1, depth * block)
    buf.write(os.urandom(depth * block))
    view = memoryview(buf)
    ring, cqe = uring.Ring(), uring.Cqe()
    uring.io_uring_queue_init(2 * depth, ring, 0)
    prep = uring.io_uring_prep_writev if write else uring.io_uring_prep_readv
    count = total // block
    keep: dict[int, Any] = {}
    try:
        with measure(total) as figure:
            issued = done = 0
            while done < count:
                while issued < count and issued - done < depth:
                    sqe = uring.io_uring_get_sqe(ring)
                    slot = issued % depth
                    iov = uring.Iovec([view[slot * block : (slot + 1) * block]])
                    prep(sqe, fd, iov, issued * block)
                    sqe.user_data = issued
                    keep[issued] = iov
                    issued += 1
                uring.io_uring_submit_and_wait(ring, 1)
                while True:
                    try:
                        uring.io_uring_peek_cqe(ring, cqe)
                    except BlockingIOError:
                        break
                    entry = cqe[0]
                    if entry.res != block:
                        raise OSError(f"raw op moved {entry.res} of {block} bytes")
                    keep.pop(entry.user_data)
                    uring.io_uring_cqe_seen(ring, entry)
                    done += 1
            if write:
                os.fdatasync(fd)
    finally:
        uring.io_uring_queue_exit(ring)
        os.close(fd)
    return figure


def raw_fio(path: Path, block: int, total: int, depth: int, write: bool) -> Figure | None:
    """fio's figure for the same pattern (None when fio is not installed)."""
    if shutil.which("fio") is None:
        return None
    cmd = [
        "fio",
        "--name=ceiling",
        f"--filename={path}",
        f"--rw={'write' if write else 'read'}",
        f"--bs={block}",
        f"--size={total}",
        "--direct=1",
        "--ioengine=io_uring",
        f"--iodepth={depth}",
        "--end_fsync=1",
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return None
    job = json.loads(out.stdout)["jobs"][0]
    side = job["write" if write else "read"]
    figure = Figure(nbytes=int(side["io_bytes"]), wall_s=job["job_runtime"] / 1000)
    figure.cpu_s = (job["usr_cpu"] + job["sys_cpu"]) / 100 * figure.wall_s
    return figure


def preallocate(path: Path, total: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, total)
    finally:
        os.close(fd)


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
    **tier_options: Any,
) -> AsyncTierManager:
    tier = FileSystemTier(
        root_dir=root,
        capacity_bytes=total + 64 * MiB,
        io_backend=args.backend,
        direct_io=direct,
        queue_depth=args.queue_depth,
        max_io_bytes=args.max_io_kib * KiB,
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


def scheduler_batches(stop: threading.Event, counts: list[int]) -> None:
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
    thread = threading.Thread(target=scheduler_batches, args=(stop, counts), name="py-loop")
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


# -- one case --------------------------------------------------------------------------------


def bench_case(name: str, block: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    total = args.total_mib * MiB
    job_blocks = args.job_blocks
    in_flight = args.jobs_in_flight
    primary = Primary(job_blocks * in_flight, block)
    out: dict[str, Any] = {"block": block, "total": total}
    raw_file = scratch / f"raw-{name}.bin"
    preallocate(raw_file, total)
    print(
        f"# {name}: {total / MiB:.0f} MiB per phase, {job_blocks} blocks/job, "
        f"{in_flight} jobs in flight, queue depth {args.queue_depth}",
        flush=True,
    )

    samples: dict[str, list[Figure]] = {}

    def keep(label: str, figure: Figure | None) -> None:
        if figure is not None:
            samples.setdefault(label, []).append(figure)

    # O_DIRECT: store, then load (no page cache involved). The raw ceiling and the tier
    # alternate, ``--reps`` times, each reading data written moments before (the virtual
    # disk serves recently written data faster), and the medians are compared.
    root = scratch / f"tier-{name}"
    with make_manager(root, primary, total, block, args, direct=True) as manager:
        for rep in range(args.reps):
            work = Workload(block, total, job_blocks, in_flight, f"{name}-direct-{rep}")
            keep("raw_write", raw_uring(raw_file, block, total, args.queue_depth, write=True))
            keep("fio_write", raw_fio(raw_file, block, total, args.queue_depth, write=True))
            keep("store", run_jobs(manager, work, load=False, poll_s=args.poll_s))
            drop_cache([raw_file])
            keep("raw_read", raw_uring(raw_file, block, total, args.queue_depth, write=False))
            keep("fio_read", raw_fio(raw_file, block, total, args.queue_depth, write=False))
            keep("load", run_jobs(manager, work, load=True, poll_s=args.poll_s))
        out["direct"] = manager.tier.stats.direct_io  # type: ignore[attr-defined]
        out["backend"] = manager.tier.stats.io_backend  # type: ignore[attr-defined]
        # GIL: the Python loop alone, then while the tier stores and loads flat out.
        alone = python_loop_rate(args.gil_s)
        waves = [0]

        def wave() -> None:
            # Store fresh blocks, then load them back. The scheduler thread waits in a
            # blocking drain (a queue: no GIL held), so only the tier competes for the GIL.
            waves[0] += 1
            work = Workload(
                block,
                2 * in_flight * job_blocks * block,
                job_blocks,
                in_flight,
                f"{name}-gil-{waves[0]}",
            )
            for load in (False, True):
                for keys, job_id in work.jobs:
                    slot = job_id % in_flight
                    rows = np.arange(slot * job_blocks, (slot + 1) * job_blocks, dtype=np.int64)
                    meta = JobMetadata(job_id + 10**6, tuple(keys), rows, is_promotion=load)
                    (manager.submit_load if load else manager.submit_store)(meta)
                manager.drain(120)
                list(manager.get_finished())

        busy = python_loop_rate(args.gil_s, during=wave)
        out["gil"] = {"alone": alone, "busy": busy, "slowdown": alone / busy if busy else 0}
    shutil.rmtree(root, ignore_errors=True)
    for label, figures in samples.items():
        out[label] = median_figure(figures)
    out.setdefault("fio_write", None)
    out.setdefault("fio_read", None)

    # Buffered fallback: store, cold load (pages dropped), warm load.
    root = scratch / f"tier-{name}-buffered"
    work = Workload(block, total, job_blocks, in_flight, f"{name}-buffered")
    with make_manager(root, primary, total, block, args, direct=False) as manager:
        out["store_buffered"] = run_jobs(manager, work, load=False, poll_s=args.poll_s)
        drop_cache(sorted(root.glob("slab-*.bin")))
        out["load_cold"] = run_jobs(manager, work, load=True, poll_s=args.poll_s)
        out["load_warm"] = run_jobs(manager, work, load=True, poll_s=args.poll_s)
    shutil.rmtree(root, ignore_errors=True)
    raw_file.unlink()
    return out


# -- authenticated blocks (auth_key_*) ------------------------------------------------------

MAC_KEY_ENV = "KV_TIERING_BENCH_MAC_KEY"


def bench_mac(name: str, block: int, args: argparse.Namespace, scratch: Path) -> dict[str, Any]:
    """Store and load GB/s through the facade with and without ``auth_key_env``, alternating.

    The MAC (HMAC-SHA256 over key, fingerprint and payload) is computed on the tier's loop
    thread: on store while the write is in flight, on load after the read.
    """
    total = args.total_mib * MiB
    primary = Primary(args.job_blocks * args.jobs_in_flight, block)
    os.environ[MAC_KEY_ENV] = os.urandom(32).hex()
    samples: dict[str, list[Figure]] = {}
    for with_mac in (False, True) * args.reps:
        label = "mac" if with_mac else "plain"
        root = scratch / f"tier-{name}-{label}"
        options = {"auth_key_env": MAC_KEY_ENV} if with_mac else {}
        with make_manager(root, primary, total, block, args, direct=True, **options) as manager:
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
            plain, keyed = r[f"{phase}_plain"], r[f"{phase}_mac"]
            print(
                f"MAC {name} {phase:<5}: {plain['gbps']:.2f} GB/s without auth_key_*, "
                f"{keyed['gbps']:.2f} with ({keyed['gbps'] / (plain['gbps'] or 1):.2f}x); "
                f"CPU s/GB {plain['cpu_s_per_gb']:.3f} -> {keyed['cpu_s_per_gb']:.3f} "
                f"(O_DIRECT, median of {reps} alternating runs)"
            )


# -- vLLM's tier -----------------------------------------------------------------------------


def run_vllm(args: argparse.Namespace, scratch: Path) -> dict[str, dict[str, float]] | None:
    """vLLM 0.33's FileSystemTierManager on the same workload (None where unavailable)."""
    if args.skip_vllm or not VLLM_DRIVER.exists():
        return None
    built = subprocess.run(
        ["bash", str(VLLM_ENV_BUILDER)], stdout=subprocess.PIPE, text=True, check=False
    )
    if built.returncode != 0:
        print("# scripts/vllm_env.sh failed; vLLM's tier not measured", flush=True)
        return None
    out_json = scratch / "vllm.json"
    cmd = [
        built.stdout.strip().splitlines()[-1],
        str(VLLM_DRIVER),
        "--quiet",
        "--cases",
        ",".join(args.cases),
        "--tier",
        "fs",
        "--modes",
        "odirect",
        "--runs",
        str(args.vllm_runs),
        "--total-mib-2m",
        str(args.total_mib),
        "--total-mib-64k",
        str(args.total_mib),
        "--req-blocks",
        str(args.job_blocks),
        "--concurrency",
        str(args.jobs_in_flight),
        "--root-parent",
        str(scratch),
        "--json",
        str(out_json),
    ]
    print("# running vLLM's tier:", " ".join(cmd[1:3]), "...", flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode != 0 or not out_json.exists():
        print(f"# vLLM run failed ({done.returncode}): {done.stderr[-2000:]}", flush=True)
        return None
    summary = json.loads(out_json.read_text())["summary"]
    figures: dict[str, dict[str, float]] = {}
    for row in summary:
        phase = "store" if row["phase"] == "store" else "load"
        figures.setdefault(row["case"], {})[phase] = float(row["GBps"] or 0.0)
    return figures


# -- report ----------------------------------------------------------------------------------


def report(
    results: dict[str, dict[str, Any]],
    vllm: dict[str, dict[str, float]] | None,
    args: argparse.Namespace,
) -> None:
    print()
    header = (
        f"{'case':<6} {'phase':<19} {'GB/s':>6} {'raw py':>7} {'fio':>6} {'of raw':>7} "
        f"{'target':>6} {'CPU s/GB':>9} {'excl.sched':>10} {'vLLM':>6} {'ours/vLLM':>9} "
        f"{'target':>6}"
    )
    print(header)
    print("-" * len(header))
    for name, r in results.items():
        rows = [
            ("store O_DIRECT", r["store"], r["raw_write"], r["fio_write"], "store"),
            ("load O_DIRECT", r["load"], r["raw_read"], r["fio_read"], "load"),
            ("store buffered", r["store_buffered"], None, None, None),
            ("load buffered cold", r["load_cold"], r["raw_read"], r["fio_read"], None),
            ("load buffered warm", r["load_warm"], None, None, None),
        ]
        for label, fig, py, fio, vllm_phase in rows:
            ceiling = max([f.gbps for f in (py, fio) if f is not None], default=0.0)
            ratio = fig.gbps / ceiling if ceiling else None
            direct_row = label.endswith("O_DIRECT")
            peer = (vllm or {}).get(name, {}).get(vllm_phase or "", None)
            print(
                f"{name:<6} {label:<19} {fig.gbps:>6.2f} "
                f"{_fmt(py.gbps if py else None):>7} {_fmt(fio.gbps if fio else None):>6} "
                f"{_pct(ratio):>7} {_pct(TARGET_RAW[name] if direct_row else None):>6} "
                f"{fig.cpu_per_gb:>9.3f} {fig.tier_cpu_per_gb:>10.3f} "
                f"{_fmt(peer):>6} {_ratio(fig.gbps / peer if peer else None):>9} "
                f"{_ratio(TARGET_VLLM[name] if peer is not None else None):>6}"
            )
    print()
    for name, r in results.items():
        gil = r["gil"]
        print(
            f"GIL {name}: pure-Python loop {gil['alone']:.0f} batches/s alone, "
            f"{gil['busy']:.0f} while the tier stores+loads flat out: "
            f"slowdown {gil['slowdown']:.2f}x (target <= 1.25x)"
        )
    first = next(iter(results.values()))
    print(
        f"O_DIRECT rows and their ceilings: median of {args.reps} alternating runs; buffered "
        f"rows: one run; vLLM: median of {args.vllm_runs} runs of its harness "
        f"(drive_fs_tier.py, same sizes, {args.job_blocks}-block requests, "
        f"{args.jobs_in_flight} in flight)."
    )
    print(
        f"backend={first['backend']} direct_io={first['direct']}; CPU s/GB = user+sys of this "
        "process (all threads) per GB moved; 'excl.sched' leaves out the benchmark's own "
        "scheduler-thread polling. raw py = Python io_uring O_DIRECT at the same queue depth; "
        "ratio against the better of raw py and fio. Shared, noisy machine: compare within a run."
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def to_json(results: dict[str, dict[str, Any]], vllm: Any) -> dict[str, Any]:
    def convert(value: Any) -> Any:
        if isinstance(value, Figure):
            return {
                "GBps": value.gbps,
                "cpu_s_per_GB": value.cpu_per_gb,
                "wall_s": value.wall_s,
                "bytes": value.nbytes,
                "tier_cpu_s_per_GB": value.tier_cpu_per_gb,
            }
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    return {"ours": convert(results), "vllm": vllm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="2MiB,64KiB")
    parser.add_argument("--total-mib", type=int, default=1024, help="data per phase and case")
    parser.add_argument("--job-blocks", type=int, default=64)
    parser.add_argument("--jobs-in-flight", type=int, default=4)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--max-io-kib", type=int, default=8192, help="tier's max_io_bytes")
    parser.add_argument("--backend", default="auto", choices=["auto", "uring", "threads"])
    parser.add_argument("--poll-s", type=float, default=0.0005, help="scheduler idle sleep")
    parser.add_argument("--gil-s", type=float, default=3.0, help="seconds per GIL measurement")
    parser.add_argument("--reps", type=int, default=3, help="O_DIRECT runs per case (median)")
    parser.add_argument("--vllm-runs", type=int, default=3, help="vLLM harness runs (median)")
    parser.add_argument("--dir", default=None, help="scratch directory (default: $TMPDIR)")
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--skip-mac", action="store_true", help="no auth_key_* comparison")
    parser.add_argument("--quick", action="store_true", help="256 MiB per case, no vLLM")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    args.cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if args.quick:
        args.total_mib, args.skip_vllm, args.gil_s, args.reps = 256, True, 1.5, 1
    logging.basicConfig(level=logging.WARNING)
    scratch = Path(tempfile.mkdtemp(prefix="fs-tier-bench-", dir=args.dir))
    try:
        results = {name: bench_case(name, CASES[name], args, scratch) for name in args.cases}
        vllm = run_vllm(args, scratch)
        cases = [] if args.skip_mac else args.cases
        mac = {case: bench_mac(case, CASES[case], args, scratch) for case in cases}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(results, vllm, args)
    report_mac(mac, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps({**to_json(results, vllm), "mac": mac}, indent=1))


if __name__ == "__main__":
    main()
