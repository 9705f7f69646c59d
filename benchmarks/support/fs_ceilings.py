"""The ceilings of ``benchmarks/fs_tier.py``: what the disk gives without the tier.

Owns :class:`Figure` (bytes, wall and CPU seconds of one measured phase) and the
raw ceiling of each I/O backend: O_DIRECT block-sized ops at the tier's queue depth
on a preallocated file, through the tier's own kernel ring (``uring``) or on
queue-depth threads (``threads``), and fio's figure for the same pattern beside
them; plus the page-cache and file helpers the cases need.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from benchmarks.support.fio import run_fio

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


class RawCeiling(Protocol):
    """A backend's raw ceiling: ``total`` bytes of ``block``-sized ops at queue depth ``depth``."""

    def __call__(self, path: Path, block: int, total: int, depth: int, write: bool) -> Figure: ...


RAW_CEILINGS: dict[str, RawCeiling] = {
    "uring": raw_uring,
    "threads": raw_threads,
}


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
    run = run_fio(path, write=write, block=block, size=total, depth=depth, end_fsync=True)
    if run is None:
        return None
    figure = Figure(nbytes=run.io_bytes, wall_s=run.runtime_s)
    figure.cpu_s = run.cpu_share * figure.wall_s
    return figure


def preallocate(path: Path, total: int) -> None:
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.posix_fallocate(fd, 0, total)
    finally:
        os.close(fd)
