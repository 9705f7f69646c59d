"""A Hypothesis state machine over the whole manager: a real CPU primary tier and two async
secondary tiers (in-memory; the second wrapped in fault injection), driven by random stores,
lookups, loads, touches, steps, failures, clock jumps and evictions.

Invariants: every readable primary row holds the bytes the 'GPU' wrote for its key (so bytes
loaded are always the bytes stored: no wrong hit, ever), the primary tier's capacity is never
exceeded, pins return to zero when idle, and every submitted job gets exactly one result.
"""

from __future__ import annotations

import threading

import hypothesis.strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    rule,
)

from tests.manager_helpers import (
    RecordingTier,
    key,
    leftover_threads,
    make_facade,
    make_primary,
    pattern,
    promote,
    read_row,
    rows_of,
    settle,
    write_row,
)
from tiering.core.keys import OffloadKey, ReqContext
from tiering.manager import TieringOffloadingManager
from tiering.testing.faults import FaultPlan, FaultyTier
from tiers.memory import MemoryTier

NUM_BLOCKS = 4
NUM_KEYS = 10
KEYS = [key(i) for i in range(NUM_KEYS)]
CONTEXTS = [ReqContext(req_id="a"), ReqContext(req_id="b"), ReqContext(req_id="c")]

FAULT_PLANS = {
    "clean": FaultPlan(),
    "read-errors": FaultPlan(error_rate=0.5, ops={"read"}),
    "write-errors": FaultPlan(error_rate=0.5, ops={"write"}),
    # Damage the tier itself detects (as checksumming tiers do) ...
    "detected-corruption": FaultPlan(corrupt_rate=0.5, ops={"read"}, detect=True),
    "detected-short-reads": FaultPlan(short_read_rate=0.5, ops={"read"}, detect=True),
    # ... and damage it does not: the runtime's store-time checksum must catch it.
    "silent-corruption": FaultPlan(corrupt_rate=0.5, ops={"read"}, detect=False),
    "silent-short-reads": FaultPlan(short_read_rate=0.5, ops={"read"}, detect=False),
    "slow": FaultPlan(delay_rate=0.5, delay_s=(0.0, 0.003)),
}

keys = st.sampled_from(KEYS)
contexts = st.sampled_from(CONTEXTS)


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class ManagerMachine(RuleBasedStateMachine):
    """Rules never depend on preconditions: results arrive from other threads, so the state
    after a rule is timing-dependent, and Hypothesis must draw the same rules on replay."""

    def __init__(self) -> None:
        super().__init__()
        self.threads_before = set(threading.enumerate())
        self.clock = FakeClock()
        self.primary = make_primary(NUM_BLOCKS)
        self.faulty = FaultyTier(MemoryTier(), FaultPlan(), seed=0)
        self.tiers = [
            RecordingTier(make_facade(self.faulty, self.primary, "faulty")),
            RecordingTier(make_facade(MemoryTier(capacity_blocks=6), self.primary, "memory")),
        ]
        self.manager = TieringOffloadingManager(
            self.primary,
            self.tiers,
            clock=self.clock,
            failed_promotion_backoff_s=5.0,
            max_promotion_batch=3,
            metrics_registry=False,
        )
        self.pending_stores: list[list[OffloadKey]] = []
        self.active_loads: list[list[OffloadKey]] = []

    # -- the engine's side ---------------------------------------------------------------------

    @rule(batch=st.lists(keys, min_size=1, max_size=4, unique=True), ctx=contexts)
    def begin_store(self, batch: list[OffloadKey], ctx: ReqContext) -> None:
        if len(self.pending_stores) >= 3:
            return
        output = self.manager.prepare_store(batch, ctx)
        if output is None:
            return
        assert set(output.keys_to_store) <= set(batch)
        assert not set(output.evicted_keys) & set(output.keys_to_store)
        for k, row in zip(output.keys_to_store, rows_of(output.store_spec), strict=True):
            write_row(self.primary, row, pattern(k))  # the GPU worker's copy
        if output.keys_to_store:
            self.pending_stores.append(list(output.keys_to_store))

    @rule(first=st.integers(0, NUM_KEYS - 1), ctx=contexts)
    def store(self, first: int, ctx: ReqContext) -> None:
        """A whole store of a 3-block prefix (the common case); evicts when the tier is full."""
        batch = [KEYS[(first + i) % NUM_KEYS] for i in range(3)]
        output = self.manager.prepare_store(batch, ctx)
        if output is None:
            return
        for k, row in zip(output.keys_to_store, rows_of(output.store_spec), strict=True):
            write_row(self.primary, row, pattern(k))
        self.manager.complete_store(output.keys_to_store, True)

    @rule(success=st.booleans(), which=st.integers(0, 7))
    def finish_store(self, success: bool, which: int) -> None:
        if not self.pending_stores:
            return
        batch = self.pending_stores.pop(which % len(self.pending_stores))
        self.manager.complete_store(batch, success)

    @rule(k=keys, ctx=contexts)
    def lookup(self, k: OffloadKey, ctx: ReqContext) -> None:
        answer = self.manager.lookup(k, ctx)
        if answer is True:
            assert self.primary.is_ready(k)

    @rule(batch=st.lists(keys, min_size=1, max_size=3, unique=True), ctx=contexts)
    def lookup_until_answered(self, batch: list[OffloadKey], ctx: ReqContext) -> None:
        """What the engine does with 'retry later': step and ask again until True or False."""
        answers = promote(self.manager, batch, ctx)
        assert len(answers) == len(batch)

    @rule(batch=st.lists(keys, min_size=1, max_size=3, unique=True), ctx=contexts)
    def load(self, batch: list[OffloadKey], ctx: ReqContext) -> None:
        if len(self.active_loads) >= 3:
            return
        ready = [k for k in batch if self.manager.lookup(k, ctx) is True]
        if not ready:
            return
        spec = self.manager.prepare_load(ready, ctx)
        for k, row in zip(ready, rows_of(spec), strict=True):
            assert read_row(self.primary, row) == pattern(k), f"wrong bytes loaded for {k.hex()}"
        self.active_loads.append(ready)

    @rule(which=st.integers(0, 7))
    def finish_load(self, which: int) -> None:
        if not self.active_loads:
            return
        self.manager.complete_load(self.active_loads.pop(which % len(self.active_loads)))

    @rule(batch=st.lists(keys, min_size=1, max_size=4), ctx=contexts)
    def touch(self, batch: list[OffloadKey], ctx: ReqContext) -> None:
        self.manager.touch(batch, ctx)

    # -- time, faults, the background ----------------------------------------------------------

    @rule()
    def step(self) -> None:
        self.manager.step()

    @rule()
    def wait_for_jobs(self) -> None:
        settle(self.manager)

    @rule(seconds=st.sampled_from([0.5, 3.0, 6.0]))
    def advance_clock(self, seconds: float) -> None:
        self.clock.now += seconds

    @rule(plan=st.sampled_from(sorted(FAULT_PLANS)))
    def set_faults(self, plan: str) -> None:
        self.faulty.plan = FAULT_PLANS[plan]

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def readable_rows_hold_their_keys_bytes(self) -> None:
        for k in KEYS:
            if self.primary.is_ready(k):
                row = self.primary.block_id(k)
                assert read_row(self.primary, row) == pattern(k), f"row of {k.hex()} is wrong"

    @invariant()
    def capacity_and_bookkeeping(self) -> None:
        self.primary.check_invariants()
        assert self.primary.num_ready() <= NUM_BLOCKS
        assert self.primary.num_free() >= 0
        stats = self.manager.stats()
        assert stats.internal_errors == 0
        assert stats.unexpected_results == 0
        engine_pinned = {k for batch in self.active_loads for k in batch}
        assert all(self.primary.pin_count(k) >= 1 for k in engine_pinned)

    def teardown(self) -> None:
        try:
            # Go idle: finish what the engine started, let every job finish.
            for batch in self.pending_stores:
                self.manager.complete_store(batch, True)
            for batch in self.active_loads:
                self.manager.complete_load(batch)
            self.pending_stores.clear()
            self.active_loads.clear()
            settle(self.manager)
            assert self.primary.num_pinned() == 0, "pins did not return to zero when idle"
            self.readable_rows_hold_their_keys_bytes()
            for tier in self.tiers:
                tier.check_one_result_per_job()
        finally:
            self.manager.shutdown()
        assert leftover_threads(self.threads_before) == []


TestManagerMachine = ManagerMachine.TestCase
