"""Back-pressure: a secondary tier throttled to 1/4 of the offered store bandwidth, in one run.

A scheduler loop drives our ``TieringOffloadingManager`` as an engine would:
each step looks up a few requests' prefixes (popular prefixes recur, Zipf),
promotes what a tier holds, and offloads the blocks it had to compute; between
steps it sleeps ``--gpu-ms`` (the model's time on the GPU). Three runs, same
workload and seed:

* ``steps alone``: no secondary tier (the scheduler's own cost);
* ``unthrottled``: an in-memory tier at full speed;
* ``throttled``: the same tier, writes limited to 1/4 of the store bandwidth
  the engine offers with no tier to hit in (the ``steps alone`` run's);
* ``throttled, no back-pressure``: the same with ``cascade_max_pinned_fraction``
  1.0 (the tier may pin the whole CPU tier): what back-pressure prevents;
* ``throttled, tier between steps``: the throttled run again with Python's
  switch interval at 1 s, so the tier's loop thread cannot take the GIL in
  the middle of a step, only while the scheduler sleeps: the same steps, with
  the same work (hits, promotions, results), as if alone on the machine.

A step with a tier does more than a step without one: its hits are looked up
to the end of the prefix, promoted, and loaded, where a miss stops the scan.
``steps alone`` therefore bounds the cost of having a tier at all; ``tier
between steps`` isolates the cost of the tier running beside the scheduler.

Reported per run: blocks offered to the tier (stored into the CPU tier),
stored by the tier, dropped by back-pressure, prepare_store refusals, the
token hit rate, and the scheduler's step time (p50, p99: the manager's work in
a step, not the GPU sleep) and the p99 of its wait (the step's wall time less
the scheduler thread's CPU time in it: the GIL or a core held by someone else).
Verdict lines (against the same run's figures): dropped blocks equal in
``stats()`` and Prometheus, no refused offload uncounted, throttled step p99
<= 1.25x of steps alone and of the same steps with the tier between them.

How the scheduler waits for the GPU (``--gpu-wait``): ``sleep`` (the default) idles the
core, so every step starts with its data out of the caches; ``spin`` waits as vLLM 0.33's
engine core waits for its workers, ``os.sched_yield()`` in a loop (its shared-memory
``MessageQueue`` reader busy-loops so for 1 s after each read), which keeps the core
awake and releases the GIL at every call.

Run: ``.venv/bin/python benchmarks/backpressure.py [--steps 3000] [--gpu-wait spin] [--smoke]``.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import KIB, print_aligned_table
from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.manager import TieringOffloadingManager
from tiering.primary import CPUPrimaryTier
from tiering.runtime.facade import AsyncTierManager
from tiers.memory import MemoryTier

BLOCK_BYTES = 64 * KIB
P99_TARGET = 1.25


def spin_wait(seconds: float) -> None:
    """Wait as vLLM's engine core waits for its workers: ``os.sched_yield()`` until the
    deadline (the core stays awake; each call releases the GIL)."""
    deadline = time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        os.sched_yield()


#: ``--gpu-wait``: how the scheduler thread spends the GPU's time between steps.
GPU_WAITS: dict[str, Callable[[float], None]] = {"sleep": time.sleep, "spin": spin_wait}


class ThrottledMemoryTier(MemoryTier):
    """An in-memory tier whose writes proceed at ``bytes_per_s`` (a serial token bucket)."""

    def __init__(self, bytes_per_s: float, **options: Any) -> None:
        super().__init__(**options)
        self.bytes_per_s = bytes_per_s
        self._free_at = 0.0

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        await self._throttle(len(data))
        await super().write(key, data)

    async def write_many(self, keys: Sequence[OffloadKey], data: Sequence[memoryview]) -> None:
        await self._throttle(sum(len(d) for d in data))
        await super().write_many(keys, data)

    async def _throttle(self, nbytes: int) -> None:
        now = time.monotonic()
        start = max(now, self._free_at)
        self._free_at = start + nbytes / self.bytes_per_s
        await asyncio.sleep(self._free_at - now)


@dataclass
class RunFigures:
    label: str
    offered: int
    stored: int
    dropped: int
    refused: int
    hit_rate: float
    step_p50_us: float
    step_p99_us: float
    wait_p99_us: float
    wall_s: float
    cascaded_bytes: int
    prometheus_dropped: float | None
    published_dropped: int  # stats() when Prometheus was read


def request_keys(prefix: int, blocks: int) -> list[OffloadKey]:
    return [make_offload_key(f"{prefix}/{i}".encode().ljust(16, b"."), 0) for i in range(blocks)]


def run(
    label: str,
    tier: MemoryTier | None,
    *,
    steps: int,
    seed: int,
    primary_blocks: int,
    gpu_s: float,
    pinned_fraction: float = 0.25,
    gpu_wait: Callable[[float], None] = time.sleep,
) -> RunFigures:
    rng = random.Random(seed)
    primary = CPUPrimaryTier(primary_blocks, BLOCK_BYTES)
    registry: Any = False
    try:
        import prometheus_client

        registry = prometheus_client.CollectorRegistry()
    except ImportError:
        pass
    tiers = [AsyncTierManager(tier, primary.kv_view, "memory")] if tier is not None else []
    manager = TieringOffloadingManager(
        primary,
        tiers,
        metrics_registry=registry,
        name=label,
        cascade_max_pinned_fraction=pinned_fraction,
    )
    catalog = primary_blocks  # prefixes of 8 blocks: the working set is 8x the CPU tier
    population = range(catalog)
    cum_weights = list(itertools.accumulate(1.0 / (rank + 1) ** 0.8 for rank in range(catalog)))
    prefix_keys = [request_keys(prefix, 8) for prefix in range(catalog)]  # not the step's work
    step_times: list[float] = []
    waits: list[float] = []  # wall time in the step that the scheduler thread did not run
    hit_blocks = total_blocks = 0
    waiting: list[int] = []  # requests whose blocks are on their way from a tier (RETRY)
    start = time.perf_counter()
    for _ in range(steps):
        # The step's new requests, drawn before the clock starts: a weighted draw over the
        # catalog costs about a tenth of a step, and it is the workload's, not the scheduler's.
        arrivals = rng.choices(population, cum_weights=cum_weights, k=2)
        t0, cpu0 = time.perf_counter(), time.thread_time()
        manager.step()
        retry, waiting = waiting, []
        for prefix in retry + arrivals:
            keys = prefix_keys[prefix]
            # As vLLM 0.33's connector scans a prefix: on to the first miss, past the keys
            # on their way (so every block of the request is promoted at once).
            found, deferred = 0, False
            for key in keys:
                answer = manager.lookup(key, NO_CONTEXT)
                if answer is False:
                    break
                found += 1
                deferred |= answer is None
            if deferred:  # promoting: the engine schedules it next step
                waiting.append(prefix)
                continue
            total_blocks += len(keys)
            hit_blocks += found
            if found:
                manager.prepare_load(keys[:found], NO_CONTEXT)
                manager.complete_load(keys[:found])
            output = manager.prepare_store(keys[found:], NO_CONTEXT)
            if output is not None and output.keys_to_store:
                manager.complete_store(output.keys_to_store)
        elapsed = time.perf_counter() - t0
        step_times.append(elapsed)
        waits.append(max(0.0, elapsed - (time.thread_time() - cpu0)))
        gpu_wait(gpu_s)  # the model computes; the tier's loop thread works meanwhile
    wall = time.perf_counter() - start
    manager.publish_metrics()
    published = manager.stats()
    prometheus = None
    if tiers and registry is not False:
        # Read before shutdown, which unregisters the series.
        prometheus = registry.get_sample_value(
            "kv_tiering_tier_dropped_blocks_total",
            {"manager": label, "tier": "memory", "medium": published.secondary[0].medium},
        )
    manager.shutdown()
    final = manager.stats()
    secondary = final.secondary[0] if final.secondary else None
    step_times.sort()
    waits.sort()
    return RunFigures(
        label=label,
        offered=final.primary.cascades,
        stored=secondary.cascades if secondary else 0,
        dropped=secondary.dropped if secondary else 0,
        refused=final.primary.dropped,
        hit_rate=hit_blocks / max(1, total_blocks),
        step_p50_us=statistics.median(step_times) * 1e6,
        step_p99_us=step_times[int(0.99 * (len(step_times) - 1))] * 1e6,
        wait_p99_us=waits[int(0.99 * (len(waits) - 1))] * 1e6,
        wall_s=wall,
        cascaded_bytes=secondary.bytes_moved if secondary else 0,
        prometheus_dropped=prometheus,
        published_dropped=published.secondary[0].dropped if published.secondary else 0,
    )


def main(argv: Any = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=3000)
    parser.add_argument("--primary-blocks", type=int, default=512)
    parser.add_argument("--gpu-ms", type=float, default=2.0, help="GPU time per step (sleep)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--gpu-wait",
        choices=sorted(GPU_WAITS),
        default="sleep",
        help="how the scheduler waits for the GPU: sleep (idle core) or spin (sched_yield, "
        "as vLLM's engine core waits for its workers)",
    )
    parser.add_argument("--smoke", action="store_true", help="a few seconds: 300 steps")
    args = parser.parse_args(argv)
    if args.smoke:
        args.steps = 300
    if args.steps < 10 or args.primary_blocks < 16:
        parser.error("--steps must be >= 10 and --primary-blocks >= 16")
    common = {
        "steps": args.steps,
        "seed": args.seed,
        "primary_blocks": args.primary_blocks,
        "gpu_s": args.gpu_ms / 1e3,
        "gpu_wait": GPU_WAITS[args.gpu_wait],
    }
    alone = run("steps alone", None, **common)
    # What the engine stores per second with no tier to hit in: the offered bandwidth.
    offered_bps = alone.offered * BLOCK_BYTES / alone.wall_s
    free = run("unthrottled", MemoryTier(), **common)
    throttled = run("throttled", ThrottledMemoryTier(offered_bps / 4), **common)
    # The same, with back-pressure off (a share of the whole CPU tier): what it prevents.
    unguarded = run(
        "throttled, no back-pressure",
        ThrottledMemoryTier(offered_bps / 4),
        pinned_fraction=1.0,
        **common,
    )
    # The throttled run's steps with its work, the loop thread kept out of them: a switch
    # interval longer than any step, so the loop takes the GIL only while the scheduler sleeps.
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1.0)
    try:
        between = run(
            "throttled, tier between steps", ThrottledMemoryTier(offered_bps / 4), **common
        )
    finally:
        sys.setswitchinterval(interval)
    print(
        f"workload: {args.steps} steps, 2 requests x 8 blocks of {BLOCK_BYTES // KIB} KiB per "
        f"step, CPU tier {args.primary_blocks} blocks, {args.gpu_ms} ms GPU time per step "
        f"({args.gpu_wait}); "
        f"offered store bandwidth {offered_bps / 1e6:.1f} MB/s, throttle "
        f"{offered_bps / 4e6:.1f} MB/s"
    )
    header = ("run", "offered", "stored", "dropped", "refused", "hit rate", "step p50 us",
              "step p99 us", "wait p99 us")  # fmt: skip
    rows = [
        (
            r.label,
            f"{r.offered:,}",
            f"{r.stored:,}",
            f"{r.dropped:,}",
            f"{r.refused:,}",
            f"{r.hit_rate:.1%}",
            f"{r.step_p50_us:,.0f}",
            f"{r.step_p99_us:,.0f}",
            f"{r.wait_p99_us:,.0f}",
        )
        for r in (alone, free, throttled, unguarded, between)
    ]
    print_aligned_table(header, rows)
    ratio = throttled.step_p99_us / alone.step_p99_us
    against_free = throttled.step_p99_us / free.step_p99_us
    against_between = throttled.step_p99_us / between.step_p99_us
    counted = throttled.prometheus_dropped == float(throttled.published_dropped)
    accounted = throttled.offered == throttled.stored + throttled.dropped
    print(
        f"verdict: dropped blocks {throttled.published_dropped:,} in stats, "
        f"{throttled.prometheus_dropped} in Prometheus (same moment): "
        f"{'ok' if counted else 'MISMATCH'}"
    )
    print(
        f"verdict: offered = stored + dropped for the throttled tier "
        f"({throttled.offered:,} = {throttled.stored:,} + {throttled.dropped:,}): "
        f"{'ok' if accounted else 'MISMATCH'}"
    )
    print(
        f"verdict: refused offloads counted: {throttled.refused:,} (every refusal is in "
        "stats.primary.dropped; none is silent)"
    )
    print(
        f"verdict: throttled step p99 {ratio:.2f}x of steps alone (target <= {P99_TARGET}x): "
        f"{'ok' if ratio <= P99_TARGET else 'ABOVE'}"
    )
    print(
        f"verdict: throttled step p99 {against_between:.2f}x of the same steps with the tier "
        f"working only between them (the cost of the tier running beside the scheduler; "
        f"target <= {P99_TARGET}x): {'ok' if against_between <= P99_TARGET else 'ABOVE'}"
    )
    print(
        f"verdict: throttled step p99 {against_free:.2f}x of the unthrottled tier's "
        f"(the cost of the slow tier itself; target <= {P99_TARGET}x): "
        f"{'ok' if against_free <= P99_TARGET else 'ABOVE'}"
    )
    print(
        f"hit rate: throttled {throttled.hit_rate:.1%} against unthrottled {free.hit_rate:.1%}, "
        f"no tier {alone.hit_rate:.1%}, throttled without back-pressure "
        f"{unguarded.hit_rate:.1%}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
