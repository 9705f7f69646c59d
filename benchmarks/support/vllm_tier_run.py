"""One run of ``benchmarks/vllm_tiers.py``: a tier inside vLLM's manager, store, evict, load.

Owns the :class:`Case` sizes, :class:`TierTap` (times every scheduler-thread call
vLLM's manager makes into the tier and records the window from the first submitted
job to the last collected result), the :class:`Workload` (chained prompt keys and
per-page tagged block bytes, so every promoted block is checked) and :class:`Bench`,
which drives vLLM's ``TieringOffloadingManager`` through its scheduler-facing API
only. Runs in the environment ``scripts/vllm_env.sh`` builds (vLLM imported lazily).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

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

        self.rows64: Any = np.asarray(manager.primary_tier.get_kv_memoryview()).view(np.uint64)
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
        return self._result(steps0, sum(len(p) for p in self.w.prompts))

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
        result = self._result(steps0, counts["ok"])
        result.ok_blocks, result.bad_blocks = counts["ok"], counts["bad"]
        result.missed_blocks = counts["miss"]
        return result

    def _result(self, steps0: int, blocks_moved: int) -> PhaseResult:
        """The phase since step ``steps0``, as the tap saw it."""
        return PhaseResult(
            bytes_moved=blocks_moved * self.block_bytes,
            window_s=self.tap.window(),
            tier_seconds=self.tap.seconds,
            tier_calls=self.tap.calls,
            steps=self.steps - steps0,
            blocks=sum(len(p) for p in self.w.prompts),
            failed_jobs=self.tap.failed,
        )

    def close(self) -> None:
        self.rows64 = None  # a live view would keep the shared memory from closing
        gc.collect()
        self.m.shutdown()
