"""CPUPrimaryTier under random interleavings of stores, loads, touches, failures and misuse.

A worker is simulated: after ``prepare_store`` it writes a unique payload into
each reserved row; loads read the rows back, when prepared and again when
completed. Checked after every step against a plain model:

* capacity is never exceeded and every block is free, storing or ready;
* a key is readable (``lookup``) iff it was stored and not evicted since;
* a pinned block (store or load in progress) is never evicted;
* the bytes read back are the bytes written, for every ready key;
* ``prepare_store`` returns None exactly when room cannot be made, and then
  changes nothing; rejected misuse changes nothing;
* at the end, completing every outstanding job balances the pins to zero.
"""

from __future__ import annotations

import itertools

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from tiering.core.errors import ContractError
from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.primary import CPUPrimaryTier

NUM_BLOCKS = 5
BLOCK_BYTES = 32
KEY_SPACE = 12
KEYS = [make_offload_key(bytes([i]) * 8, i % 2) for i in range(KEY_SPACE)]
key_lists = st.lists(st.sampled_from(KEYS), min_size=1, max_size=4)


class PrimaryTierMachine(RuleBasedStateMachine):
    policy = "lru"

    def __init__(self) -> None:
        super().__init__()
        self.tier = CPUPrimaryTier(NUM_BLOCKS, BLOCK_BYTES, self.policy, require_alignment=False)
        self.ready: dict[OffloadKey, bytes] = {}  # key -> payload, for readable keys
        self.store_jobs: list[dict[OffloadKey, bytes]] = []  # prepared, not completed
        self.load_jobs: list[list[OffloadKey]] = []  # prepared, not completed
        self.payloads = itertools.count()

    # -- model helpers ---------------------------------------------------------------------

    def storing(self) -> set[OffloadKey]:
        return {k for job in self.store_jobs for k in job}

    def load_pins(self, key: OffloadKey) -> int:
        return sum(job.count(key) for job in self.load_jobs)

    def snapshot(self) -> object:
        t = self.tier
        return (
            t.num_ready(),
            t.num_free(),
            t.num_pinned(),
            [(t.is_ready(k), t.pin_count(k)) for k in KEYS],
            list(t.eviction_policy),
        )

    def row(self, key: OffloadKey) -> bytes:
        return bytes(self.tier.buffer.row(self.tier.block_id(key)))

    # -- stores ------------------------------------------------------------------------------

    @rule(keys=key_lists)
    def prepare_store(self, keys: list[OffloadKey]) -> None:
        storing = self.storing()
        requested = list(dict.fromkeys(keys))
        expected = [k for k in requested if k not in self.ready and k not in storing]
        free = NUM_BLOCKS - len(self.ready) - len(storing)
        evictable = {k for k in self.ready if self.load_pins(k) == 0 and k not in requested}
        fits = len(expected) <= free + len(evictable)
        before = self.snapshot()
        out = self.tier.prepare_store(keys, NO_CONTEXT)
        if not fits:
            assert out is None, "prepare_store made room that does not exist"
            assert self.snapshot() == before
            return
        assert out is not None, "prepare_store refused although room could be made"
        assert out.keys_to_store == expected
        assert len(out.evicted_keys) == max(0, len(expected) - free)
        assert set(out.evicted_keys) <= evictable, "evicted a pinned or requested block"
        for victim in out.evicted_keys:
            del self.ready[victim]
        block_ids = out.store_spec.block_ids.tolist()  # type: ignore[attr-defined]
        held = {self.tier.block_id(k) for k in self.ready}
        held |= {self.tier.block_id(k) for job in self.store_jobs for k in job}
        assert not held & set(block_ids), "a block was handed out twice"
        job: dict[OffloadKey, bytes] = {}
        for k, block in zip(expected, block_ids, strict=True):  # the worker writes
            payload = f"{k.hex()[:6]}#{next(self.payloads)}".encode().ljust(BLOCK_BYTES, b".")
            self.tier.buffer.row(block)[:] = payload
            job[k] = payload
        if job:
            self.store_jobs.append(job)

    @precondition(lambda self: bool(self.store_jobs))
    @rule(data=st.data(), success=st.booleans())
    def complete_store(self, data: st.DataObject, success: bool) -> None:
        job = self.store_jobs.pop(data.draw(st.integers(0, len(self.store_jobs) - 1)))
        keys = list(job)
        self.tier.complete_store(keys, success=success)
        if success:
            self.ready.update(job)

    # -- loads ---------------------------------------------------------------------------------

    @precondition(lambda self: bool(self.ready))
    @rule(data=st.data())
    def prepare_load(self, data: st.DataObject) -> None:
        keys = data.draw(st.lists(st.sampled_from(sorted(self.ready)), min_size=1, max_size=3))
        spec = self.tier.prepare_load(keys, NO_CONTEXT)
        for k, block in zip(keys, spec.block_ids.tolist(), strict=True):
            assert bytes(self.tier.buffer.row(block)) == self.ready[k], "read back other bytes"
        self.load_jobs.append(keys)

    @precondition(lambda self: bool(self.load_jobs))
    @rule(data=st.data())
    def complete_load(self, data: st.DataObject) -> None:
        keys = self.load_jobs.pop(data.draw(st.integers(0, len(self.load_jobs) - 1)))
        for k in keys:  # still intact when the worker finishes reading
            assert self.row(k) == self.ready[k]
        self.tier.complete_load(keys)

    @rule(keys=key_lists)
    def touch(self, keys: list[OffloadKey]) -> None:
        self.tier.touch(keys, NO_CONTEXT)

    @rule(key=st.sampled_from(KEYS))
    def lookup(self, key: OffloadKey) -> None:
        assert self.tier.lookup(key, NO_CONTEXT) is (key in self.ready)

    # -- misuse ------------------------------------------------------------------------------

    @rule(keys=key_lists)
    def misuse_is_rejected(self, keys: list[OffloadKey]) -> None:
        storing = self.storing()
        before = self.snapshot()
        if any(k not in self.ready for k in keys):
            try:
                self.tier.prepare_load(keys, NO_CONTEXT)
            except ContractError:
                pass
            else:
                raise AssertionError("prepare_load of keys that are not ready was accepted")
        if any(k not in storing for k in keys) or len(set(keys)) < len(keys):
            try:
                self.tier.complete_store(keys)
            except ContractError:
                pass
            else:
                raise AssertionError("complete_store of unprepared keys was accepted")
        if any(self.load_pins(k) < keys.count(k) for k in keys):
            try:
                self.tier.complete_load(keys)
            except ContractError:
                pass
            else:
                raise AssertionError("complete_load without matching pins was accepted")
        assert self.snapshot() == before, "a rejected call changed the tier"

    # -- invariants ----------------------------------------------------------------------------

    @invariant()
    def tier_matches_model(self) -> None:
        tier = self.tier
        tier.check_invariants()
        storing = self.storing()
        assert tier.num_ready() == len(self.ready) <= NUM_BLOCKS
        assert tier.num_ready() + tier.num_storing() + tier.num_free() == NUM_BLOCKS
        assert tier.num_storing() == len(storing)
        for k in KEYS:
            assert tier.is_ready(k) == (k in self.ready), f"readability of {k.hex()}"
            assert tier.pin_count(k) == self.load_pins(k) + (k in storing)
        for k, payload in self.ready.items():
            assert self.row(k) == payload, f"bytes of {k.hex()} changed"

    def teardown(self) -> None:
        while self.load_jobs:
            self.tier.complete_load(self.load_jobs.pop())
        while self.store_jobs:
            self.tier.complete_store(list(self.store_jobs.pop()))
        assert self.tier.num_pinned() == 0, "pins did not balance to zero"
        assert all(self.tier.pin_count(k) == 0 for k in KEYS)
        self.tier.check_invariants()
        self.tier.shutdown()


class ARCPrimaryTierMachine(PrimaryTierMachine):
    policy = "arc"


TestPrimaryTierLRU = PrimaryTierMachine.TestCase
TestPrimaryTierARC = ARCPrimaryTierMachine.TestCase
