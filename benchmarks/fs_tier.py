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
* per **I/O backend** (``--backend all``: io_uring where this machine can run it,
  and threads), every row printed with the backend the tier really used;
* the **raw ceiling** of each backend: plain O_DIRECT writes and reads of the
  same bytes, in block-sized ops at the tier's queue depth, on a preallocated
  file (uring: the tier's own kernel ring; threads: ``os.preadv``/``pwritev`` on
  queue-depth threads), and fio (io_uring engine; installed with apt-get when
  missing and possible) as the disk's ceiling beside it. "of raw" is against
  the backend's own ceiling. Raw and tier runs alternate ``--reps`` times (the virtual
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
import ctypes
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
from tiering.native_probe import describe_cpu
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
    """O_DIRECT block-sized ops at queue depth ``depth`` through the same kernel ring the tier
    uses, waiting in ``io_uring_enter`` (the GIL is released; nothing else runs here)."""
    from tiers.fs.io.kernel_ring import KernelRing

    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buf = mmap.mmap(-1, depth * block)
    buf.write(os.urandom(depth * block))
    base = ctypes.addressof(ctypes.c_char.from_buffer(buf))
    ring = KernelRing(2 * depth)
    count = total // block
    try:
        with measure(total) as figure:
            issued = done = 0
            while done < count:
                while issued < count and issued - done < depth:
                    slot = issued % depth
                    span = [(base + slot * block, block)]
                    ring.prepare_rw(write, fd, issued * block, span, issued)
                    issued += 1
                ring.submit(wait_for=1)
                for _, res in ring.completions():
                    if res != block:
                        raise OSError(f"raw op moved {res} of {block} bytes")
                    done += 1
            if write:
                os.fdatasync(fd)
    finally:
        ring.close()
        os.close(fd)
    return figure


def raw_threads(path: Path, block: int, total: int, depth: int, write: bool) -> Figure:
    """O_DIRECT block-sized ``os.pwritev``/``os.preadv`` on ``depth`` threads (queue depth
    ``depth``): the ceiling of the thread backend, which needs no io_uring."""
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    buf = mmap.mmap(-1, depth * block)
    buf.write(os.urandom(depth * block))
    view = memoryview(buf)
    count = total // block
    call = os.pwritev if write else os.preadv
    errors: list[BaseException] = []

    def worker(index: int) -> None:
        mine = view[index * block : (index + 1) * block]
        try:
            for op in range(index, count, depth):
                if call(fd, [mine], op * block) != block:
                    raise OSError(f"raw op {op} moved a short count")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(depth)]
    try:
        with measure(total) as figure:
            for thread in threads:
                thread.start()
            for thread in threads:
                thread.join()
            if write:
                os.fdatasync(fd)
    finally:
        view.release()
        os.close(fd)
    if errors:
        raise errors[0]
    return figure


RAW_CEILINGS: dict[str, Callable[[Path, int, int, int, bool], Figure]] = {
    "uring": raw_uring,
    "threads": raw_threads,
}


def ensure_fio() -> bool:
    """fio on the PATH, installed from the distribution when missing and allowed (root)."""
    if shutil.which("fio") is not None:
        return True
    if os.geteuid() == 0 and shutil.which("apt-get") is not None:
        print("# fio is missing: apt-get install -y fio", flush=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "fio"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    found = shutil.which("fio") is not None
    if not found:
        print("# fio is not available: ceilings from the Python raw loops only", flush=True)
    return found


def available_backends(requested: str) -> tuple[list[str], dict[str, str]]:
    """The backends to measure (in order) and why any requested one is skipped."""
    from tiers.fs.io import uring_unavailable_reason

    names = ["uring", "threads"] if requested == "all" else [requested]
    skipped: dict[str, str] = {}
    reason = uring_unavailable_reason()
    if "uring" in names and reason is not None:
        skipped["uring"] = reason
        names.remove("uring")
    return names, skipped


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
    backend: str,
    **tier_options: Any,
) -> AsyncTierManager:
    tier = FileSystemTier(
        root_dir=root,
        capacity_bytes=total + 64 * MiB,
        io_backend=backend,
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


def bench_case(
    name: str, block: int, backend: str, args: argparse.Namespace, scratch: Path
) -> dict[str, Any]:
    total = args.total_mib * MiB
    job_blocks = args.job_blocks
    in_flight = args.jobs_in_flight
    primary = Primary(job_blocks * in_flight, block)
    out: dict[str, Any] = {"block": block, "total": total}
    raw = RAW_CEILINGS[backend]
    raw_file = scratch / f"raw-{name}.bin"
    preallocate(raw_file, total)
    print(
        f"# {name}, backend {backend}: {total / MiB:.0f} MiB per phase, {job_blocks} blocks/job, "
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
    with make_manager(root, primary, total, block, args, True, backend) as manager:
        for rep in range(args.reps):
            work = Workload(block, total, job_blocks, in_flight, f"{name}-direct-{rep}")
            keep("raw_write", raw(raw_file, block, total, args.queue_depth, write=True))
            keep("fio_write", raw_fio(raw_file, block, total, args.queue_depth, write=True))
            keep("store", run_jobs(manager, work, load=False, poll_s=args.poll_s))
            drop_cache([raw_file])
            keep("raw_read", raw(raw_file, block, total, args.queue_depth, write=False))
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
    if backend != "threads":  # buffered files always use the thread backend under "auto"
        raw_file.unlink()
        return out

    # Buffered fallback: store, cold load (pages dropped), warm load.
    root = scratch / f"tier-{name}-buffered"
    work = Workload(block, total, job_blocks, in_flight, f"{name}-buffered")
    with make_manager(root, primary, total, block, args, False, backend) as manager:
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
    results: dict[tuple[str, str], dict[str, Any]],
    vllm: dict[str, dict[str, float]] | None,
    args: argparse.Namespace,
    skipped: dict[str, str],
) -> None:
    print()
    print(f"CPU: {describe_cpu()}")
    header = (
        f"{'case':<6} {'backend':<7} {'phase':<19} {'GB/s':>6} {'raw':>6} {'fio':>6} "
        f"{'of raw':>7} {'target':>6} {'CPU s/GB':>9} {'excl.sched':>10} {'vLLM':>6} "
        f"{'ours/vLLM':>9} {'target':>6}"
    )
    print(header)
    print("-" * len(header))
    for (name, _backend), r in results.items():
        rows = [
            ("store O_DIRECT", r["store"], r["raw_write"], r["fio_write"], "store"),
            ("load O_DIRECT", r["load"], r["raw_read"], r["fio_read"], "load"),
        ]
        if "store_buffered" in r:
            rows += [
                ("store buffered", r["store_buffered"], None, None, None),
                ("load buffered cold", r["load_cold"], r["raw_read"], r["fio_read"], None),
                ("load buffered warm", r["load_warm"], None, None, None),
            ]
        for label, fig, raw, fio, vllm_phase in rows:
            ratio = fig.gbps / raw.gbps if raw is not None and raw.gbps else None
            direct_row = label.endswith("O_DIRECT")
            peer = (vllm or {}).get(name, {}).get(vllm_phase or "", None)
            print(
                f"{name:<6} {r['backend']:<7} {label:<19} {fig.gbps:>6.2f} "
                f"{_fmt(raw.gbps if raw else None):>6} {_fmt(fio.gbps if fio else None):>6} "
                f"{_pct(ratio):>7} {_pct(TARGET_RAW[name] if direct_row else None):>6} "
                f"{fig.cpu_per_gb:>9.3f} {fig.tier_cpu_per_gb:>10.3f} "
                f"{_fmt(peer):>6} {_ratio(fig.gbps / peer if peer else None):>9} "
                f"{_ratio(TARGET_VLLM[name] if peer is not None else None):>6}"
            )
    print()
    for (name, _backend), r in results.items():
        gil = r["gil"]
        print(
            f"GIL {name} {r['backend']}: pure-Python loop {gil['alone']:.0f} batches/s alone, "
            f"{gil['busy']:.0f} while the tier stores+loads flat out: "
            f"slowdown {gil['slowdown']:.2f}x (target <= 1.25x)"
        )
    for backend, reason in skipped.items():
        print(f"backend {backend} not measured: {reason}")
    print(
        f"O_DIRECT rows and their ceilings: median of {args.reps} alternating runs; buffered "
        f"rows: one run; vLLM: median of {args.vllm_runs} runs of its harness "
        f"(drive_fs_tier.py, same sizes, {args.job_blocks}-block requests, "
        f"{args.jobs_in_flight} in flight)."
    )
    print(
        "backend = the backend the tier really ran (stats.io_backend). raw = that backend's "
        "own ceiling: O_DIRECT block-sized ops at the same queue depth (uring: the kernel ring "
        "the tier uses; threads: os.preadv/pwritev on queue-depth threads); 'of raw' is against "
        "it. fio (io_uring engine) is the disk's ceiling, shown beside it. CPU s/GB = user+sys "
        "of this process (all threads) per GB moved; 'excl.sched' leaves out the benchmark's "
        "own scheduler-thread polling. Shared, noisy machine: compare within a run."
    )


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def to_json(results: dict[tuple[str, str], dict[str, Any]], vllm: Any) -> dict[str, Any]:
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

    return {"ours": convert({f"{c}/{b}": r for (c, b), r in results.items()}), "vllm": vllm}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="2MiB,64KiB")
    parser.add_argument("--total-mib", type=int, default=1024, help="data per phase and case")
    parser.add_argument("--job-blocks", type=int, default=64)
    parser.add_argument("--jobs-in-flight", type=int, default=4)
    parser.add_argument("--queue-depth", type=int, default=32)
    parser.add_argument("--max-io-kib", type=int, default=8192, help="tier's max_io_bytes")
    parser.add_argument(
        "--backend",
        default="all",
        choices=["all", "uring", "threads"],
        help="I/O backend(s) to measure; 'all' = every backend this machine can run",
    )
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
    backends, skipped = available_backends(args.backend)
    for backend, reason in skipped.items():
        print(f"# backend {backend} is not usable here: {reason}", flush=True)
    ensure_fio()
    scratch = Path(tempfile.mkdtemp(prefix="fs-tier-bench-", dir=args.dir))
    try:
        results = {
            (name, backend): bench_case(name, CASES[name], backend, args, scratch)
            for name in args.cases
            for backend in backends
        }
        vllm = run_vllm(args, scratch)
        cases = [] if args.skip_mac else args.cases
        mac = {case: bench_mac(case, CASES[case], args, scratch) for case in cases}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    report(results, vllm, args, skipped)
    report_mac(mac, args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps({**to_json(results, vllm), "mac": mac}, indent=1))


if __name__ == "__main__":
    main()
