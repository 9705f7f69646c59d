"""Redis tier throughput against a raw pipelined SET/GET loop with redis-py, in the same run.

Starts its own redis-server (no persistence) on a free loopback port. For
64 KiB and 1 MiB blocks it stores and loads jobs of ``--job-mib`` MiB:

* through the tier: ``RedisTier.write_many`` / ``read_many`` (header, xxh3
  checksum, verification, copy of each value into its destination row);
* through the tier with an auth key (``auth_key_env``): the same, with an
  HMAC-SHA256 tag computed per stored block and checked per loaded block
  instead of the xxh3 checksum (the cost of authenticated blocks);
* raw: the same redis-py asyncio client settings, one pipeline per job of
  ``SET key <row>`` (the row's memoryview, no header) / ``GET key`` (the
  returned bytes are not copied anywhere), queued with ``execute_command``
  (cheaper than ``pipe.set``/``pipe.get``): the ceiling of the client itself.

Both sides send one pipeline per job over one connection, jobs one after
another, alternating tier and raw each repetition. Figures are medians of
``--reps`` repetitions, plus the ratio of the fastest repetitions (less
sensitive to other processes on a shared machine); compare the ratios
(target: tier >= 80 % of raw). ``CPU s/GB`` is this process's CPU time per GB
moved (the server's is not included).

Run: ``.venv/bin/python benchmarks/redis_tier.py [--total-mib 128] [--reps 5]``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

import redis.asyncio as aioredis

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.redis_server import RedisServer
from tiering.keys import OffloadKey, make_offload_key
from tiering.tier import TierContext
from tiers.redis import RedisTier
from tiers.redis.connection import build_client

KIB = 1024
MIB = 1024 * KIB
BLOCK_SIZES = (64 * KIB, 1 * MIB)
#: The variable the authenticated tier reads its key from (a fresh key per run).
AUTH_ENV = "KVT_BENCH_REDIS_AUTH_KEY"


@dataclass
class Measure:
    seconds: list[float]
    cpu_seconds: list[float]

    def rate(self, nbytes: int) -> tuple[float, float, float, float]:
        """(median GB/s, median runs/s, best GB/s, median CPU s/GB)."""
        wall = statistics.median(self.seconds)
        cpu = statistics.median(self.cpu_seconds)
        best = min(self.seconds)
        return nbytes / wall / 1e9, 1.0 / wall, nbytes / best / 1e9, cpu / (nbytes / 1e9)


async def timed(run: Callable[[], Awaitable[None]], into: Measure) -> None:
    wall, cpu = time.perf_counter(), time.process_time()
    await run()
    into.seconds.append(time.perf_counter() - wall)
    into.cpu_seconds.append(time.process_time() - cpu)


async def bench_size(url: str, block: int, total: int, job_bytes: int, reps: int) -> list[str]:
    blocks_total = max(1, total // block)
    per_job = max(1, job_bytes // block)
    source = bytearray(os.urandom(block * per_job))
    rows = [memoryview(source)[i * block : (i + 1) * block] for i in range(per_job)]
    dest = bytearray(block * per_job)
    dest_rows = [memoryview(dest)[i * block : (i + 1) * block] for i in range(per_job)]
    keys: list[OffloadKey] = [make_offload_key(os.urandom(16), 0) for _ in range(blocks_total)]
    raw_names = [b"raw:" + k.hex().encode() for k in keys]
    jobs = [(lo, min(lo + per_job, blocks_total)) for lo in range(0, blocks_total, per_job)]

    context = TierContext(block_bytes=block, layout_fingerprint="bench", name="bench")
    tier = RedisTier(url=url, namespace="bench", max_blocks_in_flight=per_job, op_timeout_s=30)
    await tier.open(context)
    auth_tier = RedisTier(
        url=url,
        namespace="bench",
        max_blocks_in_flight=per_job,
        op_timeout_s=30,
        auth_key_env=AUTH_ENV,
    )
    await auth_tier.open(context)
    # The raw loop uses a client built with the tier's own settings, so the ratio
    # measures the tier's work (header, checksum, verification, copies), not tuning.
    raw = build_client(tier.config)
    assert isinstance(raw, aioredis.Redis)

    async def tier_store() -> None:
        for lo, hi in jobs:
            await tier.write_many(keys[lo:hi], rows[: hi - lo])

    async def tier_load() -> None:
        for lo, hi in jobs:
            await tier.read_many(keys[lo:hi], dest_rows[: hi - lo])

    async def auth_store() -> None:
        for lo, hi in jobs:
            await auth_tier.write_many(keys[lo:hi], rows[: hi - lo])

    async def auth_load() -> None:
        for lo, hi in jobs:
            await auth_tier.read_many(keys[lo:hi], dest_rows[: hi - lo])

    async def raw_store() -> None:
        for lo, hi in jobs:
            pipe = raw.pipeline(transaction=False)
            for name, row in zip(raw_names[lo:hi], rows, strict=False):
                pipe.execute_command("SET", name, row)
            await pipe.execute()

    async def raw_load() -> None:
        for lo, hi in jobs:
            pipe = raw.pipeline(transaction=False)
            for name in raw_names[lo:hi]:
                pipe.execute_command("GET", name)
            await pipe.execute()

    measures = {
        f"{side}_{op}": Measure([], [])
        for side in ("tier", "auth", "raw")
        for op in ("store", "load")
    }
    try:
        await tier_store()  # warm-up: connections, allocator, server memory
        await auth_store()
        await raw_store()
        for _ in range(reps):
            await timed(raw_store, measures["raw_store"])
            await timed(tier_store, measures["tier_store"])
            await timed(auth_store, measures["auth_store"])
            await timed(raw_load, measures["raw_load"])
            await timed(tier_load, measures["tier_load"])
            await timed(auth_load, measures["auth_load"])
        first = jobs[0][1]
        for check in (tier, auth_tier):
            dest[:] = bytes(len(dest))
            await check.read_many(keys[:first], dest_rows[:first])
            assert bytes(dest[: block * first]) == bytes(source[: block * first])
    finally:
        await tier.aclose()
        await auth_tier.aclose()
        await raw.aclose()

    moved = blocks_total * block
    lines = []
    for op in ("store", "load"):
        t_gbs, t_runs, t_best, t_cpu = measures[f"tier_{op}"].rate(moved)
        a_gbs, _, _, a_cpu = measures[f"auth_{op}"].rate(moved)
        r_gbs, r_runs, r_best, r_cpu = measures[f"raw_{op}"].rate(moved)
        lines.append(
            f"| {block // KIB:>5} KiB | {op:5} | {t_gbs:6.2f} | {t_runs * blocks_total:8.0f} | "
            f"{r_gbs:6.2f} | {r_runs * blocks_total:8.0f} | {t_gbs / r_gbs:6.0%} | "
            f"{t_best / r_best:6.0%} | {t_cpu:5.2f} | {r_cpu:5.2f} | "
            f"{a_gbs:6.2f} | {a_gbs / t_gbs:6.0%} | {a_cpu:5.2f} |"
        )
    return lines


async def main_async(args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory(prefix="kvt-bench-redis-") as workdir:
        server = RedisServer(Path(workdir)).start()
        try:
            print(
                f"redis-server on {server.url}; {args.total_mib} MiB per measurement, "
                f"jobs of {args.job_mib} MiB, median of {args.reps}\n"
            )
            print(
                "| block     | op    | tier GB/s | tier blk/s | raw GB/s | raw blk/s | "
                "tier/raw | tier/raw (best) | tier CPU s/GB | raw CPU s/GB | "
                "auth GB/s | auth/tier | auth CPU s/GB |"
            )
            print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
            for block in BLOCK_SIZES:
                for line in await bench_size(
                    server.url, block, args.total_mib * MIB, args.job_mib * MIB, args.reps
                ):
                    print(line)
                with server.client() as flush:
                    flush.flushall()
        finally:
            server.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--total-mib", type=int, default=128, help="data per measurement")
    parser.add_argument("--job-mib", type=int, default=4, help="bytes per job (one pipeline)")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    os.environ[AUTH_ENV] = secrets.token_urlsafe(32)
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
