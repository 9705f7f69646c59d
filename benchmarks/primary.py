"""Per-block metadata cost of the CPU primary tier's policies at 10k / 100k / 1M blocks.

Usage: ``.venv/bin/python benchmarks/primary.py [--sizes 10000,100000,1000000] [--batch 256]``
(``--smoke``: a few seconds)

Metadata only: the buffer has 1 byte per block (``require_alignment=False``)
and is never touched. Two phases per (policy, size):

* **fill**: a fresh tier is filled in batches of ``--batch`` keys, timing
  ``prepare_store``, ``complete_store``, ``lookup`` (every key), ``touch``,
  ``prepare_load`` and ``complete_load`` per block. Small tiers are refilled
  until at least ``--min-blocks`` blocks were timed, so every size measures
  the same amount of work.
* **pressure**: the full tier keeps storing new keys; every batch first
  reuses (touch + load) a quarter batch of recent keys, then
  ``prepare_store`` must evict a whole batch. Timed per stored block.

Keys are built just before each batch, and reused keys are new objects equal
to the stored ones, as when the scheduler rebuilds a request's keys from
block hashes: a key table of 1M entries then really is touched cold.

Every figure is the best of ``--trials`` runs, interleaved across
configurations. The ``dict`` rows time the least ``dict`` + ``OrderedDict``
work any Python block map must do for the same keys, in the same run: how
much of the growth from 10k to 1M blocks the memory hierarchy alone causes.

Targets (issue 2): every per-block figure under 5 us, and the largest size
within 1.5x of the smallest. Issue 18: every other policy's sums within 2x of
LRU's at the same size (printed as "x LRU" rows), and its growth from the
smallest to the largest size within the ``dict`` floor's. The machine is shared
and noisy: compare ratios from one run, not absolute figures across runs.
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.primary import CPUPrimaryTier

FILL_OPS = ("prepare_store", "complete_store", "lookup", "touch", "prepare_load", "complete_load")
TARGET_US = 5.0
TARGET_RATIO = 1.5
TARGET_VS_LRU = 2.0


@dataclass
class Timings:
    """Total nanoseconds and blocks per operation."""

    ns: dict[str, int] = field(default_factory=dict)
    blocks: dict[str, int] = field(default_factory=dict)

    def add(self, op: str, ns: int, blocks: int) -> None:
        self.ns[op] = self.ns.get(op, 0) + ns
        self.blocks[op] = self.blocks.get(op, 0) + blocks

    def us_per_block(self, op: str) -> float:
        return self.ns[op] / 1e3 / max(1, self.blocks[op])


def make_keys(count: int, rng: random.Random) -> list[OffloadKey]:
    return [make_offload_key(rng.randbytes(16), 0) for _ in range(count)]


def equal_copies(keys: list[OffloadKey]) -> list[OffloadKey]:
    """New key objects equal to ``keys``: a later request rebuilds its keys from hashes."""
    return [OffloadKey(bytes(bytearray(k))) for k in keys]


def fill_phase(policy: str, size: int, batch: int, min_blocks: int, rng: random.Random) -> Timings:
    timings = Timings()
    clock = time.perf_counter_ns
    rounds = max(1, -(-min_blocks // size))
    for _ in range(rounds):
        tier = CPUPrimaryTier(size, 1, policy, require_alignment=False)
        for start in range(0, size, batch):
            # Keys are built just before use, as the scheduler does (untimed).
            chunk = make_keys(min(batch, size - start), rng)
            again = equal_copies(chunk)
            n = len(chunk)
            t0 = clock()
            out = tier.prepare_store(chunk, NO_CONTEXT)
            t1 = clock()
            tier.complete_store(chunk)
            t2 = clock()
            hits = [tier.lookup(k, NO_CONTEXT) for k in again]
            t3 = clock()
            tier.touch(again, NO_CONTEXT)
            t4 = clock()
            tier.prepare_load(again, NO_CONTEXT)
            t5 = clock()
            tier.complete_load(again)
            t6 = clock()
            assert out is not None and all(hits)
            spans = (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4, t6 - t5)
            for op, ns in zip(FILL_OPS, spans, strict=True):
                timings.add(op, ns, n)
        tier.take_events()
        tier.shutdown()
    return timings


def pressure_phase(policy: str, size: int, batch: int, blocks: int, rng: random.Random) -> Timings:
    timings = Timings()
    clock = time.perf_counter_ns
    tier = CPUPrimaryTier(size, 1, policy, require_alignment=False)
    recent: list[OffloadKey] = []
    for start in range(0, size, batch):  # fill, untimed
        chunk = make_keys(min(batch, size - start), rng)
        tier.prepare_store(chunk, NO_CONTEXT)
        tier.complete_store(chunk)
        recent = (recent + chunk)[-4 * batch :]
    reuse = max(1, batch // 4)
    for _ in range(0, blocks, batch):
        chunk = make_keys(batch, rng)
        sample = rng.sample(recent, min(reuse, len(recent)))
        # ARC may have evicted recent keys that were never reused (untimed check).
        hits = equal_copies([k for k in sample if tier.is_ready(k)])
        t0 = clock()
        tier.touch(hits, NO_CONTEXT)
        tier.prepare_load(hits, NO_CONTEXT)
        tier.complete_load(hits)
        t1 = clock()
        out = tier.prepare_store(chunk, NO_CONTEXT)
        t2 = clock()
        tier.complete_store(chunk)
        t3 = clock()
        assert out is not None and len(out.evicted_keys) == len(chunk)
        timings.add("reuse", t1 - t0, len(hits))
        timings.add("store+evict", t2 - t1, len(chunk))
        timings.add("complete", t3 - t2, len(chunk))
        recent = recent[len(chunk) :] + chunk
        tier.take_events()  # the manager drains events every step
    tier.shutdown()
    return timings


def dict_floor_fill(size: int, batch: int, min_blocks: int, rng: random.Random) -> float:
    """ns per block of the least dict work a fill needs: index, order, look up, reorder."""
    total = 0
    rounds = max(1, -(-min_blocks // size))
    for _ in range(rounds):
        index: dict[OffloadKey, int] = {}
        order: OrderedDict[OffloadKey, None] = OrderedDict()
        for start in range(0, size, batch):
            chunk = make_keys(min(batch, size - start), rng)
            again = equal_copies(chunk)
            begin = time.perf_counter_ns()
            for block, key in enumerate(chunk, start):
                index[key] = block
                order[key] = None
            for key in again:
                _ = key in index
                order.move_to_end(key)
            total += time.perf_counter_ns() - begin
    return total / (rounds * size)


def dict_floor_pressure(size: int, batch: int, blocks: int, rng: random.Random) -> float:
    """ns per block of the least dict work a store under pressure needs (LRU order)."""
    index: dict[OffloadKey, int] = {}
    order: OrderedDict[OffloadKey, None] = OrderedDict()
    for start in range(0, size, batch):
        for block, key in enumerate(make_keys(min(batch, size - start), rng), start):
            index[key] = block
            order[key] = None
    total = 0
    for _ in range(0, blocks, batch):
        chunk = make_keys(batch, rng)
        begin = time.perf_counter_ns()
        for key in chunk:
            _ = key in index
        freed = []
        for _key in chunk:
            victim, _ = order.popitem(last=False)
            freed.append(index.pop(victim))
        for key, block in zip(chunk, freed, strict=True):
            index[key] = block
            order[key] = None
        total += time.perf_counter_ns() - begin
    return total / blocks


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", default="10000,100000,1000000")
    parser.add_argument("--policies", default="lru,arc,kvaware")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--min-blocks", type=int, default=300_000)
    parser.add_argument("--pressure-blocks", type=int, default=300_000)
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds: 1k and 10k blocks, 10k blocks timed per phase, one trial",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.sizes, args.min_blocks, args.pressure_blocks, args.trials = (
            "1000,10000",
            10_000,
            10_000,
            1,
        )
    sizes = [int(s) for s in args.sizes.split(",")]
    policies = args.policies.split(",")
    rng = random.Random(args.seed)

    columns = [*FILL_OPS, "fill sum", "store+evict", "complete", "evict sum"]
    results: dict[tuple[str, int], dict[str, float]] = {}
    floors: dict[int, dict[str, float]] = {}
    # Trials are interleaved across configurations, so a burst of load from other
    # processes hits one trial of every configuration rather than all trials of one.
    for _ in range(args.trials):
        for size in sizes:
            gc.collect()
            trial = {
                "fill sum": dict_floor_fill(size, args.batch, args.min_blocks, rng) / 1e3,
                "evict sum": dict_floor_pressure(size, args.batch, args.pressure_blocks, rng) / 1e3,
            }
            best = floors.setdefault(size, trial)
            for op, value in trial.items():
                best[op] = min(best[op], value)
        for policy in policies:
            for size in sizes:
                gc.collect()
                fill = fill_phase(policy, size, args.batch, args.min_blocks, rng)
                gc.collect()
                pressure = pressure_phase(policy, size, args.batch, args.pressure_blocks, rng)
                trial = {op: fill.us_per_block(op) for op in FILL_OPS}
                trial["store+evict"] = pressure.us_per_block("store+evict")
                trial["complete"] = pressure.us_per_block("complete")
                row = results.setdefault((policy, size), trial)
                for op, value in trial.items():
                    row[op] = min(row[op], value)
    for row in results.values():
        row["fill sum"] = sum(row[op] for op in FILL_OPS)
        row["evict sum"] = row["store+evict"] + row["complete"]

    print(
        f"CPU primary tier metadata cost, us per block, best of {args.trials} "
        f"(batch {args.batch}; fill timed over >= {args.min_blocks} blocks, pressure over "
        f"{args.pressure_blocks})"
    )
    header = f"{'policy':<7} {'blocks':>9} " + " ".join(f"{c:>14}" for c in columns)
    print(header)
    print("-" * len(header))
    ratio_label = f"{sizes[-1] // 1000}k/{sizes[0] // 1000}k"
    worst_us = 0.0
    worst_ratio = 0.0
    for policy in policies:
        for size in sizes:
            row = results[(policy, size)]
            worst_us = max(worst_us, *(row[op] for op in FILL_OPS), row["store+evict"])
            print(f"{policy:<7} {size:>9} " + " ".join(f"{row[c]:>14.3f}" for c in columns))
        small, large = results[(policy, sizes[0])], results[(policy, sizes[-1])]
        ratios = {c: large[c] / small[c] for c in columns}
        worst_ratio = max(worst_ratio, ratios["fill sum"], ratios["evict sum"])
        print(f"{policy:<7} {ratio_label:>9} " + " ".join(f"{ratios[c]:>13.2f}x" for c in columns))
    blank = " " * 15 * len(FILL_OPS)
    for size in sizes:
        floor = floors[size]
        print(
            f"{'dict':<6} {size:>9} {blank}{floor['fill sum']:>14.3f} {'':>14} {'':>14} "
            f"{floor['evict sum']:>14.3f}"
        )
    floor_small, floor_large = floors[sizes[0]], floors[sizes[-1]]
    print(
        f"{'dict':<6} {ratio_label:>9} {blank}"
        f"{floor_large['fill sum'] / floor_small['fill sum']:>13.2f}x {'':>14} {'':>14} "
        f"{floor_large['evict sum'] / floor_small['evict sum']:>13.2f}x"
    )
    print(
        "(dict = the least dict + OrderedDict work any Python block map does for the same "
        "keys, measured in this run: the memory-hierarchy floor of the ratio)"
    )
    if "lru" in policies:
        worst_vs_lru = 0.0
        for policy in policies:
            if policy == "lru":
                continue
            for size in sizes:
                row, lru = results[(policy, size)], results[("lru", size)]
                factors = {c: row[c] / lru[c] for c in ("fill sum", "evict sum")}
                worst_vs_lru = max(worst_vs_lru, *factors.values())
                print(
                    f"{policy:<7} {size:>9} x LRU: fill sum {factors['fill sum']:.2f}x, "
                    f"evict sum {factors['evict sum']:.2f}x"
                )
        print(
            f"worst per-block cost against LRU: {worst_vs_lru:.2f}x (target <= "
            f"{TARGET_VS_LRU}x): {'OK' if worst_vs_lru <= TARGET_VS_LRU else 'MISSED'}"
        )
    print()
    print(
        f"largest per-block figure: {worst_us:.3f} us (target < {TARGET_US} us): "
        f"{'OK' if worst_us < TARGET_US else 'MISSED'}"
    )
    print(
        f"worst {ratio_label} ratio of the sums: {worst_ratio:.2f}x "
        f"(target <= {TARGET_RATIO}x): {'OK' if worst_ratio <= TARGET_RATIO else 'MISSED'}"
    )


if __name__ == "__main__":
    main()
