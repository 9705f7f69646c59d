"""Scheduler-thread cost per block of the TieringOffloadingManager, with the in-memory tier.

Two cycles, each in batches of ``--batch`` blocks (one request's prefix), with the CPU
primary tier full (every store and promotion evicts), at 10k and 1M primary blocks:

* **store-cascade**: ``prepare_store`` + ``complete_store`` (which submits one cascade job
  to the tier) and the ``step()`` that collects the job's result and releases its pins;
* **lookup-promote-load**: ``lookup`` of blocks held only by the tier (reserve rows, stage
  the promotion), ``step()`` (submit), ``lookup`` again once landed (collect the result,
  commit the rows: hits), ``prepare_load`` + ``complete_load``, and the closing ``step()``.

Only time spent inside manager calls on the scheduler thread is counted; waiting for the
tier's loop thread to finish a job (``drain``) is not. The peer is the bare CPU primary
tier doing the same primary-tier operations (store: prepare/complete_store; load:
prepare/complete_load) in the same run: the difference is the manager's and the facade's
cost. Target: < 10 us per block per cycle and flat from 10k to 1M blocks. Medians of
``--reps`` runs; the machine is shared and noisy, compare ratios.

Run: ``.venv/bin/python benchmarks/manager.py [--batch 128] [--rounds 100] [--reps 5] [--smoke]``.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time
from collections.abc import Callable

import numpy as np

from tiering.core.jobs import JobMetadata
from tiering.core.keys import NO_CONTEXT, OffloadKey, ReqContext, make_offload_key
from tiering.manager import TieringOffloadingManager
from tiering.primary import CPUPrimaryTier
from tiering.runtime.facade import AsyncTierManager
from tiers.memory import MemoryTier

BLOCK_BYTES = 64  # metadata cost is the subject; small rows keep 1M blocks cheap
TARGET_US = 10.0


class Stopwatch:
    """Adds up wall and thread-CPU time of the timed sections only."""

    def __init__(self) -> None:
        self.wall = 0.0
        self.cpu = 0.0

    def time(self, fn: Callable[[], object]) -> None:
        wall, cpu = time.perf_counter(), time.thread_time()
        fn()
        self.cpu += time.thread_time() - cpu
        self.wall += time.perf_counter() - wall


class Keys:
    """Fresh, never-seen keys."""

    def __init__(self, start: int) -> None:
        self._next = start

    def take(self, n: int) -> list[OffloadKey]:
        first, self._next = self._next, self._next + n
        return [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(first, first + n)]


def fill_primary(primary: CPUPrimaryTier, keys: Keys) -> None:
    """Make the primary tier full of ready blocks (untimed; straight through its API)."""
    chunk = 100_000
    while primary.num_free():
        batch = keys.take(min(chunk, primary.num_free()))
        output = primary.prepare_store(batch, NO_CONTEXT)
        assert output is not None
        primary.complete_store(output.keys_to_store)


def fill_tier(facade: AsyncTierManager, keys: list[OffloadKey], batch: int) -> None:
    """Put ``keys`` into the secondary tier only (untimed; straight through the facade)."""
    for i in range(0, len(keys), batch):
        part = keys[i : i + batch]
        rows = np.arange(len(part), dtype=np.int64)
        facade.submit_store(JobMetadata(10**12 + i, tuple(part), rows, False))
        facade.drain(60.0)
        assert all(r.success for r in facade.get_finished())


def store_cascade(
    manager: TieringOffloadingManager, facade: AsyncTierManager, keys: Keys, batch: int, rounds: int
) -> Stopwatch:
    watch = Stopwatch()
    for _ in range(rounds):
        batch_keys = keys.take(batch)

        def store(batch_keys: list[OffloadKey] = batch_keys) -> None:
            output = manager.prepare_store(batch_keys, NO_CONTEXT)
            assert output is not None and len(output.evicted_keys) == batch
            manager.complete_store(output.keys_to_store)

        watch.time(store)
        facade.drain(60.0)  # the tier's loop thread copies the rows: not scheduler time
        watch.time(manager.step)
        assert manager.jobs_in_flight() == 0
    return watch


def promote_load(
    manager: TieringOffloadingManager,
    facade: AsyncTierManager,
    tier_keys: list[OffloadKey],
    batch: int,
    rounds: int,
) -> Stopwatch:
    watch = Stopwatch()
    for r in range(rounds):
        batch_keys = tier_keys[r * batch : (r + 1) * batch]
        ctx = ReqContext(req_id=f"r{r}")

        def first_lookups(batch_keys: list[OffloadKey] = batch_keys, ctx: ReqContext = ctx) -> None:
            for key in batch_keys:
                assert manager.lookup(key, ctx) is None
            manager.step()  # submits the batch as one job

        def hits_and_load(batch_keys: list[OffloadKey] = batch_keys, ctx: ReqContext = ctx) -> None:
            for key in batch_keys:
                assert manager.lookup(key, ctx) is True
            manager.prepare_load(batch_keys, ctx)
            manager.complete_load(batch_keys)
            manager.step()

        watch.time(first_lookups)
        facade.drain(60.0)
        watch.time(hits_and_load)
    return watch


def bare_primary(
    primary: CPUPrimaryTier, keys: Keys, batch: int, rounds: int
) -> tuple[Stopwatch, Stopwatch]:
    store, load = Stopwatch(), Stopwatch()
    for _ in range(rounds):
        batch_keys = keys.take(batch)

        def do_store(batch_keys: list[OffloadKey] = batch_keys) -> None:
            output = primary.prepare_store(batch_keys, NO_CONTEXT)
            assert output is not None
            primary.complete_store(output.keys_to_store)

        def do_load(batch_keys: list[OffloadKey] = batch_keys) -> None:
            primary.prepare_load(batch_keys, NO_CONTEXT)
            primary.complete_load(batch_keys)

        store.time(do_store)
        load.time(do_load)
    return store, load


def run(num_blocks: int, batch: int, rounds: int) -> dict[str, float]:
    blocks = batch * rounds
    keys = Keys(0)
    # The peer: the bare primary tier, same sizes, same fullness.
    peer = CPUPrimaryTier(num_blocks, BLOCK_BYTES, require_alignment=False)
    fill_primary(peer, keys)
    peer_store, peer_load = bare_primary(peer, keys, batch, rounds)
    peer.shutdown()

    primary = CPUPrimaryTier(num_blocks, BLOCK_BYTES, require_alignment=False)
    facade = AsyncTierManager(MemoryTier(), primary.kv_view, "memory")
    fill_primary(primary, keys)
    tier_keys = keys.take(blocks)
    fill_tier(facade, tier_keys, batch)
    manager = TieringOffloadingManager(primary, [facade], metrics_registry=False)
    try:
        gc.collect()
        cascade = store_cascade(manager, facade, keys, batch, rounds)
        promote = promote_load(manager, facade, tier_keys, batch, rounds)
        stats = manager.stats()
        assert stats.primary.promotions == blocks and stats.secondary[0].cascades == blocks
        assert stats.internal_errors == 0 and primary.num_pinned() == 0
    finally:
        manager.shutdown()
    us = 1e6 / blocks
    return {
        "cascade_wall": cascade.wall * us,
        "cascade_cpu": cascade.cpu * us,
        "promote_wall": promote.wall * us,
        "promote_cpu": promote.cpu * us,
        "peer_store": peer_store.cpu * us,
        "peer_load": peer_load.cpu * us,
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128, help="blocks per request (job)")
    parser.add_argument("--rounds", type=int, default=100, help="batches per measurement")
    parser.add_argument("--reps", type=int, default=5, help="measurements per size (median)")
    parser.add_argument("--sizes", type=int, nargs="+", default=[10_000, 1_000_000])
    parser.add_argument(
        "--smoke",
        action="store_true",
        help="a few seconds: 1k and 10k blocks, small batches, 1 rep",
    )
    args = parser.parse_args(argv)
    if args.smoke:
        args.batch, args.rounds, args.reps, args.sizes = 16, 10, 1, [1_000, 10_000]

    results: dict[int, dict[str, float]] = {}
    for num_blocks in args.sizes:
        runs = []
        for _ in range(args.reps):
            runs.append(run(num_blocks, args.batch, args.rounds))
            gc.collect()
        results[num_blocks] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}

    print(
        f"\nTieringOffloadingManager, scheduler-thread us per block "
        f"(batch {args.batch}, {args.rounds * args.batch} blocks per run, median of {args.reps}; "
        "shared machine, noisy)\n"
        "cpu: the scheduler thread's CPU time in manager calls; wall: the same calls' wall time "
        "(adds GIL waits while the tier's loop thread copies, and the machine's steal)\n"
        "bare primary: the CPU primary tier alone doing a store (prepare+complete_store, "
        "evicting) and a load (prepare+complete_load) per block, CPU time: both cycles do both\n"
        "(a cascade pins rows with prepare/complete_load; a promotion reserves rows with "
        "prepare/complete_store); overhead = cpu - bare primary\n"
    )
    header = (
        f"{'primary blocks':>14} | {'cycle':<20} | {'cpu us':>7} | {'wall us':>8} | "
        f"{'bare primary':>12} | {'overhead':>8} | {'cpu / target':>12}"
    )
    print(header)
    print("-" * len(header))
    for num_blocks, r in results.items():
        bare = r["peer_store"] + r["peer_load"]
        for name, cpu, wall in (
            ("store-cascade", r["cascade_cpu"], r["cascade_wall"]),
            ("lookup-promote-load", r["promote_cpu"], r["promote_wall"]),
        ):
            print(
                f"{num_blocks:>14,} | {name:<20} | {cpu:>7.2f} | {wall:>8.2f} | "
                f"{bare:>12.2f} | {cpu - bare:>8.2f} | {cpu / TARGET_US:>12.2f}"
            )
    if len(results) > 1:
        small, large = min(results), max(results)
        a, b = results[small], results[large]
        bare_a, bare_b = a["peer_store"] + a["peer_load"], b["peer_store"] + b["peer_load"]
        print(
            f"\n{large:,} vs {small:,} blocks (cpu): store-cascade "
            f"{b['cascade_cpu'] / a['cascade_cpu']:.2f}x, lookup-promote-load "
            f"{b['promote_cpu'] / a['promote_cpu']:.2f}x, bare primary {bare_b / bare_a:.2f}x; "
            f"manager overhead {(b['cascade_cpu'] - bare_b) / (a['cascade_cpu'] - bare_a):.2f}x "
            f"and {(b['promote_cpu'] - bare_b) / (a['promote_cpu'] - bare_a):.2f}x. "
            f"Target: < {TARGET_US:.0f} us and flat"
        )


if __name__ == "__main__":
    main()
