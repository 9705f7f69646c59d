"""The scheduler side of the step benchmarks: a vLLM-shaped ``schedule()`` and its timing.

Owns :class:`ToyScheduler` (a deterministic, pure-Python stand-in for vLLM's v1
``Scheduler.schedule`` + ``update_from_output`` at a realistic batch), the
:class:`Phase` that collects what each step cost (``schedule()`` time, the whole
step, wake latency after a forward wait, CPU time, context switches, garbage
collections, round boundaries) and :func:`run_steps`, which times steps back to
back. ``benchmarks/engine_step.py`` and ``benchmarks/isolation.py`` measure the
scheduler this way, against the targets below.
"""

from __future__ import annotations

import gc
import heapq
import resource
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

#: Targets for ``schedule()`` beside a tier, as ratios to the steps alone.
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


# -- timing the steps ---------------------------------------------------------------------------


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


RUSAGE_THREAD: int | None = getattr(resource, "RUSAGE_THREAD", None)


def thread_switches() -> tuple[int, int]:
    """This thread's (voluntary, involuntary) context switches so far (Linux; (0, 0) elsewhere)."""
    if RUSAGE_THREAD is None:
        return 0, 0
    usage = resource.getrusage(RUSAGE_THREAD)
    return usage.ru_nvcsw, usage.ru_nivcsw


#: Entered by a benchmark's ``main`` for the run (outside it the count stays put: steps count none).
SCHEDULER_COLLECTIONS = SchedulerCollections()


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
    collections = SCHEDULER_COLLECTIONS
    switches = thread_switches
    first = True
    while first or time.perf_counter() < end:  # one step at least, however late
        first = False
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
