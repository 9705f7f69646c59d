"""vLLM's own filesystem tier versus ours, both inside vLLM 0.33's TieringOffloadingManager.

Same workload for both, through vLLM's manager built by its spec
(``TieringOffloadingSpec.get_manager()``, CPU primary tier in shared memory),
driven only through the scheduler-facing API:

1. store: prompts of ``--req-blocks`` blocks, ``--concurrency`` requests in
   flight; lookup, ``prepare_store``, the "GPU -> CPU" copy (rows written
   directly), ``complete_store`` => vLLM cascades each request to the tier;
   stepping until ``has_pending_work()`` is False;
2. a filler request evicts everything from the CPU tier; the buffer is scrubbed;
3. load: the same prompts again; lookup until HIT (promotion tier -> CPU),
   ``prepare_load``, a check of every block (8 bytes per 4 KiB page carry a
   per-block tag), ``complete_load``.

Figures per phase: GB/s = bytes moved / (first job submitted -> last result
collected); scheduler-thread time in tier calls = the time vLLM's manager
spent inside the tier's methods (submit_*, get_finished_jobs, lookup,
on_schedule_end, ... - each wrapped with a timer on the instance), per block
moved and per step. vLLM's tier: ``"type": "fs"`` with its C fast path
(``vllm.fs_io_C``) and O_DIRECT; ours: ``KVTieringFileSystemTier`` (slab
files, O_DIRECT, checksums). Runs alternate between the tiers; medians over
``--runs``. Before each run, fio (io_uring, O_DIRECT, queue depth 32) measures
the disk's ceiling for the block size in the same directory, so both tiers can
be read against what the disk gives. The disk and the machine are noisy and
shared: compare the ratios of one run, not absolute figures across runs.

Targets (issue 9): ours >= 1.0x vLLM at 2 MiB and >= 3x at 64 KiB, store and
load; no more scheduler-thread time per block than vLLM's tier.

Run: ``.venv/bin/python benchmarks/vllm_tiers.py [--runs 3] [--cases 2MiB,64KiB]``
(re-executes itself in the environment ``scripts/vllm_env.sh`` builds).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
KIB = 1024
MIB = 1024 * KIB
PAGE_WORDS = 4096 // 8

#: Tier methods vLLM's manager calls on the scheduler thread (all of them are timed).
TIER_CALLS = (
    "lookup",
    "submit_store",
    "submit_load",
    "get_finished_jobs",
    "on_schedule_end",
    "on_new_request",
    "on_request_finished",
    "has_pending_work",
    "take_events",
    "touch",
    "serve_external_requests",
)


def reexec_in_vllm_env() -> None:
    """Run this script again with the vLLM 0.33 environment's python (built if needed)."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "vllm_env.sh")], stdout=subprocess.PIPE, text=True
    )
    if done.returncode != 0:
        sys.exit("scripts/vllm_env.sh failed; see its log above")
    python = done.stdout.strip().splitlines()[-1]
    env = {**os.environ, "PYTHONPATH": str(REPO), "VLLM_LOGGING_LEVEL": "WARNING"}
    os.execve(python, [python, *sys.argv], env)


@dataclass(frozen=True)
class Case:
    name: str
    block_bytes: int
    total_bytes: int
    cpu_bytes: int


@dataclass
class TierTap:
    """Times every scheduler-thread call into one tier; records the job window."""

    seconds: float = 0.0
    calls: int = 0
    first_submit: float | None = None
    last_result: float | None = None
    results: int = 0
    failed: int = 0

    def install(self, tier: Any) -> None:
        for name in TIER_CALLS:
            method = getattr(tier, name, None)
            if method is not None:
                setattr(tier, name, self._timed(name, method))

    def _timed(self, name: str, method: Callable[..., Any]) -> Callable[..., Any]:
        clock = time.perf_counter

        def call(*args: Any, **kwargs: Any) -> Any:
            start = clock()
            out = method(*args, **kwargs)
            if name == "get_finished_jobs":
                out = list(out)  # a generator would do its work outside the timer
            end = clock()
            self.seconds += end - start
            self.calls += 1
            if name.startswith("submit_") and self.first_submit is None:
                self.first_submit = start
            elif name == "get_finished_jobs" and out:
                self.last_result = end
                self.results += len(out)
                self.failed += sum(not r.success for r in out)
            return out

        return call

    def reset(self) -> None:
        self.seconds, self.calls = 0.0, 0
        self.first_submit = self.last_result = None
        self.results = self.failed = 0

    def window(self) -> float:
        if self.first_submit is None or self.last_result is None:
            return float("nan")
        return self.last_result - self.first_submit


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", default="2MiB,64KiB")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--total-mib-2m", type=int, default=1536, help="data per run, 2 MiB case")
    ap.add_argument("--total-mib-64k", type=int, default=256, help="data per run, 64 KiB case")
    ap.add_argument("--cpu-mib-2m", type=int, default=1024, help="CPU tier, 2 MiB case")
    ap.add_argument("--cpu-mib-64k", type=int, default=64, help="CPU tier, 64 KiB case")
    ap.add_argument("--req-blocks", type=int, default=64)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--root-parent", default=None, help="where tier roots go (default: tmp)")
    ap.add_argument("--idle-sleep-ms", type=float, default=0.2)
    return ap.parse_args()


def cases(args: argparse.Namespace) -> list[Case]:
    known = {
        "2MiB": Case("2MiB", 2 * MIB, args.total_mib_2m * MIB, args.cpu_mib_2m * MIB),
        "64KiB": Case("64KiB", 64 * KIB, args.total_mib_64k * MIB, args.cpu_mib_64k * MIB),
    }
    chosen = [c.strip() for c in args.cases.split(",") if c.strip()]
    unknown = [c for c in chosen if c not in known]
    if unknown:
        sys.exit(f"unknown case(s) {unknown}; known: {list(known)}")
    for name in chosen:
        case = known[name]
        chunks = case.cpu_bytes // case.block_bytes
        if chunks < 2 * args.concurrency * args.req_blocks:
            # Fewer and every request's prepare_store waits for cascades to unpin
            # chunks (or never fits at all): the run would measure that, not the tier.
            sys.exit(
                f"{name}: the CPU tier holds {chunks} chunks; give it at least "
                f"2 x {args.concurrency} x {args.req_blocks} (--cpu-mib-*)"
            )
    return [known[c] for c in chosen]


# -- the workload --------------------------------------------------------------------------


class Workload:
    """Prompts (chained keys) and the bytes of each block: a base pattern plus a per-page tag."""

    def __init__(self, case: Case, req_blocks: int, salt: str) -> None:
        import numpy as np

        from tiering.integrations.vllm.driver import chained_keys

        self.np = np
        count = max(1, case.total_bytes // case.block_bytes // req_blocks)
        self.prompts = [chained_keys(f"{salt}-{i}", req_blocks) for i in range(count)]
        self.base = np.random.default_rng(1).integers(
            0, 2**63, size=case.block_bytes // 8, dtype=np.uint64
        )
        self.tags = {
            k: int.from_bytes(hashlib.blake2b(k, digest_size=8).digest(), "little") | 1
            for p in self.prompts
            for k in p
        }

    def fill(self, key: bytes, row64: Any) -> None:
        row64[:] = self.base
        row64[::PAGE_WORDS] ^= self.np.uint64(self.tags[key])

    def check(self, key: bytes, row64: Any) -> bool:
        np = self.np
        tag = np.uint64(self.tags[key])
        return bool(np.all((row64[::PAGE_WORDS] ^ self.base[::PAGE_WORDS]) == tag))


@dataclass
class PhaseResult:
    bytes_moved: int
    window_s: float
    tier_seconds: float
    tier_calls: int
    steps: int
    blocks: int
    failed_jobs: int
    ok_blocks: int = 0
    bad_blocks: int = 0
    missed_blocks: int = 0
    extra: dict[str, float] = field(default_factory=dict)

    @property
    def gbps(self) -> float:
        return self.bytes_moved / self.window_s / 1e9 if self.window_s > 0 else float("nan")

    @property
    def us_per_block(self) -> float:
        return self.tier_seconds / max(1, self.blocks) * 1e6

    @property
    def us_per_step(self) -> float:
        return self.tier_seconds / max(1, self.steps) * 1e6


class Bench:
    """One run: one manager, one tier, store -> evict -> load."""

    def __init__(self, manager: Any, workload: Workload, args: argparse.Namespace) -> None:
        from vllm.v1.kv_offload.base import LookupResult, ReqContext, ScheduleEndContext

        self.m = manager
        self.w = workload
        self.args = args
        self.LookupResult = LookupResult
        self.ReqContext = ReqContext
        self.ScheduleEndContext = ScheduleEndContext
        import numpy as np

        self.rows64 = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint64)
        self.tap = TierTap()
        self.tap.install(manager.secondary_tiers[0])
        self.steps = 0
        self.block_bytes = self.rows64.shape[1] * 8

    def _end_step(self, new_ids: list[str]) -> None:
        self.steps += 1
        self.m.on_schedule_end(
            self.ScheduleEndContext(new_req_ids=tuple(new_ids), preempted_req_ids=())
        )

    def _prefix(self, keys: list[bytes], ctx: Any) -> tuple[int, bool]:
        hits, pending = 0, False
        for key in keys:
            r = self.m.lookup(key, ctx)
            if r is self.LookupResult.MISS:
                return hits, pending
            pending |= r is not self.LookupResult.HIT
            hits += 1
        return hits, pending

    def _run(self, name: str, on_ready: Callable[[list[bytes], Any, int], bool]) -> None:
        """Admit prompts ``concurrency`` at a time; ``on_ready`` finishes one (True when done)."""
        pending = deque(self.w.prompts)
        active: dict[str, tuple[list[bytes], Any]] = {}
        idle = self.args.idle_sleep_ms / 1e3
        while True:
            with self.m.lock:
                if not pending and not active and not self.m.has_pending_work():
                    return
                new_ids: list[str] = []
                progressed = False
                while pending and len(active) < self.args.concurrency:
                    keys = pending.popleft()
                    ctx = self.ReqContext(req_id=f"{name}-{len(pending)}")
                    self.m.on_new_request(ctx)
                    active[ctx.req_id] = (keys, ctx)
                    new_ids.append(ctx.req_id)
                for req_id, (keys, ctx) in list(active.items()):
                    hits, waiting = self._prefix(keys, ctx)
                    if waiting:
                        continue
                    if on_ready(keys, ctx, hits):
                        self.m.on_request_finished(ctx)
                        del active[req_id]
                        progressed = True
                self._end_step(new_ids)
            if not progressed:
                time.sleep(idle)

    def store(self) -> PhaseResult:
        self.tap.reset()
        steps0 = self.steps

        def on_ready(keys: list[bytes], ctx: Any, hits: int) -> bool:
            out = self.m.prepare_store(keys, ctx)
            if out is None:
                return False  # CPU tier full of pinned chunks: retry next step
            for key, row in zip(out.keys_to_store, out.store_spec.block_ids, strict=True):
                self.w.fill(key, self.rows64[int(row)])
            if out.keys_to_store:
                self.m.complete_store(out.keys_to_store, ctx)
            return True

        self._run("store", on_ready)
        blocks = sum(len(p) for p in self.w.prompts)
        return PhaseResult(
            bytes_moved=blocks * self.block_bytes,
            window_s=self.tap.window(),
            tier_seconds=self.tap.seconds,
            tier_calls=self.tap.calls,
            steps=self.steps - steps0,
            blocks=blocks,
            failed_jobs=self.tap.failed,
        )

    def evict(self) -> None:
        from tiering.integrations.vllm.driver import chained_keys

        num = self.rows64.shape[0]
        with self.m.lock:
            ctx = self.ReqContext(req_id="filler")
            self.m.on_new_request(ctx)
            out = self.m.prepare_store(chained_keys(f"filler-{time.time_ns()}", num), ctx)
            assert out is not None, "eviction failed: CPU chunks still pinned"
            self.m.complete_store(out.keys_to_store, ctx, success=False)
            self.m.on_request_finished(ctx)
            self._end_step([ctx.req_id])
        self.rows64[:] = 0xEEEEEEEEEEEEEEEE

    def load(self) -> PhaseResult:
        self.tap.reset()
        steps0 = self.steps
        counts = {"ok": 0, "bad": 0, "miss": 0}

        def on_ready(keys: list[bytes], ctx: Any, hits: int) -> bool:
            counts["miss"] += len(keys) - hits
            found = keys[:hits]
            if found:
                spec = self.m.prepare_load(found, ctx)
                for key, row in zip(found, spec.block_ids, strict=True):
                    counts["ok" if self.w.check(key, self.rows64[int(row)]) else "bad"] += 1
                self.m.complete_load(found, ctx)
            return True

        self._run("load", on_ready)
        blocks = sum(len(p) for p in self.w.prompts)
        return PhaseResult(
            bytes_moved=counts["ok"] * self.block_bytes,
            window_s=self.tap.window(),
            tier_seconds=self.tap.seconds,
            tier_calls=self.tap.calls,
            steps=self.steps - steps0,
            blocks=blocks,
            failed_jobs=self.tap.failed,
            ok_blocks=counts["ok"],
            bad_blocks=counts["bad"],
            missed_blocks=counts["miss"],
        )

    def close(self) -> None:
        self.rows64 = None
        gc.collect()
        self.m.shutdown()


# -- runs ------------------------------------------------------------------------------------


def tier_entry(tier: str, root: str, case: Case) -> dict[str, Any]:
    if tier == "vllm-fs":
        return {"type": "fs", "root_dir": root}
    return {
        "type": "KVTieringFileSystemTier",
        "module_path": "tiering.integrations.vllm",
        "root_dir": root,
        "capacity_bytes": int(case.total_bytes * 1.25) + 64 * MIB,
        "io_backend": tier.removeprefix("ours-"),  # ours-uring / ours-threads
    }


def our_tiers() -> list[str]:
    """Our tier once per I/O backend this machine can run (the reason printed for the rest)."""
    from tiers.fs.io import uring_unavailable_reason

    reason = uring_unavailable_reason()
    if reason is not None:
        print(f"# our io_uring backend is not usable here ({reason}): threads only", flush=True)
        return ["ours-threads"]
    return ["ours-uring", "ours-threads"]


def one_run(case: Case, tier: str, args: argparse.Namespace, run: int) -> dict[str, Any]:
    from tiering.integrations.vllm.driver import build_manager, offloading_config

    root = tempfile.mkdtemp(prefix=f"vllm-tiers-{tier}-", dir=args.root_parent)
    try:
        config = offloading_config(
            [tier_entry(tier, root, case)],
            block_bytes=case.block_bytes,
            num_chunks=case.cpu_bytes // case.block_bytes,
            model=f"bench/{case.name}",
        )
        bench = Bench(build_manager(config), Workload(case, args.req_blocks, f"r{run}"), args)
        try:
            store = bench.store()
            bench.evict()
            load = bench.load()
        finally:
            bench.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return {"store": store, "load": load}


def fio_ceiling(case: Case, args: argparse.Namespace) -> dict[str, float]:
    """The disk's O_DIRECT ceiling for this block size (fio, io_uring, queue depth 32), GB/s.

    Sequential writes then reads of the same volume in one preallocated file in
    the same directory as the tiers' roots. Empty when fio is not installed.
    """
    if shutil.which("fio") is None:
        return {}
    directory = tempfile.mkdtemp(prefix="vllm-tiers-fio-", dir=args.root_parent)
    path = os.path.join(directory, "ceiling")
    figures: dict[str, float] = {}
    try:
        for phase, rw in (("store", "write"), ("load", "read")):
            done = subprocess.run(
                [
                    "fio",
                    "--name=ceiling",
                    f"--filename={path}",
                    f"--rw={rw}",
                    f"--bs={case.block_bytes}",
                    f"--size={case.total_bytes}",
                    "--direct=1",
                    "--ioengine=io_uring",
                    "--iodepth=32",
                    "--output-format=json",
                ],
                capture_output=True,
                text=True,
                check=False,
            )
            if done.returncode != 0:
                return {}
            job = json.loads(done.stdout)["jobs"][0]
            side = job[rw]
            figures[phase] = side["io_bytes"] / (job["job_runtime"] / 1000) / 1e9
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    return figures


def median(xs: list[float]) -> float:
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


def main() -> int:
    if importlib.util.find_spec("vllm") is None:
        reexec_in_vllm_env()
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    sys.path.insert(0, str(REPO))
    from tests.vllm.conftest import preload_fsio_stubs

    fast_path = preload_fsio_stubs()
    import vllm
    from vllm.v1.kv_offload.tiering.fs import io as vllm_fs_io

    args = parse_args()
    from tiering.native_probe import describe_cpu

    print(f"# CPU: {describe_cpu()}")
    ours = our_tiers()
    tiers = ["vllm-fs", *ours]
    print(
        f"# vLLM {vllm.__version__} tiering, vLLM fs C fast path: "
        f"{'yes' if fast_path and vllm_fs_io._HAS_FSIO_C else 'NO (pure Python)'}; "
        f"{args.runs} run(s), {args.concurrency} requests x {args.req_blocks} blocks in flight; "
        "machine shared and noisy: compare ratios"
    )
    results: dict[tuple[str, str], list[dict[str, Any]]] = {}
    ceilings: dict[str, list[dict[str, float]]] = {}
    correct = True
    for case in cases(args):
        for run in range(args.runs):
            ceiling = fio_ceiling(case, args)
            ceilings.setdefault(case.name, []).append(ceiling)
            if ceiling:
                print(
                    f"  [{case.name} fio run{run}] store {ceiling['store']:.2f} GB/s "
                    f"load {ceiling['load']:.2f} GB/s (disk ceiling, O_DIRECT qd32)",
                    flush=True,
                )
            order = tiers if run % 2 == 0 else tiers[::-1]
            for tier in order:
                r = one_run(case, tier, args, run)
                results.setdefault((case.name, tier), []).append(r)
                s, ld = r["store"], r["load"]
                correct &= ld.bad_blocks == 0 and ld.missed_blocks == 0 and s.failed_jobs == 0
                print(
                    f"  [{case.name} {tier} run{run}] store {s.gbps:.2f} GB/s "
                    f"load {ld.gbps:.2f} GB/s  tier-call us/block {s.us_per_block:.1f}/"
                    f"{ld.us_per_block:.1f}  ok={ld.ok_blocks} bad={ld.bad_blocks} "
                    f"missed={ld.missed_blocks} failed_jobs={s.failed_jobs + ld.failed_jobs}",
                    flush=True,
                )

    header = (
        f"{'case':<6} {'tier':<12} {'store GB/s':>10} {'load GB/s':>9} "
        f"{'store us/blk':>12} {'load us/blk':>11} {'store us/step':>13} {'load us/step':>12}"
    )
    print()
    print(header)
    print("-" * len(header))
    summary: dict[tuple[str, str], dict[str, float]] = {}
    for (case_name, tier), runs in results.items():
        row = {
            "store": median([r["store"].gbps for r in runs]),
            "load": median([r["load"].gbps for r in runs]),
            "s_blk": median([r["store"].us_per_block for r in runs]),
            "l_blk": median([r["load"].us_per_block for r in runs]),
            "s_step": median([r["store"].us_per_step for r in runs]),
            "l_step": median([r["load"].us_per_step for r in runs]),
        }
        summary[(case_name, tier)] = row
        print(
            f"{case_name:<6} {tier:<12} {row['store']:>10.2f} {row['load']:>9.2f} "
            f"{row['s_blk']:>12.1f} {row['l_blk']:>11.1f} {row['s_step']:>13.1f} "
            f"{row['l_step']:>12.1f}"
        )
    print()
    print(
        f"{'case':<6} {'ours':<12} {'store x':>8} {'load x':>7} "
        f"{'sched-time/blk x (store/load)':>30}  target"
    )
    for case in cases(args):
        theirs = summary.get((case.name, "vllm-fs"))
        for tier in ours:
            mine = summary.get((case.name, tier))
            if not theirs or not mine:
                continue
            target = 1.0 if case.name == "2MiB" else 3.0
            print(
                f"{case.name:<6} {tier:<12} {mine['store'] / theirs['store']:>8.2f} "
                f"{mine['load'] / theirs['load']:>7.2f} "
                f"{mine['s_blk'] / theirs['s_blk']:>14.2f} / "
                f"{mine['l_blk'] / theirs['l_blk']:<13.2f}"
                f"  >= {target:.1f}x GB/s (or the disk's ceiling), <= 1.0x time"
            )
    print()
    print(f"{'case':<6} {'fio store':>9} {'fio load':>8}  of the disk's ceiling, store / load")
    for case in cases(args):
        figs = [c for c in ceilings.get(case.name, []) if c]
        if not figs:
            continue
        store_c = median([c["store"] for c in figs])
        load_c = median([c["load"] for c in figs])
        shares = []
        for tier in tiers:
            row = summary.get((case.name, tier))
            if row:
                shares.append(f"{tier} {row['store'] / store_c:.0%} / {row['load'] / load_c:.0%}")
        print(f"{case.name:<6} {store_c:>9.2f} {load_c:>8.2f}  " + ", ".join(shares))
    print(f"# CORRECTNESS: {'PASS' if correct else 'FAIL'} (every block checked after promotion)")
    return 0 if correct else 1


if __name__ == "__main__":
    sys.exit(main())
