"""How long an fs tier of N blocks takes to start again, and what its index holds, in one run.

    .venv/bin/python benchmarks/fs_reopen.py [--blocks 1000000] [--block-kib 4] [--smoke]

A tier's start replays its journal into the in-memory index and rewrites the
journal compacted (``tiers/fs/opening.py``), before its first job runs. Both grow
with the blocks it holds: a server's drives hold millions. The run:

* **store** ``--blocks`` blocks of ``--block-kib`` KiB through the facade (jobs of
  256 blocks, 4 in flight; small blocks, so that millions fit on the scratch disk);
* **reopen**: a new tier on the same root, timed from construction to the end of
  its first load job (as an engine restart waits), then closed;
* **the parts** of a start, timed on the journal file the tier left (best of 3):
  its replay (decoding and applying the records), the index restored from it
  (keys, slots, the LRU order), and the compacted journal encoded again (what an
  open adds when it must rewrite the journal: a torn tail, damage, or a journal
  grown past the running tier's compaction size; an intact one is appended to);
  and the memory the restored index holds per block (``tracemalloc``);
* **a compaction beside a scheduler**: a thread resting 2 ms per step (the GPU)
  and then running a little Python, while the loop thread copies the restored
  index (and the copy is freed once encoded) and a worker thread encodes it,
  each the way it was done before (one C call; Python interrupted only at the
  5 ms switch interval) and the way it is now (:mod:`tiering.runtime.gil_breaks`):
  how long each step waited for the GIL past its 2 ms (p50, p99, max).

No target: the figures say what a restart costs per block on this machine.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import shutil
import sys
import tempfile
import threading
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import KIB, MIB, print_aligned_table
from benchmarks.support.fs_drive import Primary, Workload, run_jobs
from tiering.core.keys import make_offload_key
from tiering.policies.lru import LRUPolicy
from tiering.runtime import AsyncTierManager
from tiering.runtime.gil_breaks import GilBreaks, clear_in_turns
from tiers.fs import FileSystemTier
from tiers.fs.files import RootDir
from tiers.fs.index import SlotIndex
from tiers.fs.journal_file import encode_snapshot
from tiers.fs.layout import JOURNAL_NAME, Header, read_header
from tiers.fs.lifecycle import snapshot_in_turns
from tiers.fs.records import HEADER_BYTES, replay

T = TypeVar("T")
JOB_BLOCKS = 256


def best_of(runs: int, fn: Callable[[], T]) -> tuple[float, T]:
    best, out = float("inf"), None
    for _ in range(runs):
        gc.collect()
        started = time.perf_counter()
        out = fn()
        best = min(best, time.perf_counter() - started)
    assert out is not None
    return best, out


def workload(blocks: int, block: int, in_flight: int) -> Workload:
    """Jobs of keys shaped like vLLM's (a 32-byte block hash and a 4-byte group index)."""
    work = Workload(block, blocks * block, JOB_BLOCKS, in_flight, "")
    work.jobs = [
        ([make_offload_key(hash_bytes(j * JOB_BLOCKS + i), 0) for i in range(JOB_BLOCKS)], j)
        for _, j in work.jobs
    ]
    return work


def hash_bytes(n: int) -> bytes:
    return hashlib.blake2b(n.to_bytes(8, "little"), digest_size=32).digest()


def manager(root: Path, primary: Primary, blocks: int, block: int) -> AsyncTierManager:
    tier = FileSystemTier(root_dir=root, capacity_bytes=blocks * block + 64 * MIB)
    return AsyncTierManager(
        tier,
        primary.view(),
        "fs",
        block_bytes=block,
        job_timeout_s=600.0,
        layout_fingerprint="fs-reopen",
    )


def time_the_parts(body: memoryview, header: Header) -> tuple[float, float, float]:
    """Seconds (best of 3) to replay ``body``, restore the index and encode the snapshot."""
    replay_s, result = best_of(3, lambda: replay(body, header.journal_seed))
    n = len(result.entries)
    restore_s, _ = best_of(3, lambda: SlotIndex.restore(n, LRUPolicy(n), result.entries))
    keys, values = list(result.entries), list(result.entries.values())
    encode_s, _ = best_of(3, lambda: encode_snapshot(header, keys, values))
    return replay_s, restore_s, encode_s


def scheduler_waits(work: Callable[[], object]) -> tuple[float, list[float]]:
    """Seconds ``work`` took, and each step's wait past its 2 ms rest meanwhile (sorted)."""
    waits: list[float] = []
    stop = threading.Event()

    def scheduler() -> None:
        while not stop.is_set():
            started = time.perf_counter()
            time.sleep(0.002)  # the GPU step: the GIL is free
            sum(range(100))  # the scheduler's next Python: when does it run?
            waits.append(time.perf_counter() - started - 0.002)

    thread = threading.Thread(target=scheduler)
    thread.start()
    time.sleep(0.05)
    waits.clear()
    started = time.perf_counter()
    work()
    took = time.perf_counter() - started
    stop.set()
    thread.join()
    return took, sorted(waits)


def _copy_and_free_in_turns(index: SlotIndex) -> None:
    """The loop thread's copy, then the worker thread's emptying of it once encoded."""
    keys, values = snapshot_in_turns(index)
    clear_in_turns(keys)
    clear_in_turns(values)


def compaction_rows(index: SlotIndex, header: Header) -> list[tuple[str, ...]]:
    """A compaction's two parts beside a resting scheduler, before and now (see above)."""
    keys, values = snapshot_in_turns(index)
    runs = [
        ("copy and free, one C call each (before)", index.items),
        ("copy and free, in turns (now)", lambda: _copy_and_free_in_turns(index)),
        ("encode in a worker, no breaks (before)", lambda: encode_snapshot(header, keys, values)),
        (
            "encode in a worker, GIL breaks (now)",
            lambda: encode_snapshot(header, keys, values, GilBreaks()),
        ),
    ]
    rows: list[tuple[str, ...]] = []
    for label, work in runs:
        took, waits = scheduler_waits(work)
        steps = len(waits)
        waits = waits or [float("nan")]  # work shorter than one step
        p50, p99 = waits[len(waits) // 2], waits[int(0.99 * (len(waits) - 1))]
        figures = (f"{took * 1e3:.0f}", f"{steps}", f"{p50 * 1e3:.2f}", f"{p99 * 1e3:.2f}")
        rows.append((label, *figures, f"{waits[-1] * 1e3:.2f}"))
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--blocks", type=int, default=1_000_000)
    parser.add_argument("--block-kib", type=int, default=4)
    parser.add_argument("--dir", default=None, help="scratch directory (default: $TMPDIR)")
    parser.add_argument("--smoke", action="store_true", help="seconds: 20,000 blocks")
    args = parser.parse_args(argv)
    if args.smoke:
        args.blocks = 20_000
    if args.blocks < JOB_BLOCKS or args.block_kib < 4 or args.block_kib % 4:
        parser.error(f"--blocks must be >= {JOB_BLOCKS}, --block-kib a multiple of 4")
    blocks, block = args.blocks - args.blocks % JOB_BLOCKS, args.block_kib * KIB
    scratch = Path(tempfile.mkdtemp(prefix="kvt-fs-reopen-", dir=args.dir))
    try:
        primary = Primary(4 * JOB_BLOCKS, block)
        started = time.perf_counter()
        with manager(scratch, primary, blocks, block) as tier:
            run_jobs(tier, workload(blocks, block, 4), False, 5e-4)
        stored_s = time.perf_counter() - started
        started = time.perf_counter()
        with manager(scratch, primary, blocks, block) as tier:
            run_jobs(tier, workload(JOB_BLOCKS, block, 1), True, 5e-4)
            reopen_s = time.perf_counter() - started
        root = RootDir.open(scratch)
        try:
            header = read_header(root)
            journal = root.read_small(JOURNAL_NAME, 1 << 40)
        finally:
            root.close()
        assert header is not None and journal is not None
        body = memoryview(journal)[HEADER_BYTES:]
        replay_s, restore_s, encode_s = time_the_parts(body, header)
        gc.collect()
        tracemalloc.start()  # what a started tier keeps: keys and entries replayed, the index
        result = replay(body, header.journal_seed)
        n = len(result.entries)
        index = SlotIndex.restore(n, LRUPolicy(n), result.entries)
        del result
        gc.collect()
        held = tracemalloc.get_traced_memory()[0]
        tracemalloc.stop()
        stalls = compaction_rows(index, header)
        del index
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    per = 1e6 / blocks
    print(
        f"fs tier of {blocks:,} blocks of {args.block_kib} KiB ({os.cpu_count()} CPUs): "
        f"stored in {stored_s:.1f} s, journal {len(journal) / blocks:.0f} bytes per block"
    )
    rows = [
        ("reopen, to the end of the first load", f"{reopen_s:.2f}", f"{reopen_s * per:.2f}"),
        ("  replay of the journal", f"{replay_s:.2f}", f"{replay_s * per:.2f}"),
        ("  index restored from it (LRU)", f"{restore_s:.2f}", f"{restore_s * per:.2f}"),
        ("  journal compacted (an open that must)", f"{encode_s:.2f}", f"{encode_s * per:.2f}"),
    ]
    print_aligned_table(("part of a start", "seconds", "us per block"), rows)
    print(
        f"index memory: {held / blocks:.0f} bytes per block (36-byte keys, slots, checksums, "
        "the LRU order)"
    )
    print("a compaction beside a scheduler resting 2 ms per step (its wait for the GIL, ms):")
    header_row = ("part", "ms", "steps", "wait p50", "wait p99", "wait max")
    print_aligned_table(header_row, stalls)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
