"""CPUPrimaryTier: store/load lifecycle, eviction, pins, events and rejected misuse."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest

from tiering.core.contract import OffloadingEvent
from tiering.core.errors import ConfigError, ContractError, TierClosedError
from tiering.core.keys import NO_CONTEXT, OffloadKey, ReqContext, make_offload_key
from tiering.core.specs import CPULoadStoreSpec
from tiering.policies import LRUPolicy
from tiering.policies.request import RequestAwarePolicy, RequestContext
from tiering.primary import CPUPrimaryTier
from tiering.primary.host_buffer import SHM_DIR, HostBuffer, make_shared_name

POLICIES = ["lru", "arc"]
BLOCK = 4096


def key(i: int) -> OffloadKey:
    return make_offload_key(i.to_bytes(8, "big"), 0)


def keys(*ids: int) -> list[OffloadKey]:
    return [key(i) for i in ids]


def small_tier(num_blocks: int = 4, policy: str = "lru", **kwargs: object) -> CPUPrimaryTier:
    return CPUPrimaryTier(num_blocks, 64, policy, require_alignment=False, **kwargs)  # type: ignore[arg-type]


def store(tier: CPUPrimaryTier, *ids: int) -> list[int]:
    out = tier.prepare_store(keys(*ids), NO_CONTEXT)
    assert out is not None
    tier.complete_store(out.keys_to_store)
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    return out.store_spec.block_ids.tolist()


def snapshot(tier: CPUPrimaryTier, probe: range = range(20)) -> object:
    """Everything observable about the tier (without draining events)."""
    per_key = []
    for i in probe:
        k = key(i)
        block = tier.block_id(k) if tier.is_stored_or_in_flight(k) else None
        per_key.append((tier.is_ready(k), tier.is_stored_or_in_flight(k), tier.pin_count(k), block))
    counts = (tier.num_ready(), tier.num_free(), tier.num_storing(), tier.num_pinned())
    return counts, per_key, list(tier.eviction_policy)


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = make_shared_name("kvtier_test")
    yield name
    Path(SHM_DIR, name).unlink(missing_ok=True)


# -- construction ---------------------------------------------------------------------------


def test_geometry_and_views() -> None:
    tier = CPUPrimaryTier(3, BLOCK)
    assert (tier.num_blocks, tier.block_bytes, tier.medium) == (3, BLOCK, "CPU")
    assert tier.kv_view.shape == (3, BLOCK) and tier.kv_view.strides[0] == BLOCK
    assert tier.buffer.num_blocks == 3
    assert (tier.num_free(), tier.num_ready(), tier.num_pinned()) == (3, 0, 0)
    tier.check_invariants()
    tier.shutdown()


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        ((0, BLOCK), {}, "num_blocks must be >= 1"),
        ((4, 1000), {}, "multiple of 4096"),
        ((4, BLOCK, "fifo"), {}, "eviction_policy must be one of lru, arc, kvaware, .*got 'fifo'"),
        ((4, 0), {"require_alignment": False}, "block_bytes must be positive"),
    ],
)
def test_bad_configuration_is_rejected(args: tuple, kwargs: dict, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        CPUPrimaryTier(*args, **kwargs)


def test_external_buffer_must_match_and_is_not_closed_by_shutdown(shm_name: str) -> None:
    with HostBuffer.create(4, BLOCK) as buf:
        with pytest.raises(ConfigError, match="expected 5 x 4096"):
            CPUPrimaryTier(5, BLOCK, buffer=buf)
        with pytest.raises(ConfigError, match="either buffer or shared_name"):
            CPUPrimaryTier(4, BLOCK, buffer=buf, shared_name=shm_name)
        tier = CPUPrimaryTier(4, BLOCK, buffer=buf)
        assert tier.buffer is buf
        tier.shutdown()
        assert not buf.closed
    with pytest.raises(ConfigError, match="closed"):
        CPUPrimaryTier(4, BLOCK, buffer=buf)


def test_shared_buffer_is_created_and_unlinked_by_shutdown(shm_name: str) -> None:
    tier = CPUPrimaryTier(2, BLOCK, shared_name=shm_name)
    assert Path(SHM_DIR, shm_name).stat().st_size == 2 * BLOCK
    [block] = store(tier, 1)
    tier.buffer.row(block)[:3] = b"kv!"
    with HostBuffer.attach(shm_name, 2, BLOCK) as worker_view:
        assert bytes(worker_view.row(block)[:3]) == b"kv!"
    tier.shutdown()
    tier.shutdown()  # idempotent
    assert not Path(SHM_DIR, shm_name).exists()
    with pytest.raises(TierClosedError):
        tier.prepare_store(keys(2), NO_CONTEXT)
    with pytest.raises(TierClosedError):
        tier.prepare_load(keys(1), NO_CONTEXT)


# -- store and load lifecycle ---------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_blocks_are_readable_only_after_complete_store(policy: str) -> None:
    tier = small_tier(4, policy)
    out = tier.prepare_store(keys(1, 2), NO_CONTEXT)
    assert out is not None
    assert out.keys_to_store == keys(1, 2) and out.evicted_keys == []
    assert isinstance(out.store_spec, CPULoadStoreSpec)
    blocks = out.store_spec.block_ids.tolist()
    assert len(set(blocks)) == 2 and all(0 <= b < 4 for b in blocks)
    assert tier.lookup(key(1), NO_CONTEXT) is False
    assert tier.is_stored_or_in_flight(key(1)) and not tier.is_ready(key(1))
    assert tier.pin_count(key(1)) == 1 and tier.num_pinned() == 2
    assert [tier.block_id(k) for k in keys(1, 2)] == blocks
    assert list(tier.take_events()) == []
    tier.complete_store(keys(1, 2))
    assert tier.lookup(key(1), NO_CONTEXT) is True
    assert tier.pin_count(key(1)) == 0 and tier.num_pinned() == 0
    assert list(tier.take_events()) == [OffloadingEvent(keys(1, 2), 64, "CPU", False)]
    assert list(tier.take_events()) == []
    spec = tier.prepare_load(keys(2, 1), NO_CONTEXT)
    assert spec.block_ids.tolist() == blocks[::-1]
    tier.complete_load(keys(2, 1))
    tier.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_prepare_store_returns_only_keys_that_need_storing(policy: str) -> None:
    tier = small_tier(6, policy)
    store(tier, 1)
    in_flight = tier.prepare_store(keys(2), NO_CONTEXT)
    assert in_flight is not None
    out = tier.prepare_store(keys(1, 2, 3, 3, 4), NO_CONTEXT)
    assert out is not None
    assert out.keys_to_store == keys(3, 4)
    assert len(out.store_spec) == 2
    nothing = tier.prepare_store(keys(1, 2, 3), NO_CONTEXT)
    assert nothing is not None and nothing.keys_to_store == [] and len(nothing.store_spec) == 0
    assert tier.num_storing() == 3
    tier.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_failed_store_frees_its_blocks_silently(policy: str) -> None:
    tier = small_tier(2, policy)
    out = tier.prepare_store(keys(1, 2), NO_CONTEXT)
    assert out is not None and tier.num_free() == 0
    tier.complete_store(keys(2), success=False)
    tier.complete_store(keys(1))
    assert tier.num_free() == 1 and not tier.is_stored_or_in_flight(key(2))
    assert [e.keys for e in tier.take_events()] == [keys(1)]  # the failed key is never announced
    store(tier, 2)  # and can be stored again
    tier.check_invariants()


def test_kv_view_rows_are_the_blocks_the_specs_name() -> None:
    tier = CPUPrimaryTier(3, BLOCK)
    [block] = store(tier, 7)
    tier.buffer.row(block)[:4] = b"abcd"
    [loaded] = tier.prepare_load(keys(7), NO_CONTEXT).block_ids.tolist()
    view = tier.kv_view
    assert view[loaded, 0] == ord("a")
    assert bytes(np.asarray(view)[loaded, :4]) == b"abcd"  # zero-copy, as secondary tiers read
    flat = view.cast("B")  # or as a flat byte range
    assert bytes(flat[loaded * BLOCK : loaded * BLOCK + 4]) == b"abcd"
    flat.release()
    tier.complete_load(keys(7))
    tier.shutdown()


def test_events_can_be_disabled() -> None:
    tier = small_tier(1, enable_events=False)
    store(tier, 1)
    store(tier, 2)  # evicts 1
    assert list(tier.take_events()) == []


# -- eviction and pins ------------------------------------------------------------------------


def test_lru_eviction_announces_removed_blocks_and_reuses_them() -> None:
    tier = small_tier(3)
    first = store(tier, 1, 2, 3)
    tier.take_events()
    out = tier.prepare_store(keys(4, 5), NO_CONTEXT)
    assert out is not None
    # complete_store inserted 3, 2, 1 (the first key of a batch ends most recent).
    assert out.evicted_keys == keys(3, 2)
    assert sorted(out.store_spec.block_ids.tolist()) == sorted(first[1:])  # type: ignore[attr-defined]
    assert not tier.is_ready(key(3)) and tier.lookup(key(3), NO_CONTEXT) is False
    assert list(tier.take_events()) == [OffloadingEvent(keys(3, 2), 64, "CPU", True)]
    tier.complete_store(keys(4, 5))
    tier.check_invariants()


def test_touch_makes_the_first_key_most_recent_and_ignores_unknown_keys() -> None:
    tier = small_tier(3)
    store(tier, 1)
    store(tier, 2)
    store(tier, 3)  # order, oldest first: 1, 2, 3
    tier.touch(keys(1, 99, 2), NO_CONTEXT)  # now 3, 2, 1
    out = tier.prepare_store(keys(4), NO_CONTEXT)
    assert out is not None and out.evicted_keys == keys(3)


@pytest.mark.parametrize("policy", POLICIES)
def test_pinned_blocks_are_never_evicted_and_pins_nest(policy: str) -> None:
    tier = small_tier(2, policy)
    store(tier, 1, 2)
    tier.prepare_load(keys(1), NO_CONTEXT)
    tier.prepare_load(keys(1, 1), NO_CONTEXT)
    assert tier.pin_count(key(1)) == 3
    out = tier.prepare_store(keys(3), NO_CONTEXT)
    assert out is not None and out.evicted_keys == keys(2)
    before = snapshot(tier)
    assert tier.prepare_store(keys(4), NO_CONTEXT) is None  # 1 is pinned, 3 is storing
    assert snapshot(tier) == before
    tier.complete_store(keys(3))
    tier.complete_load(keys(1, 1))
    assert tier.prepare_store(keys(4), NO_CONTEXT) is not None  # 3 was evictable
    assert tier.pin_count(key(1)) == 1
    tier.complete_load(keys(1))
    assert tier.num_pinned() == 1  # only the store of 4
    tier.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_none_when_room_cannot_be_made_changes_nothing(policy: str) -> None:
    tier = small_tier(3, policy)
    store(tier, 1, 2)
    tier.prepare_load(keys(1), NO_CONTEXT)
    tier.take_events()
    before = snapshot(tier)
    # Needs 3 blocks: 1 free + only key 2 evictable.
    assert tier.prepare_store(keys(5, 6, 7), NO_CONTEXT) is None
    assert tier.prepare_store(keys(*range(10, 20)), NO_CONTEXT) is None  # more than capacity
    assert snapshot(tier) == before
    assert list(tier.take_events()) == []
    tier.check_invariants()


def test_a_request_never_evicts_its_own_stored_blocks() -> None:
    tier = small_tier(3)
    store(tier, 1, 2, 3)
    # 1 and 2 are part of this request: only 3 may make room, so one new key fits.
    out = tier.prepare_store(keys(1, 2, 8), NO_CONTEXT)
    assert out is not None and out.evicted_keys == keys(3)
    assert tier.prepare_store(keys(1, 2, 8, 9), NO_CONTEXT) is None  # 8 is storing: no room
    tier.complete_store(keys(8))
    tier.check_invariants()


# -- misuse is rejected, naming the keys, changing nothing ----------------------------------


@pytest.mark.parametrize("policy", POLICIES)
def test_misuse_raises_contract_error_and_changes_nothing(policy: str) -> None:
    tier = small_tier(4, policy)
    store(tier, 1, 2)
    assert tier.prepare_store(keys(3), NO_CONTEXT) is not None  # 3 in flight
    tier.prepare_load(keys(2), NO_CONTEXT)
    tier.take_events()
    before = snapshot(tier)
    hex9, hex3 = key(9).hex(), key(3).hex()
    misuse = [
        (lambda: tier.prepare_load(keys(1, 9), NO_CONTEXT), f"not stored: 1 key: {hex9}"),
        (lambda: tier.prepare_load(keys(3), NO_CONTEXT), f"store still in flight: 1 key: {hex3}"),
        (lambda: tier.complete_load(keys(1)), "not pinned by a prepare_load: 1 key"),
        (lambda: tier.complete_load(keys(2, 2)), "not pinned by a prepare_load"),
        (lambda: tier.complete_store(keys(3, 9)), f"never prepared .*{hex9}"),
        (lambda: tier.complete_store(keys(1)), f"already completed: 1 key: {key(1).hex()}"),
        (lambda: tier.complete_store(keys(3, 3)), f"listed more than once: 1 key: {hex3}"),
        (lambda: tier.block_id(key(9)), hex9),
    ]
    for call, match in misuse:
        with pytest.raises(ContractError, match=match):
            call()
        assert snapshot(tier) == before, match
    assert list(tier.take_events()) == []
    tier.complete_store(keys(3))
    with pytest.raises(ContractError, match="already completed"):
        tier.complete_store(keys(3))  # a double complete_store
    tier.complete_load(keys(2))
    assert tier.num_pinned() == 0
    tier.check_invariants()


def test_error_messages_abbreviate_long_key_lists() -> None:
    tier = small_tier(2)
    with pytest.raises(ContractError, match=r"10 keys: .*\.\.\. \(6 more\)"):
        tier.prepare_load(keys(*range(10)), NO_CONTEXT)


class RecordingPolicy(RequestAwarePolicy[OffloadKey]):
    """LRU that records the request context of each use (a request-aware policy)."""

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self.inner = LRUPolicy[OffloadKey](capacity)
        self.uses: list[tuple[OffloadKey, RequestContext | None]] = []
        self.stores: list[tuple[OffloadKey, RequestContext | None]] = []

    def insert(self, key: OffloadKey) -> None:
        self.stores.append((key, None))
        self.inner.insert(key)

    def insert_in(self, key: OffloadKey, context: RequestContext) -> None:
        self.stores.append((key, context))
        self.inner.insert(key)

    def access(self, key: OffloadKey) -> None:
        self.uses.append((key, None))
        self.inner.access(key)

    def access_in(self, key: OffloadKey, context: RequestContext) -> None:
        self.uses.append((key, context))
        self.inner.access(key)

    def remove(self, key: OffloadKey) -> None:
        self.inner.remove(key)

    def evict(self, n: int, can_evict: Callable[[OffloadKey], bool]) -> list[OffloadKey]:
        return self.inner.evict(n, can_evict)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self.inner)

    def check_invariants(self) -> None:
        self.inner.check_invariants()


def test_a_request_aware_policy_gets_the_request_position_and_group_with_each_touch() -> None:
    tier = small_tier(4, policy="tests.test_primary:RecordingPolicy")
    store(tier, 0, 1)
    grouped = make_offload_key(b"g" * 16, 3)
    tier.touch([key(0), key(1), grouped], ReqContext("req-7"))
    policy = tier._policy
    assert isinstance(policy, RecordingPolicy)
    assert policy.uses == [  # last block first: a prefix's tail is the first to go
        (grouped, RequestContext("req-7", 2, 3)),
        (key(1), RequestContext("req-7", 1, 0)),
        (key(0), RequestContext("req-7", 0, 0)),
    ]
    policy.uses.clear()
    tier.touch([key(0)], NO_CONTEXT)  # no request: the key-only contract
    assert policy.uses == [(key(0), None)]


def test_a_request_aware_policy_gets_the_request_that_stored_each_block() -> None:
    tier = small_tier(8, policy="tests.test_primary:RecordingPolicy")
    policy = tier._policy
    assert isinstance(policy, RecordingPolicy)
    grouped = make_offload_key(b"g" * 16, 2)
    out = tier.prepare_store([key(0), key(1), grouped], ReqContext("req-9"))
    assert out is not None
    tier.complete_store(out.keys_to_store)
    assert policy.stores == [  # last block first, each with its place in the request
        (grouped, RequestContext("req-9", 2, 2)),
        (key(1), RequestContext("req-9", 1, 0)),
        (key(0), RequestContext("req-9", 0, 0)),
    ]
    policy.stores.clear()
    failed = tier.prepare_store([key(5)], ReqContext("req-10"))
    assert failed is not None
    tier.complete_store(failed.keys_to_store, success=False)  # its request is forgotten
    out = tier.prepare_store([key(6)], NO_CONTEXT)  # no request: the key-only contract
    assert out is not None
    tier.complete_store(out.keys_to_store)
    assert policy.stores == [(key(6), None)]
    tier.check_invariants()


def test_shutdown_forgets_every_block() -> None:
    """No lookup may answer a hit for a row nobody can read after shutdown."""
    tier = CPUPrimaryTier(4, 4096)
    stored = keys(0, 1, 2)
    out = tier.prepare_store(stored, NO_CONTEXT)
    assert out is not None
    tier.complete_store(out.keys_to_store[:2])  # two ready, one still being stored
    tier.prepare_load([stored[0]], NO_CONTEXT)  # and one pinned for a load
    tier.shutdown()
    assert [tier.lookup(k, NO_CONTEXT) for k in stored] == [False, False, False]
    assert tier.num_ready() == 0 and tier.num_storing() == 0
    tier.check_invariants()
