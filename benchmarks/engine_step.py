"""Scheduler step time while each tier serves a realistic job mix, against steps alone, in one run.

    .venv/bin/python benchmarks/engine_step.py            # every tier, ~1 minute
    .venv/bin/python benchmarks/engine_step.py --quick    # smaller counts
    .venv/bin/python benchmarks/engine_step.py --tiers memory fs-threads
    .venv/bin/python benchmarks/engine_step.py --forward-ms 2 --pin both  # GPU waits; pinning
    .venv/bin/python benchmarks/engine_step.py --forward-ms 2 --gil-hold-ms 1 off

The main thread plays an inference engine's scheduler thread. Each step it
runs a fixed pure-Python ``schedule()`` shaped like vLLM's v1 scheduler at a
realistic batch (``--running`` decoding requests, chunked prefill of waiting
ones under a token budget, block allocation from a free queue, prefix-cache
hash lookups, the per-request output dicts, then ``update_from_output``),
and then does what the offloading connector does with a secondary tier
through the real facade (:class:`~tiering.runtime.AsyncTierManager`): prefix
lookups, store (cascade) and load (promotion) jobs kept at ``--in-flight``
jobs per tier (the tier flat out), and ``get_finished``. ``--forward-ms``
adds a GIL-free wait after each step, as a real engine waits for the GPU's
forward pass (default 0: the scheduler thread never rests, the worst case).

For each tier (``memory``, ``fs-threads``, ``fs-uring``, ``redis`` on
loopback with a redis-server started here) the steps run alone and with the
tier, in alternating rounds, and the table reports the ``schedule()`` time
p50/p99 against the alone rounds (targets: p50 <= 1.10x, p99 <= 1.25x,
printed as met/missed), the whole step's wall time (facade calls included),
with ``--forward-ms`` the *wake* latency (how late the scheduler thread got
going after each forward wait: the sleep's overrun, which includes waiting for
the GIL while a tier's thread holds it; ``docs/runtime.md``, "The GIL"), the
tier's blocks/s and the CPU time per block of what runs it (its event-loop
thread; for a tier in a child process, that whole process). Each tier runs
twice by default (``--isolation both``): behind the default facade, its loop
thread in this process, and behind :class:`~tiering.isolation.IsolatedTierManager`,
in a child process attached to the same shared-memory primary rows. A tier that
cannot run here (io_uring unavailable, no redis-server) is skipped with the
reason. ``--pin on|both`` also runs rows with the scheduler thread on one CPU
and the tier on the others (the runtime's ``cpus`` option; ``docs/runtime.md``,
"Pinning"), and ``--gil-hold-ms 1 0.25 off`` a row per value of the runtime's
``max_gil_hold_ms`` (``off``: no GIL hand-offs), and ``--gc-handoff on
off`` a row per value of the runtime's ``gc_handoff`` (``off``: the
collections the tier's allocations call for run wherever CPython starts
them, most often in a scheduler step; ``docs/runtime.md``, "Garbage
collections"); the "GC steps" column counts the steps in which the scheduler
thread ran a collection. Three columns say where a slower step's time went:
"step CPU p50/p99" is the scheduler thread's own CPU time per ``schedule()``
against the alone rounds (a step that ran slower because the machine is
busy: caches and memory shared with the tier's CPU), "waited" the share of
steps in which that thread blocked (a voluntary context switch: waiting for
the GIL or anything else) and "preempted" the share in which the kernel put
another thread on its CPU (an involuntary one). A p50/p99 ratio with the CPU
ratio beside it and no waited or preempted steps is the shared hardware, the
class of the ``copy`` control, not the tier's GIL. "alone A/A" on each alone
row is the noise floor: the alone rounds' even half against their odd half
(identical steps), and a line under the table gives its range over the run's
rows; a tier's ratio inside that range is not told apart from the noise.
"paired p50 ratio" is the median over rounds of a round's p50 over that of
the alone round just before it (on an alone row, alone round against alone
round: the A/A of this estimator), which a drift of the machine slower than a
round does not move; the verdicts stay on the pooled ratios.
Control rows come first
(``--controls spin copy scatter hash disk``, the default): the same steps beside
another process on the other CPU that does no tiering (a pure-Python loop; numpy
copying 64 MiB over and over; random 256 KiB regions copied as a tier copies its
blocks; random 256 KiB regions checksummed and evicted from the caches as a tier
checksums its blocks; random 256 KiB O_DIRECT reads and writes of a file, the fs
tier's disk traffic), the machine's own floor under the tier rows. Figures of a
shared machine are noisy: compare within one run. The note under the table gives,
for a tier on a loop thread, how often the kernel preempted that thread beside the
steps (another thread or process put on its CPU, often while it held the GIL);
``--server-nice 10`` starts the redis rows' redis-server at a lower priority.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import gc
import heapq
import logging
import os
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tiering.host_buffer import HostBuffer, make_shared_name
from tiering.isolation import IsolatedTierManager
from tiering.jobs import JobMetadata
from tiering.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.runtime import AsyncTierManager
from tiering.runtime.affinity import allowed_cpus, format_cpu_list
from tiering.runtime.facade import DEFAULT_MAX_GIL_HOLD_MS

KIB = 1024
MIB = 1024 * KIB
TIERS = ("memory", "fs-threads", "fs-uring", "redis")
#: Control rows: another process busy on the other CPU, doing no tiering at all.
#: What any tier that keeps a CPU busy costs the scheduler on this machine (the
#: floor under the tier rows): ``spin`` keeps a core busy with a pure-Python loop
#: (the core's scheduling and frequency, no memory traffic), ``copy`` copies 64 MiB
#: over and over with numpy (memory bandwidth and the shared cache, as a tier
#: moving bytes at full speed does), ``scatter`` copies 16 regions of 256 KiB at
#: random places of a 64 MiB pool into a 256 MiB one per call, through the
#: library's own bulk copy (the access pattern of a tier's blocks), ``hash`` takes
#: the xxh3-128 of random 256 KiB regions of a 256 MiB pool and evicts each from
#: the caches once hashed (what the tiers do with every block's checksum,
#: :mod:`tiering.copy.caches`), ``disk`` has 8
#: threads read and write random 256 KiB blocks of a 1 GiB file in the scratch
#: directory with O_DIRECT (the disk traffic of the fs tier, without the tier). Each
#: counts the bytes it moved and prints the count when stopped with SIGTERM; each
#: gets the scratch directory as its first argument.
_NEIGHBOUR_COUNTS = (
    "import signal, sys\n"
    "moved = 0\n"
    "def report(*_):\n"
    "    print(moved, flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, report)\n"
)
NEIGHBOURS = {
    "spin": _NEIGHBOUR_COUNTS + "x = 0\nwhile True:\n    x += 1\n",
    "copy": _NEIGHBOUR_COUNTS
    + (
        "import numpy as np\n"
        "a = np.ones(64 << 20, np.uint8)\n"
        "b = np.empty_like(a)\n"
        "while True:\n"
        "    np.copyto(b, a)\n"
        "    moved += a.nbytes\n"
    ),
    "scatter": _NEIGHBOUR_COUNTS
    + (
        "import numpy as np\n"
        "from tiering.copy.bulk import copy_regions\n"
        "from tiering.mappings import private_anonymous\n"
        "region = 256 << 10\n"
        "pools = [np.frombuffer(private_anonymous(n << 20), np.uint8) for n in (64, 256)]\n"
        "for pool in pools:\n"
        "    pool[:] = 1\n"
        "src, dst = (int(pool.ctypes.data) for pool in pools)\n"
        "rng = np.random.default_rng(0)\n"
        "while True:\n"
        "    copy_regions(src + rng.integers(0, 256, 16) * region,\n"
        "                 dst + rng.integers(0, 1024, 16) * region, region)\n"
        "    moved += 16 * region\n"
    ),
    "hash": _NEIGHBOUR_COUNTS
    + (
        "import random, numpy as np, xxhash\n"
        "from tiering.copy.caches import evict_block\n"
        "region = 256 << 10\n"
        "pool = memoryview(np.ones(256 << 20, np.uint8))\n"
        "rng = random.Random(0)\n"
        "while True:\n"
        "    at = rng.randrange(1024) * region\n"
        "    block = pool[at:at + region]\n"
        "    xxhash.xxh3_128_intdigest(block)\n"
        "    evict_block(block)\n"
        "    moved += region\n"
    ),
    "disk": _NEIGHBOUR_COUNTS
    + (
        "import mmap, os, random, threading, time\n"
        "path, size, block = os.path.join(sys.argv[1], 'disk-control'), 1 << 30, 256 << 10\n"
        "try:\n"
        "    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)\n"
        "except OSError as exc:\n"
        "    sys.exit(f'O_DIRECT unavailable in {sys.argv[1]}: {exc}')\n"
        "os.unlink(path)\n"
        "os.ftruncate(fd, size)\n"
        "counted = threading.Lock()\n"
        "def work(seed):\n"
        "    global moved\n"
        "    buffer, rng = mmap.mmap(-1, block), random.Random(seed)\n"
        "    buffer.write(bytes([seed]) * block)\n"
        "    for n in iter(int, 1):\n"
        "        offset = rng.randrange(size // block) * block\n"
        "        (os.preadv if n % 2 else os.pwritev)(fd, [buffer], offset)\n"
        "        with counted:\n"
        "            moved += block\n"
        "for seed in range(8):\n"
        "    threading.Thread(target=work, args=(seed,), daemon=True).start()\n"
        "while True:\n"
        "    time.sleep(1)\n"
    ),
}
NEIGHBOUR_WORK = {
    "spin": "a pure-Python loop",
    "copy": "numpy copying 64 MiB in a loop",
    "scatter": "the native bulk copy of 16 random 256 KiB regions in a loop",
    "hash": "xxh3-128 of random 256 KiB regions, each evicted from the caches once hashed",
    "disk": "8 threads reading and writing random 256 KiB blocks of a file with O_DIRECT",
}
P50_TARGET = 1.10
P99_TARGET = 1.25


# -- the scheduler's own work ------------------------------------------------------------------


@dataclass(slots=True)
class Request:
    """The part of vLLM's ``Request`` that ``schedule()`` reads and writes."""

    req_id: str
    prompt_tokens: int
    max_tokens: int
    priority: int
    arrival: float
    num_computed: int = 0
    output_tokens: list[int] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return self.prompt_tokens + len(self.output_tokens)


class ToyScheduler:
    """A deterministic stand-in for vLLM's ``Scheduler.schedule`` + ``update_from_output``.

    Pure Python, the same data-structure traffic per request as the real one
    (no numpy, no I/O), so its time measures only the interpreter and the GIL.
    """

    def __init__(
        self, running: int, token_budget: int = 8192, block_size: int = 16, seed: int = 0
    ) -> None:
        self.block_size = block_size
        self.token_budget = token_budget
        self.target_running = running
        self.free_blocks: deque[int] = deque(range(running * 256))
        self.prefix_cache: dict[int, int] = {}
        self.running: list[Request] = []
        self.waiting: list[tuple[int, float, int, Request]] = []
        self.next_id = 0
        self.rng_state = seed * 2654435761 + 1
        self.step_index = 0
        self.last_output: dict[str, object] = {}
        for _ in range(running):
            self._admit_new()
        while self.waiting:  # start in steady state: everyone decoding
            _, _, _, req = heapq.heappop(self.waiting)
            req.num_computed = req.prompt_tokens
            self._allocate(req, req.prompt_tokens)
            self.running.append(req)

    def _rand(self, bound: int) -> int:
        self.rng_state = (self.rng_state * 6364136223846793005 + 1442695040888963407) % (1 << 64)
        return (self.rng_state >> 33) % bound

    def _admit_new(self) -> None:
        self.next_id += 1
        req = Request(
            req_id=f"req-{self.next_id}",
            prompt_tokens=64 + self._rand(2000),
            max_tokens=16 + self._rand(400),
            priority=self._rand(4),
            arrival=float(self.next_id),
        )
        req.block_hashes = [
            hash((req.prompt_tokens, i)) for i in range(req.prompt_tokens // self.block_size)
        ]
        heapq.heappush(self.waiting, (req.priority, req.arrival, self.next_id, req))

    def _allocate(self, req: Request, new_tokens: int) -> list[int] | None:
        need = -(-(req.num_computed + new_tokens) // self.block_size) - len(req.block_ids)
        if need > len(self.free_blocks):
            return None
        fresh = [self.free_blocks.popleft() for _ in range(max(0, need))]
        req.block_ids.extend(fresh)
        return fresh

    def step(self) -> int:
        """One ``schedule()`` and its ``update_from_output``; returns the tokens scheduled."""
        budget = self.token_budget
        scheduled: dict[str, int] = {}
        new_blocks: dict[str, list[int]] = {}
        preempted: list[Request] = []
        # 1. Running requests first (decode, or the rest of a chunked prefill).
        for req in self.running:
            if budget <= 0:
                break
            num_new = min(req.num_tokens - req.num_computed, budget) or 1
            blocks = self._allocate(req, num_new)
            if blocks is None:
                preempted.append(req)
                continue
            scheduled[req.req_id] = num_new
            new_blocks[req.req_id] = blocks
            budget -= num_new
        # 2. Waiting requests by priority: prefix-cache hits, then a chunk of prefill.
        admitted: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.target_running:
            _, _, _, req = heapq.heappop(self.waiting)
            hits = 0
            for h in req.block_hashes:
                if self.prefix_cache.get(h) is None:
                    break
                hits += 1
            req.num_computed = hits * self.block_size
            num_new = min(req.num_tokens - req.num_computed, budget)
            blocks = self._allocate(req, num_new)
            if blocks is None:
                heapq.heappush(self.waiting, (req.priority, req.arrival, self.next_id, req))
                break
            scheduled[req.req_id] = num_new
            new_blocks[req.req_id] = blocks
            budget -= num_new
            admitted.append(req)
        self.running.extend(admitted)
        total = sum(scheduled.values())
        # What vLLM hands to the model runner; kept until the next step, as the engine does.
        self.last_output = {
            "scheduled_new_reqs": [r.req_id for r in admitted],
            "num_scheduled_tokens": scheduled,
            "new_block_ids": new_blocks,
            "total": total,
            "preempted": [r.req_id for r in preempted],
        }
        # 3. update_from_output: sampled tokens, finished requests free their blocks.
        still: list[Request] = []
        for req in self.running:
            n = scheduled.get(req.req_id)
            if n is None:
                still.append(req)
                continue
            req.num_computed += n
            if req.num_computed >= req.prompt_tokens:
                req.output_tokens.append(self._rand(32000))
                full = req.num_computed // self.block_size
                for i in range(max(0, full - 1), min(full, len(req.block_hashes))):
                    self.prefix_cache[req.block_hashes[i]] = req.block_ids[i]
            if len(req.output_tokens) >= req.max_tokens:
                self.free_blocks.extend(req.block_ids)
                self._admit_new()
            else:
                still.append(req)
        for req in preempted:  # recompute later, as vLLM's recompute preemption does
            self.free_blocks.extend(req.block_ids)
            req.block_ids, req.num_computed = [], 0
            heapq.heappush(self.waiting, (req.priority, req.arrival, self.next_id, req))
        self.running = [r for r in still if r not in preempted]
        if len(self.prefix_cache) > 200_000:
            self.prefix_cache.clear()
        self.step_index += 1
        return total


# -- the tiers ---------------------------------------------------------------------------------


class Skip(Exception):
    """This tier cannot run on this machine (the message says why)."""


@dataclass
class Rig:
    manager: AsyncTierManager
    description: str
    primary: np.ndarray[Any, np.dtype[np.uint8]]
    tier_cpu: Callable[[], float]  # CPU seconds of what runs the tier (loop thread or process)
    #: Involuntary context switches of the tier's loop thread so far (None: a child process).
    loop_preemptions: Callable[[], int] | None = None


@contextlib.contextmanager
def open_tier(
    kind: str,
    args: argparse.Namespace,
    scratch: Path,
    placement: str = "thread",
    tier_cpus: frozenset[int] | None = None,
    gil_hold_ms: float | None = DEFAULT_MAX_GIL_HOLD_MS,
    gc_handoff: bool = True,
) -> Iterator[Rig]:
    """The tier ``kind`` behind a facade over fresh primary rows (a context).

    ``placement``: ``thread`` (the default facade, a loop thread in this
    process) or ``process`` (:class:`~tiering.isolation.IsolatedTierManager`);
    ``tier_cpus``: the runtime's ``cpus`` option (redis-server is put there too);
    ``gil_hold_ms``: the runtime's ``max_gil_hold_ms`` (``None``: no GIL hand-offs);
    ``gc_handoff``: the runtime's option of that name.
    """
    block = args.block_kib * KIB
    rows = args.in_flight * args.blocks_per_job
    # Named shared memory, page-aligned: the real primary tier's buffer (O_DIRECT-able,
    # attachable by an isolated tier's process).
    host = HostBuffer.create(rows, block, shared_name=make_shared_name("engine-step"))
    primary = host.as_numpy()
    primary[:] = np.random.default_rng(1).integers(0, 256, primary.shape, dtype=np.uint8)
    capacity_blocks = max(4 * rows, (args.tier_mib * MIB) // block)
    factory: Callable[[], Any]
    server: Any = None
    description = ""
    try:
        if kind == "memory":
            from tiers.memory import MemoryTier

            factory = functools.partial(MemoryTier, capacity_blocks=capacity_blocks)
            description = f"memory, {capacity_blocks} blocks"
        elif kind.startswith("fs-"):
            backend = kind.removeprefix("fs-")
            if backend == "uring":
                from tiers.fs.io import uring_unavailable_reason

                reason = uring_unavailable_reason()
                if reason:
                    raise Skip(f"io_uring unavailable: {reason}")
            from tiers.fs import FileSystemTier

            root = scratch / kind
            root.mkdir(parents=True, exist_ok=True)
            factory = functools.partial(
                FileSystemTier,
                root_dir=root,
                capacity_bytes=capacity_blocks * block,
                io_backend=backend,
            )
            description = f"fs, io_backend={backend}"
        elif kind == "redis":
            if shutil.which("redis-server") is None:
                raise Skip("redis-server is not installed (apt-get install redis-server)")
            from tests.support.redis_server import RedisServer
            from tiers.redis import RedisTier

            server = RedisServer(scratch / "redis").start()
            factory = functools.partial(RedisTier, url=server.url, namespace="engine-step")
            description = f"redis on loopback ({server.url})"
            if args.server_nice:
                # Every thread: Linux nice values are per thread.
                for tid in os.listdir(f"/proc/{server.process.pid}/task"):
                    os.setpriority(os.PRIO_PROCESS, int(tid), args.server_nice)
                description += f", redis-server at nice {args.server_nice}"
        else:
            raise Skip(f"unknown tier {kind!r}; choose from {', '.join(TIERS)}")
        options: dict[str, Any] = {
            "job_timeout_s": 120.0,
            "layout_fingerprint": f"engine-step-{block}",
            "cpus": tier_cpus,
            "max_gil_hold_ms": gil_hold_ms,
        }
        if server is not None and tier_cpus is not None:
            pin_process(server.process.pid, tier_cpus)  # it serves the tier: its CPUs
        manager: AsyncTierManager
        if placement == "process":
            isolated = IsolatedTierManager(factory, host, kind, gc_handoff=gc_handoff, **options)
            manager, tier_cpu = isolated, process_cpu(isolated.pid)
            preemptions = None
            description += "; in a child process"
        else:
            manager = AsyncTierManager(factory(), host.view, kind, gc_handoff=gc_handoff, **options)
            tier_cpu = thread_cpu(manager._thread.thread)  # the tier's event-loop thread
            preemptions = thread_preemptions(manager._thread.thread)
            if kind.startswith("fs-"):
                got = manager.tier.stats.io_backend  # type: ignore[attr-defined]
                description += f" (running: {got})"
        if tier_cpus is not None:
            description += f"; tier on CPUs {format_cpu_list(tier_cpus)}, scheduler apart"
        try:
            yield Rig(manager, description, primary, tier_cpu, preemptions)
        finally:
            manager.shutdown()
    finally:
        if server is not None:
            server.stop()
        del primary
        host.close()
        host.unlink()


class JobMix:
    """What the connector asks of one tier each step, keeping ``in_flight`` jobs queued.

    Half the jobs store fresh blocks (cascades), half load blocks stored
    earlier (promotions); each in-flight job owns its own primary rows.
    ``lookups`` prefix lookups per step. Counts blocks moved and failures.
    """

    def __init__(
        self, manager: AsyncTierManager, in_flight: int, per_job: int, lookups: int
    ) -> None:
        self.manager = manager
        self.in_flight = in_flight
        self.per_job = per_job
        self.lookups = lookups
        self.free_slots = list(range(in_flight))
        self.jobs: dict[int, tuple[int, tuple[OffloadKey, ...], bool]] = {}
        self.stored: deque[tuple[OffloadKey, ...]] = deque(maxlen=256)
        self.next_job = 0
        self.next_key = 0
        self.blocks_moved = 0
        self.failures = 0
        self.store_next = True

    def _keys(self) -> tuple[OffloadKey, ...]:
        base = self.next_key
        self.next_key += self.per_job
        return tuple(
            make_offload_key((base + i).to_bytes(8, "big") + b"engine-step-key!", 0)
            for i in range(self.per_job)
        )

    def step(self) -> None:
        manager = self.manager
        for result in manager.get_finished():
            slot, keys, load = self.jobs.pop(result.job_id)
            self.free_slots.append(slot)
            if result.success:
                self.blocks_moved += len(keys)
                if not load:
                    self.stored.append(keys)
            elif not load:
                self.failures += 1
        if self.stored:
            probe = self.stored[self.next_job % len(self.stored)]
            for i in range(self.lookups):
                manager.lookup(probe[i % len(probe)], NO_CONTEXT)
        while self.free_slots:
            slot = self.free_slots.pop()
            load = not self.store_next and bool(self.stored)
            self.store_next = not self.store_next
            keys = self.stored[self.next_job % len(self.stored)] if load else self._keys()
            self.next_job += 1
            rows = np.arange(slot * self.per_job, (slot + 1) * self.per_job, dtype=np.int64)
            meta = JobMetadata(self.next_job, keys, rows, load)
            self.jobs[self.next_job] = (slot, keys, load)
            if load:
                manager.submit_load(meta)
            else:
                manager.submit_store(meta)

    def finish(self, timeout_s: float = 120.0) -> None:
        self.manager.drain(timeout_s)
        for result in self.manager.get_finished():
            slot, keys, _ = self.jobs.pop(result.job_id)
            self.free_slots.append(slot)
            if result.success:
                self.blocks_moved += len(keys)


# -- measuring -----------------------------------------------------------------------------------


def pin_process(pid: int, cpus: frozenset[int]) -> None:
    """Every thread of process ``pid`` onto ``cpus``."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(ProcessLookupError):
            os.sched_setaffinity(int(tid), cpus)


def pct(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(len(ordered) * q / 100))]


def process_cpu(pid: int | None) -> Callable[[], float]:
    """CPU seconds (user + system, all threads) of process ``pid`` so far."""
    ticks = os.sysconf("SC_CLK_TCK")

    def read() -> float:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / ticks

    return read


def thread_cpu(thread: threading.Thread) -> Callable[[], float]:
    """A reader of ``thread``'s CPU seconds (0.0 where the platform cannot tell)."""
    ident = thread.ident
    if ident is None or not hasattr(time, "pthread_getcpuclockid"):
        return lambda: 0.0
    clock = time.pthread_getcpuclockid(ident)
    return lambda: time.clock_gettime(clock)


def thread_preemptions(thread: threading.Thread) -> Callable[[], int] | None:
    """A reader of ``thread``'s involuntary context switches (None where /proc cannot tell).

    Each is a moment the kernel put another thread on the loop thread's CPU
    while it ran, often holding the GIL: a scheduler waiting for the GIL then
    waits out the other thread's time slice too.
    """
    path = f"/proc/self/task/{thread.native_id}/status"
    if thread.native_id is None or not os.path.exists(path):
        return None

    def read() -> int:
        with open(path) as status:
            for line in status:
                if line.startswith("nonvoluntary_ctxt_switches:"):
                    return int(line.split()[1])
        return 0

    return read


@dataclass
class Phase:
    schedule_s: list[float] = field(default_factory=list)
    step_s: list[float] = field(default_factory=list)
    #: How late the scheduler thread got going after each forward wait: the sleep's
    #: overrun, which includes waiting for the GIL held by a tier's thread.
    wake_s: list[float] = field(default_factory=list)
    #: Steps in which the scheduler thread ran a garbage collection.
    gc_steps: int = 0
    #: The scheduler thread's CPU time in each ``schedule()`` (empty where the platform
    #: cannot tell), and the steps in which it blocked (voluntary context switches: the GIL
    #: or anything else) or was put off its CPU (involuntary ones).
    cpu_s: list[float] = field(default_factory=list)
    waited_steps: int = 0
    preempted_steps: int = 0
    #: Where each round's steps begin in ``schedule_s`` (one ``run_steps`` call per round).
    round_starts: list[int] = field(default_factory=list)

    def rounds(self) -> list[list[float]]:
        """The ``schedule()`` times of each round, in order."""
        ends = [*self.round_starts[1:], len(self.schedule_s)]
        return [self.schedule_s[a:b] for a, b in zip(self.round_starts, ends, strict=True)]

    def alternate_rounds(self) -> tuple[list[float], list[float]]:
        """The ``schedule()`` times of the even rounds and of the odd ones."""
        halves: tuple[list[float], list[float]] = ([], [])
        for i, steps in enumerate(self.rounds()):
            halves[i % 2].extend(steps)
        return halves


class SchedulerCollections:
    """Counts the garbage collections the thread that built it (the scheduler) runs, as a ``gc``
    callback while entered."""

    def __init__(self) -> None:
        self.thread = threading.get_ident()
        self.count = 0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start" and threading.get_ident() == self.thread:
            self.count += 1

    def __enter__(self) -> SchedulerCollections:
        gc.callbacks.append(self)
        return self

    def __exit__(self, *_: object) -> None:
        gc.callbacks.remove(self)


_RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def _thread_switches() -> tuple[int, int]:
    """This thread's (voluntary, involuntary) context switches so far (Linux; (0, 0) elsewhere)."""
    if _RUSAGE_THREAD is None:
        return 0, 0
    usage = resource.getrusage(_RUSAGE_THREAD)
    return usage.ru_nvcsw, usage.ru_nivcsw


#: Entered by ``main`` for the run (outside it the count stays put: steps count none).
_COLLECTIONS = SchedulerCollections()


def run_steps(
    scheduler: ToyScheduler,
    seconds: float,
    between: Callable[[], None] | None,
    into: Phase,
    forward_s: float = 0.0,
) -> None:
    """Steps back to back for ``seconds``; ``forward_s`` of GIL-free waiting after each
    (the GPU's forward pass, during which a real scheduler thread sleeps)."""
    into.round_starts.append(len(into.schedule_s))
    end = time.perf_counter() + seconds
    collections = _COLLECTIONS
    switches = _thread_switches
    while time.perf_counter() < end:
        before = collections.count
        waits0, preemptions0 = switches()
        cpu0 = time.thread_time()
        t0 = time.perf_counter()
        scheduler.step()
        t1 = time.perf_counter()
        cpu1 = time.thread_time()
        waits1, preemptions1 = switches()
        if collections.count != before:
            into.gc_steps += 1
        into.cpu_s.append(cpu1 - cpu0)
        into.waited_steps += waits1 != waits0
        into.preempted_steps += preemptions1 != preemptions0
        if between is not None:
            between()
        into.schedule_s.append(t1 - t0)
        into.step_s.append(time.perf_counter() - t0)
        if forward_s:
            slept = time.perf_counter()
            time.sleep(forward_s)
            into.wake_s.append(time.perf_counter() - slept - forward_s)


@dataclass
class TierRow:
    tier: str
    description: str
    placement: str = "thread"
    skipped: str = ""
    alone: Phase = field(default_factory=Phase)
    busy: Phase = field(default_factory=Phase)
    blocks_per_s: float = 0.0
    loop_cpu_us_per_block: float = 0.0
    #: The loop thread's involuntary context switches per second beside the steps
    #: (None: not measured, e.g. a tier in a child process).
    loop_preemptions_per_s: float | None = None
    failures: int = 0


def bench_tier(
    kind: str,
    args: argparse.Namespace,
    scratch: Path,
    placement: str,
    pinned: bool = False,
    gil_hold_ms: float | None = DEFAULT_MAX_GIL_HOLD_MS,
    gc_handoff: bool = True,
) -> TierRow:
    where = [
        w
        for w, on in (
            ("child process", placement == "process"),
            ("pinned", pinned),
            ("no GIL hand-off", gil_hold_ms is None),
            (
                f"GIL hand-off {gil_hold_ms} ms",
                gil_hold_ms not in (None, DEFAULT_MAX_GIL_HOLD_MS),
            ),
            ("no GC hand-off", not gc_handoff),
        )
        if on
    ]
    row = TierRow(f"{kind} ({', '.join(where)})" if where else kind, "", placement)
    cpus = args.cpus
    tier_cpus = frozenset(cpus[1:]) if pinned else None
    # This (the scheduler) thread only: on its CPU for a pinned row, back on all for the next.
    os.sched_setaffinity(0, {cpus[0]} if pinned else cpus)
    try:
        with open_tier(kind, args, scratch, placement, tier_cpus, gil_hold_ms, gc_handoff) as rig:
            row.description = rig.description
            scheduler = ToyScheduler(args.running)
            mix = JobMix(rig.manager, args.in_flight, args.blocks_per_job, args.lookups)
            loop_cpu = rig.tier_cpu
            run_steps(scheduler, 0.2, mix.step, Phase())  # warm up: first stores, allocations
            mix.finish()
            run_steps(scheduler, 0.2, None, Phase())
            blocks0, cpu0, busy_s = mix.blocks_moved, loop_cpu(), 0.0
            preempted, preemptions = 0, rig.loop_preemptions or (lambda: 0)
            for _ in range(args.rounds):
                slice_s, forward_s = args.seconds / args.rounds / 2, args.forward_ms / 1e3
                run_steps(scheduler, slice_s, None, row.alone, forward_s)
                t0, before = time.perf_counter(), preemptions()
                run_steps(scheduler, slice_s, mix.step, row.busy, forward_s)
                busy_s += time.perf_counter() - t0
                preempted += preemptions() - before
                mix.finish()  # between rounds: the alone steps see an idle tier
            if rig.loop_preemptions and busy_s:
                row.loop_preemptions_per_s = preempted / busy_s
            moved = mix.blocks_moved - blocks0
            row.blocks_per_s = moved / busy_s if busy_s else 0.0
            row.loop_cpu_us_per_block = (loop_cpu() - cpu0) / moved * 1e6 if moved else 0.0
            row.failures = mix.failures
    except Skip as exc:
        row.skipped = str(exc)
    return row


def bench_neighbour(
    kind: str, args: argparse.Namespace, scratch: Path, pinned: bool = False
) -> TierRow:
    """Steps alone and beside another process running ``NEIGHBOURS[kind]``, in rounds.

    The process is stopped (SIGSTOP) during the alone rounds and continued
    during the others, so both see the same machine minutes apart at most.
    """
    row = TierRow(
        f"control: a {kind} process" + (" (pinned)" if pinned else ""),
        "another process on the other CPU: " + NEIGHBOUR_WORK[kind],
        placement="control",
    )
    cpus = args.cpus
    os.sched_setaffinity(0, {cpus[0]} if pinned else cpus)
    neighbour = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOURS[kind], str(scratch)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    busy_s = 0.0
    try:
        if pinned:
            pin_process(neighbour.pid, frozenset(cpus[1:]))
        time.sleep(0.5)  # started, its arrays allocated
        if neighbour.poll() is not None:
            _, err = neighbour.communicate()
            row.skipped = err.strip().splitlines()[-1] if err.strip() else "it exited at once"
            return row
        os.kill(neighbour.pid, signal.SIGSTOP)
        scheduler = ToyScheduler(args.running)
        run_steps(scheduler, 0.2, None, Phase())
        slice_s, forward_s = args.seconds / args.rounds / 2, args.forward_ms / 1e3
        for _ in range(args.rounds):
            run_steps(scheduler, slice_s, None, row.alone, forward_s)
            started = time.perf_counter()
            os.kill(neighbour.pid, signal.SIGCONT)
            run_steps(scheduler, slice_s, None, row.busy, forward_s)
            os.kill(neighbour.pid, signal.SIGSTOP)
            busy_s += time.perf_counter() - started
        os.kill(neighbour.pid, signal.SIGTERM)
        os.kill(neighbour.pid, signal.SIGCONT)
        out, _ = neighbour.communicate(timeout=30)
        moved = int(out.split()[-1]) if out.split() else 0
        if moved:
            row.description += f", {moved / busy_s / 1e9:.1f} GB/s moved"
    finally:
        neighbour.kill()
        neighbour.wait()
    return row


def print_markdown_table(header: tuple[str, ...], lines: Sequence[tuple[str, ...]]) -> None:
    """A Markdown table, columns padded to their widest cell (pastes into notes as is)."""
    widths = [max(len(r[i]) for r in [header, *lines]) for i in range(len(header))]
    print("| " + " | ".join(h.ljust(w) for h, w in zip(header, widths, strict=True)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for line in lines:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)) + " |")


def _wall(phase: Phase) -> str:
    return f"{pct(phase.step_s, 50) * 1e6:.0f} / {pct(phase.step_s, 99) * 1e6:.0f}"


def _wake(phase: Phase) -> str:
    if not phase.wake_s:
        return "-"
    return f"{pct(phase.wake_s, 50) * 1e6:.0f} / {pct(phase.wake_s, 99) * 1e6:.0f}"


def _share(steps: int, phase: Phase) -> str:
    return f"{steps / len(phase.schedule_s):.1%}" if phase.schedule_s else "-"


def _cpu_ratio(busy: Phase, alone: Phase) -> str:
    if not alone.cpu_s or not busy.cpu_s:
        return "-"
    ratios = [(pct(busy.cpu_s, q), pct(alone.cpu_s, q)) for q in (50, 99)]
    return " / ".join(f"{b / a:.2f}x" if a else "-" for b, a in ratios)


def _alone_spread(alone: Phase) -> tuple[float, float] | None:
    """How far apart identical steps measure: the alone rounds' even half against their odd
    half, p50 and p99, each as the larger over the smaller (None under 2 rounds)."""
    even, odd = alone.alternate_rounds()
    if not even or not odd:
        return None
    spread = []
    for q in (50, 99):
        low, high = sorted((pct(even, q), pct(odd, q)))
        spread.append(high / low if low else float("inf"))
    return spread[0], spread[1]


def _paired_p50(later: list[list[float]], earlier: list[list[float]]) -> str:
    """The median over rounds of each round's p50 over the p50 of the round just before it.

    Rounds seconds apart see the same machine, so a drift slower than a round (another
    guest's burst) cancels out of each pair; pooled percentiles keep it.
    """
    medians = [(pct(a, 50), pct(b, 50)) for a, b in zip(earlier, later, strict=False) if a and b]
    ratios = [b / a for a, b in medians if a > 0]
    return f"{statistics.median(ratios):.2f}x" if ratios else "-"


def _spread_cell(alone: Phase) -> str:
    spread = _alone_spread(alone)
    return "-" if spread is None else f"{spread[0]:.2f}x / {spread[1]:.2f}x"


def _stalls(phase: Phase) -> str:
    if _RUSAGE_THREAD is None:
        return "-"
    return f"{_share(phase.waited_steps, phase)} / {_share(phase.preempted_steps, phase)}"


def report(rows: list[TierRow], args: argparse.Namespace) -> None:
    header = (
        "tier",
        "schedule p50 us",
        "p50 ratio",
        "schedule p99 us",
        "p99 ratio",
        "step wall p50/p99 us",
        "wake p50/p99 us",
        "blocks/s",
        "tier CPU us/block",
        "GC steps",
        "step CPU p50/p99",
        "waited / preempted",
        "alone A/A p50/p99",
        "paired p50 ratio",
        f"p50 <= {P50_TARGET:.2f}x",
        f"p99 <= {P99_TARGET:.2f}x",
    )
    lines: list[tuple[str, ...]] = []
    notes: list[str] = []
    for row in rows:
        if row.skipped:
            notes.append(f"- {row.tier}: skipped: {row.skipped}")
            continue
        control = row.placement == "control"
        a50, a99 = pct(row.alone.schedule_s, 50), pct(row.alone.schedule_s, 99)
        b50, b99 = pct(row.busy.schedule_s, 50), pct(row.busy.schedule_s, 99)
        r50, r99 = b50 / a50, b99 / a99
        lines.append(
            (
                f"steps alone ({row.tier} rounds)",
                f"{a50 * 1e6:.0f}",
                "1.00x",
                f"{a99 * 1e6:.0f}",
                "1.00x",
                _wall(row.alone),
                _wake(row.alone),
                "-",
                "-",
                _share(row.alone.gc_steps, row.alone),
                "1.00x / 1.00x",
                _stalls(row.alone),
                _spread_cell(row.alone),
                _paired_p50(row.alone.rounds()[1:], row.alone.rounds()[:-1]),
                "",
                "",
            )
        )
        lines.append(
            (
                row.tier,
                f"{b50 * 1e6:.0f}",
                f"{r50:.2f}x",
                f"{b99 * 1e6:.0f}",
                f"{r99:.2f}x",
                _wall(row.busy),
                _wake(row.busy),
                "-" if control else f"{row.blocks_per_s:,.0f}",
                "-" if control else f"{row.loop_cpu_us_per_block:.1f}",
                _share(row.busy.gc_steps, row.busy),
                _cpu_ratio(row.busy, row.alone),
                _stalls(row.busy),
                "",
                _paired_p50(row.busy.rounds(), row.alone.rounds()),
                "met" if r50 <= P50_TARGET else "missed",
                "met" if r99 <= P99_TARGET else "missed",
            )
        )
        if control:
            notes.append(
                f"- {row.tier}: {row.description}; {len(row.busy.schedule_s)} steps beside it, "
                f"{len(row.alone.schedule_s)} alone"
            )
            continue
        preempted = (
            ""
            if row.loop_preemptions_per_s is None
            else f"; loop thread preempted {row.loop_preemptions_per_s:,.0f} times/s"
        )
        notes.append(
            f"- {row.tier}: {row.description}; {len(row.busy.schedule_s)} steps with the tier, "
            f"{len(row.alone.schedule_s)} alone; failed store jobs: {row.failures}{preempted}"
        )
    print_markdown_table(header, lines)
    print()
    spreads = [s for row in rows if not row.skipped and (s := _alone_spread(row.alone))]
    if spreads:
        print(
            f"- alone A/A: each row's alone rounds split in two (even rounds against odd ones, "
            f"the larger over the smaller), identical steps seconds apart: "
            f"p50 {min(s[0] for s in spreads):.2f}-{max(s[0] for s in spreads):.2f}x, "
            f"p99 {min(s[1] for s in spreads):.2f}-{max(s[1] for s in spreads):.2f}x over "
            f"{len(spreads)} rows. A ratio inside that range is not told apart from the "
            f"machine's own noise in this run (each half holds half the steps, so its p99 is "
            f"the rougher estimate)."
        )
    print("\n".join(notes))


def _hold_ms(text: str) -> float | None:
    if text == "off":
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds or 'off', got {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected a positive number of ms, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.ERROR)
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0] if __doc__ else None,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--tiers", nargs="+", default=list(TIERS), choices=TIERS)
    parser.add_argument(
        "--controls",
        nargs="*",
        default=list(NEIGHBOURS),
        choices=list(NEIGHBOURS),
        help="control rows first: another process busy on the other CPU with no tier at all ("
        + "; ".join(f"{kind}: {work}" for kind, work in NEIGHBOUR_WORK.items())
        + "), the machine's floor under the tier rows (default all; none with an empty list)",
    )
    parser.add_argument("--quick", action="store_true", help="short phases (checks the script)")
    parser.add_argument("--seconds", type=float, default=8.0, help="measured seconds per tier")
    parser.add_argument(
        "--rounds",
        type=int,
        default=16,
        help="alone/with-tier alternations (default 16: a quarter of a second per phase; "
        "with 4 the alone rounds' A/A reached 1.83x, docs/runtime.md)",
    )
    parser.add_argument("--running", type=int, default=256, help="requests in the batch")
    parser.add_argument("--block-kib", type=int, default=256, help="tier block size (KiB)")
    parser.add_argument("--blocks-per-job", type=int, default=16)
    parser.add_argument("--in-flight", type=int, default=16, help="jobs kept in flight per tier")
    parser.add_argument("--lookups", type=int, default=32, help="tier lookups per step")
    parser.add_argument("--tier-mib", type=int, default=512, help="tier capacity (MiB)")
    parser.add_argument("--scratch", type=Path, default=None, help="directory for fs/redis files")
    parser.add_argument(
        "--isolation",
        choices=("thread", "process", "both"),
        default="both",
        help="where each tier runs: a loop thread in this process (the default facade), a "
        "child process (IsolatedTierManager), or both, one after the other (default)",
    )
    parser.add_argument(
        "--forward-ms",
        type=float,
        default=0.0,
        help="GIL-free wait after each step, as for a GPU forward pass (default 0: the "
        "scheduler thread never rests, the worst case)",
    )
    parser.add_argument(
        "--pin",
        choices=("off", "on", "both"),
        default="off",
        help="on: the scheduler thread on the first CPU this process may use, every tier "
        "(its loop thread and the threads it starts, or its process; redis-server too) on "
        "the others, through the runtime's cpus option; both: every row unpinned, then "
        "pinned (default off)",
    )
    parser.add_argument(
        "--gil-hold-ms",
        nargs="+",
        type=_hold_ms,
        default=[DEFAULT_MAX_GIL_HOLD_MS],
        metavar="MS|off",
        help="the runtime's max_gil_hold_ms for each row, one row per value ('off': no GIL "
        f"hand-offs; default {DEFAULT_MAX_GIL_HOLD_MS:g})",
    )
    parser.add_argument(
        "--gc-handoff",
        nargs="+",
        choices=("on", "off"),
        default=["on"],
        help="the runtime's gc_handoff for each tier row, one row per value (default on)",
    )
    parser.add_argument(
        "--server-nice",
        type=int,
        default=0,
        metavar="N",
        help="the nice value of the redis-server the redis rows start (default 0). Where it "
        "shares the tier's CPU, each time it preempts the tier's loop thread while that holds "
        "the GIL, a scheduler back from the GPU waits out its time slice too (docs/runtime.md, "
        '"A loop thread\'s CPU"); 10 gives the loop thread the larger share',
    )
    parser.add_argument(
        "--switch-interval-ms",
        type=float,
        default=None,
        help="sys.setswitchinterval for the run (default: leave CPython's 5 ms)",
    )
    args = parser.parse_args(argv)
    cpus = args.cpus = sorted(allowed_cpus())  # before any row pins this thread
    if not 0 <= args.server_nice <= 19:
        parser.error(f"--server-nice must be 0-19 (a lower priority), got {args.server_nice}")
    if args.pin != "off" and len(cpus) < 2:
        parser.error(f"--pin needs at least 2 CPUs; this process may use {cpus}")
    if args.switch_interval_ms is not None:
        sys.setswitchinterval(args.switch_interval_ms / 1e3)
    if args.quick:
        args.seconds, args.rounds, args.running = 1.0, 2, 64
        args.block_kib, args.blocks_per_job, args.in_flight, args.tier_mib = 64, 4, 4, 32
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs, batch of {args.running} "
        f"requests; tier blocks {args.block_kib} KiB x {args.blocks_per_job} per job, "
        f"{args.in_flight} jobs in flight, {args.lookups} lookups/step, "
        f"{args.forward_ms:g} ms forward wait per step; "
        f"switch interval {sys.getswitchinterval() * 1e3:g} ms; "
        + (
            f"pinned rows: scheduler on CPU {cpus[0]}, tiers on {format_cpu_list(cpus[1:])}. "
            if args.pin != "off"
            else ""
        )
        + "Shared machines are noisy: "
        "compare within one run.\n"
    )
    with (
        tempfile.TemporaryDirectory(prefix="engine-step-", dir=args.scratch) as tmp,
        _COLLECTIONS,
    ):
        placements = ("thread", "process") if args.isolation == "both" else (args.isolation,)
        pinnings = {"off": (False,), "on": (True,), "both": (False, True)}[args.pin]
        rows = [
            bench_neighbour(kind, args, Path(tmp), pinned)
            for kind in args.controls
            for pinned in pinnings
        ]
        rows += [
            bench_tier(kind, args, Path(tmp), placement, pinned, gil_hold_ms, gc_here == "on")
            for kind in args.tiers
            for placement in placements
            for pinned in pinnings
            for gil_hold_ms in args.gil_hold_ms
            for gc_here in args.gc_handoff
        ]
    report(rows, args)


if __name__ == "__main__":
    main()
