"""What a full garbage collection costs per block a tier holds, in one run.

    .venv/bin/python benchmarks/gc_pause.py [--sizes 100000,1000000,2000000] [--smoke]

CPython's full collection (generation 2) visits every container the collector
tracks, and every element of each, holding the GIL throughout: the scheduler
thread waits that long, whichever thread started the collection. A tier's
per-block state therefore sets a floor under the scheduler's worst step. Each
row builds one structure holding ``N`` blocks in this process and times a full
``gc.collect()`` (the best of ``--trials``) against the same process without it:

* ``fs index``: a filesystem tier's :class:`~tiers.fs.index.SlotIndex` (LRU), as
  restored at start: one tuple per block, which the collector stops tracking;
* ``fs index, one object per block``: the same with each entry a slots
  dataclass, the layout fs tiers had before, measured here for comparison;
* ``CPU tier, <policy>``: the CPU primary tier (1 byte per block, metadata only)
  with each policy, its blocks ready.

Reported: objects the collector tracks (``len(gc.get_objects())``), the full
collection's time and its time per block above the baseline. What stays per
block is the walk of a few large containers (a policy's ``OrderedDict``), which
any Python block map has. The machine is shared: compare rows of one run.
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import print_aligned_table
from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.policies.lru import LRUPolicy
from tiering.primary import CPUPrimaryTier
from tiers.fs.index import SlotIndex


@dataclass(frozen=True, slots=True)
class ObjectEntry:
    """An index entry as one object per block (the fs tier's layout before tuples)."""

    slot: int
    checksum: int
    tag: bytes | None = None


def keys_of(n: int) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(16, "big"), 0) for i in range(n)]


def fs_index(n: int) -> object:
    entries: dict[bytes, tuple[int, int]] = {
        key: (slot, slot * 0x9E3779B97F4A7C15) for slot, key in enumerate(keys_of(n))
    }
    return SlotIndex.restore(n, LRUPolicy(n), entries)


def fs_index_objects(n: int) -> object:
    index = fs_index(n)
    table = index._entries  # type: ignore[attr-defined]  # the comparison row only
    for key, (slot, checksum, tag) in table.items():
        table[key] = ObjectEntry(slot, checksum, tag)
    return index


def cpu_tier(policy: str) -> Callable[[int], object]:
    def build(n: int) -> object:
        tier = CPUPrimaryTier(n, 1, policy, enable_events=False, require_alignment=False)
        keys = keys_of(n)
        for lo in range(0, n, 4096):
            batch = keys[lo : lo + 4096]
            tier.prepare_store(batch, NO_CONTEXT)
            tier.complete_store(batch)
        return tier

    return build


def full_collection_s(trials: int) -> float:
    gc.collect()
    best = float("inf")
    for _ in range(trials):
        started = time.perf_counter()
        gc.collect()
        best = min(best, time.perf_counter() - started)
    return best


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="100000,1000000,2000000")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="a few seconds: 20k blocks")
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.trials = "20000", 2
    try:
        sizes = [int(s) for s in args.sizes.split(",")]
    except ValueError:
        parser.error(f"--sizes must be comma-separated integers, got {args.sizes!r}")
    if not sizes or min(sizes) < 1 or args.trials < 1:
        parser.error("--sizes must be positive and --trials at least 1")
    builders: list[tuple[str, Callable[[int], object]]] = [
        ("fs index", fs_index),
        ("fs index, one object per block", fs_index_objects),
        ("CPU tier, lru", cpu_tier("lru")),
        ("CPU tier, adaptive", cpu_tier("adaptive")),
    ]
    rows = []
    fs_tracked_per_block = 0.0  # the most, over the sizes, of the fs index's tracked objects
    for n in sizes:
        baseline = full_collection_s(args.trials)
        base_tracked = len(gc.get_objects())
        rows.append(("baseline", f"{n:,}", f"{base_tracked:,}", f"{baseline * 1e3:.1f}", "-"))
        for label, build in builders:
            held = build(n)
            took = full_collection_s(args.trials)
            tracked = len(gc.get_objects())
            del held
            if label == "fs index":
                fs_tracked_per_block = max(fs_tracked_per_block, (tracked - base_tracked) / n)
            per_block_ns = max(0.0, took - baseline) / n * 1e9
            figures = (f"{tracked:,}", f"{took * 1e3:.1f}", f"{per_block_ns:.1f}")
            rows.append((label, f"{n:,}", *figures))
        gc.collect()
    print(f"full garbage collection (gc.collect(), best of {args.trials}) with N blocks held")
    print_aligned_table(("structure", "blocks", "tracked objects", "full gc ms", "ns/block"), rows)
    print(
        f"verdict: the fs index leaves {fs_tracked_per_block:.4f} tracked objects per block "
        f"(target < 0.01): {'ok' if fs_tracked_per_block < 0.01 else 'MISSED'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
