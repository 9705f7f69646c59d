"""A tier behind the real facade over fresh primary rows, and the job mix that keeps it busy.

Owns :func:`open_tier` (``memory``, ``fs-threads``, ``fs-uring`` or ``redis`` on
loopback with a redis-server started for it, on a loop thread of this process or
in a child process, with the runtime's pinning, GIL and GC options; ``null``: the
:class:`NullTier` floor, which moves no bytes), the :class:`Skip` a tier raises
where it cannot run, :class:`JobMix` (stores and
loads kept in flight, prefix lookups, as a connector drives a tier each step),
and the readers of a thread's or a process's CPU time and preemptions. Used by
``benchmarks/engine_step.py`` and ``benchmarks/loop_cost.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import os
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.support.common import KIB, MIB
from tiering.core.errors import BlockNotFound
from tiering.core.jobs import JobMetadata
from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.isolation import IsolatedTierManager
from tiering.primary.host_buffer import HostBuffer, make_shared_name
from tiering.runtime import AsyncTierManager
from tiering.runtime.affinity import format_cpu_list
from tiering.runtime.facade import DEFAULT_MAX_GIL_HOLD_MS
from tiering.tier import AsyncTier

TIERS = ("memory", "fs-threads", "fs-uring", "redis")
#: Not a tier to measure but the floor under them: :class:`NullTier` (``open_tier("null")``).
NULL_TIER = "null"


# -- the tiers ---------------------------------------------------------------------------------


class Skip(Exception):
    """This tier cannot run on this machine (the message says why)."""


class NullTier(AsyncTier):
    """A tier that keeps its keys and moves no bytes: the facade and the loop's cost alone.

    Its reads verify themselves (there is nothing to verify), so the runtime
    checksums nothing either: what it costs the loop thread per block is the
    least any tier behind the facade costs, the floor of ``benchmarks/loop_cost.py``.
    """

    verifies_reads = True

    def __init__(self) -> None:
        self._keys: set[OffloadKey] = set()

    async def contains(self, key: OffloadKey) -> bool:
        return key in self._keys

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        if key not in self._keys:
            raise BlockNotFound(key)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        self._keys.add(key)


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
    host = HostBuffer.create(rows, block, shared_name=make_shared_name("engine_step"))
    primary = host.as_numpy()
    primary[:] = np.random.default_rng(1).integers(0, 256, primary.shape, dtype=np.uint8)
    capacity_blocks = max(4 * rows, (args.tier_mib * MIB) // block)
    factory: Callable[[], Any]
    server: Any = None
    description = ""
    try:
        if kind == NULL_TIER:
            factory = NullTier
            description = "keys only, no bytes moved or checksummed"
        elif kind == "memory":
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
            if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
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
