"""Eviction policies: the public state machine for LRU and ARC, plus ARC's own behaviour."""

from __future__ import annotations

from collections.abc import Iterable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.errors import ConfigError
from tiering.policies import ARCPolicy, KVAwarePolicy, LRUPolicy, make_policy
from tiering.policies.base import EvictionPolicy
from tiering.testing import (
    ReferenceARC,
    ReferenceKVAware,
    ReferenceLRU,
    make_policy_state_machine,
    make_policy_test_case,
)

# The contract alone, at two capacities (1 is the edge where every insert evicts).
TestLRUContract = make_policy_state_machine(LRUPolicy, capacity=6).TestCase
TestLRUCapacityOne = make_policy_test_case(LRUPolicy, capacity=1)
TestARCContract = make_policy_state_machine(ARCPolicy, capacity=6).TestCase
TestARCCapacityOne = make_policy_test_case(ARCPolicy, capacity=1)
# Exact eviction order against the list-based references.
TestLRUMatchesReference = make_policy_test_case(LRUPolicy, capacity=5, reference=ReferenceLRU)
TestARCMatchesReference = make_policy_test_case(
    ARCPolicy, capacity=5, key_space=20, reference=ReferenceARC
)
TestKVAwareContract = make_policy_state_machine(KVAwarePolicy, capacity=6).TestCase
TestKVAwareCapacityOne = make_policy_test_case(KVAwarePolicy, capacity=1)
TestKVAwareMatchesReference = make_policy_test_case(
    KVAwarePolicy, capacity=5, key_space=20, reference=ReferenceKVAware
)
TestKVAwareOptionsMatchReference = make_policy_test_case(
    lambda c: KVAwarePolicy(c, probation_ghosts=3.0, protected_ghosts=0.5, initial_protected=0.3),
    capacity=4,
    key_space=24,
    reference=lambda c: ReferenceKVAware(
        c, probation_ghosts=3.0, protected_ghosts=0.5, initial_protected=0.3
    ),
)
# The references themselves must satisfy the contract.
TestReferenceARCContract = make_policy_test_case(ReferenceARC, capacity=4)
TestReferenceKVAwareContract = make_policy_test_case(ReferenceKVAware, capacity=4)


# Checking the checker needs fewer examples (and no shrinking report noise).
META_SETTINGS = settings(max_examples=40, deadline=None, print_blob=False)


def never_pinned(_key: object) -> bool:
    return True


def fill(policy: EvictionPolicy[int], keys: Iterable[int]) -> None:
    for key in keys:
        policy.insert(key)


# -- the state machine catches broken policies --------------------------------------------


class ForgetfulLRU(LRUPolicy[int]):
    """Evicts pinned keys: the machine must reject it."""

    def evict(self, n: int, can_evict: object) -> list[int]:
        return super().evict(n, lambda _k: True)


class UnboundedLRU(LRUPolicy[int]):
    """Accepts inserts beyond capacity: the machine must reject it."""

    def insert(self, key: int) -> None:
        if key in self:
            raise ValueError("resident")
        self._order[key] = None


class MRUPolicy(LRUPolicy[int]):
    """A valid policy with another order: passes the contract, fails against ReferenceLRU."""

    def evict(self, n: int, can_evict: object) -> list[int]:
        assert callable(can_evict)
        victims = [k for k in reversed(self._order) if can_evict(k)][: max(n, 0)]
        for key in victims:
            del self._order[key]
        return victims


@pytest.mark.parametrize(
    ("policy", "reference"),
    [(ForgetfulLRU, None), (UnboundedLRU, None), (MRUPolicy, ReferenceLRU)],
)
def test_state_machine_detects_broken_policies(policy: type, reference: type | None) -> None:
    case = make_policy_test_case(policy, capacity=3, reference=reference, settings=META_SETTINGS)
    with pytest.raises(AssertionError):
        case("runTest").runTest()


def test_state_machine_accepts_valid_other_order_without_reference() -> None:
    make_policy_test_case(MRUPolicy, capacity=3, settings=META_SETTINGS)("runTest").runTest()


def test_state_machine_rejects_bad_parameters() -> None:
    with pytest.raises(ValueError, match="capacity"):
        make_policy_state_machine(LRUPolicy, capacity=0)
    with pytest.raises(ValueError, match="key_space"):
        make_policy_state_machine(LRUPolicy, capacity=4, key_space=4)


# -- registry and shared behaviour --------------------------------------------------------


def test_make_policy_by_name() -> None:
    assert isinstance(make_policy("lru", 3), LRUPolicy)
    assert isinstance(make_policy("arc", 3), ARCPolicy)
    assert isinstance(make_policy("KVAware", 3), KVAwarePolicy)
    with pytest.raises(ConfigError, match="'lfu'"):
        make_policy("lfu", 3)
    for bad in (0, -1, 2.5, True):
        with pytest.raises(ConfigError, match="capacity"):
            make_policy("lru", bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy, KVAwarePolicy])
def test_insert_rejections_change_nothing(cls: type[EvictionPolicy[int]]) -> None:
    policy = cls(2)
    policy.insert(1)
    with pytest.raises(ValueError, match="already resident"):
        policy.insert(1)
    policy.insert(2)
    with pytest.raises(ValueError, match="evict first"):
        policy.insert(3)
    assert sorted(policy) == [1, 2]
    assert 3 not in policy
    policy.check_invariants()
    with pytest.raises(ValueError, match="capacity"):
        cls(0)


@pytest.mark.parametrize("cls", [LRUPolicy, ARCPolicy, KVAwarePolicy])
def test_evict_skips_pinned_and_returns_fewer_only_when_needed(
    cls: type[EvictionPolicy[int]],
) -> None:
    policy = cls(4)
    fill(policy, range(4))
    pinned = {0, 2}
    victims = policy.evict(3, lambda k: k not in pinned)
    assert sorted(victims) == [1, 3]
    assert sorted(policy) == [0, 2]
    assert policy.evict(0, never_pinned) == []
    assert policy.evict(-5, never_pinned) == []


def test_lru_order_follows_access() -> None:
    policy: LRUPolicy[int] = LRUPolicy(3)
    fill(policy, range(3))
    policy.access(0)
    policy.access(99)  # not resident: ignored
    assert policy.evict(2, never_pinned) == [1, 2]
    assert list(policy) == [0]


# -- ARC ------------------------------------------------------------------------------------


def test_arc_new_keys_enter_t1_and_second_use_promotes_to_t2() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    fill(arc, range(3))
    assert arc.sizes() == (3, 0, 0, 0)
    arc.access(1)
    assert arc.list_of(1) == "T2"
    arc.access(1)  # a hit in T2 stays in T2
    assert arc.sizes() == (2, 1, 0, 0)
    arc.check_invariants()


def test_arc_victims_become_ghosts_and_remove_leaves_none() -> None:
    arc: ARCPolicy[int] = ARCPolicy(3)
    fill(arc, range(3))
    arc.access(2)  # T1 = [0, 1], T2 = [2]
    assert arc.evict(1, never_pinned) == [0]  # |T1| = 2 > p = 0: from T1
    assert arc.list_of(0) == "B1"
    arc.remove(1)
    assert arc.list_of(1) is None
    assert 0 not in arc
    assert arc.sizes() == (0, 1, 1, 0)
    arc.check_invariants()


def test_arc_b1_ghost_hit_grows_p_and_returns_to_t2() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    fill(arc, range(4))
    assert arc.evict(2, never_pinned) == [0, 1]
    assert arc.sizes() == (2, 0, 2, 0)
    arc.insert(0)  # a B1 hit: p += max(|B2|/|B1|, 1) = 1
    assert arc.target_t1 == 1.0
    assert arc.list_of(0) == "T2"
    assert arc.sizes() == (2, 1, 1, 0)
    arc.check_invariants()


def test_arc_b1_ghost_hit_weighs_by_ghost_ratio() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    fill(arc, range(4))
    for key in range(4):
        arc.access(key)  # T2 = [0, 1, 2, 3]
    assert arc.evict(2, never_pinned) == [0, 1]  # T1 empty: from T2 into B2
    arc.insert(10)
    arc.insert(11)  # new keys: T1 = [10, 11]
    assert arc.evict(1, never_pinned) == [10]  # |T1| = 2 > p = 0: into B1
    assert arc.sizes() == (1, 2, 1, 2)
    arc.insert(10)  # B1 hit: p += max(|B2|/|B1|, 1) = 2
    assert arc.target_t1 == 2.0
    assert arc.sizes() == (1, 3, 0, 2)
    arc.check_invariants()


def test_arc_b2_ghost_hit_shrinks_p_by_ghost_ratio() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    fill(arc, range(4))
    arc.access(3)  # T1 = [0, 1, 2], T2 = [3]
    for key in (0, 1):  # two B1 hits: p = 2
        assert arc.evict(1, never_pinned) == [key]
        arc.insert(key)
    assert arc.target_t1 == 2.0
    assert arc.sizes() == (1, 3, 0, 0)
    assert arc.evict(1, never_pinned) == [3]  # |T1| = 1 <= p: from T2 into B2
    arc.insert(20)  # T1 = [2, 20]
    t1_keys = {2, 20}
    # |T1| = 2 <= p prefers T2, whose keys are pinned: both T1 keys go to B1.
    assert arc.evict(2, lambda k: k in t1_keys) == [2, 20]
    assert arc.sizes() == (0, 2, 2, 1)
    arc.insert(3)  # B2 hit: p -= max(|B1|/|B2|, 1) = 2
    assert arc.target_t1 == 0.0
    assert arc.list_of(3) == "T2"
    arc.check_invariants()


def test_arc_p_is_clamped_to_zero_and_capacity() -> None:
    arc: ARCPolicy[int] = ARCPolicy(1)
    arc.insert(0)
    arc.access(0)
    assert arc.evict(1, never_pinned) == [0]
    arc.insert(0)  # B2 hit at p = 0: p stays 0
    assert arc.target_t1 == 0.0
    arc.remove(0)
    arc.insert(1)
    assert arc.evict(1, never_pinned) == [1]
    arc.insert(1)  # B1 hit: p = 1
    assert arc.target_t1 == 1.0
    assert arc.evict(1, never_pinned) == [1]  # from T2 into B2
    arc.insert(5)  # new key in T1
    assert arc.evict(1, never_pinned) == [5]  # |T1| = p, but T2 is empty: T1
    arc.insert(5)  # B1 hit at p = c: p stays c
    assert arc.target_t1 == 1.0
    arc.check_invariants()


def test_arc_evicts_by_target_and_falls_back_when_pinned() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    fill(arc, range(4))
    arc.access(2)
    arc.access(3)  # T1 = [0, 1], T2 = [2, 3], p = 0
    # |T1| > p, but T1's keys are pinned: fall back to T2.
    assert arc.evict(1, lambda k: k not in (0, 1)) == [2]
    assert arc.list_of(2) == "B2"
    # Now prefer T1 again, one victim at a time, then T2 once T1 is empty.
    assert arc.evict(3, never_pinned) == [0, 1, 3]
    assert arc.sizes() == (0, 0, 2, 2)
    arc.check_invariants()


def test_arc_ghost_directory_stays_bounded_under_a_scan() -> None:
    capacity = 8
    arc: ARCPolicy[int] = ARCPolicy(capacity)
    for key in range(10 * capacity):  # a one-pass scan: every insert evicts one
        if len(arc) == capacity:
            assert len(arc.evict(1, never_pinned)) == 1
        arc.insert(key)
        arc.check_invariants()
    t1, t2, b1, b2 = arc.sizes()
    assert t1 + b1 == capacity
    assert (t2, b2) == (0, 0)


def test_arc_resists_a_scan_that_lru_does_not() -> None:
    """A hot set used repeatedly survives a long one-pass scan under ARC, not under LRU."""
    capacity = 20
    hot = list(range(10))

    def run(policy: EvictionPolicy[int]) -> int:
        def use(key: int) -> None:
            if key in policy:
                policy.access(key)
                return
            if len(policy) == capacity:
                policy.evict(1, never_pinned)
            policy.insert(key)

        for _ in range(3):
            for key in hot:
                use(key)
        for key in range(1000, 1100):  # the scan
            use(key)
        return sum(key in policy for key in hot)

    assert run(ARCPolicy(capacity)) == len(hot)
    assert run(LRUPolicy(capacity)) == 0


@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["use", "evict", "remove"]), st.integers(0, 30)),
        max_size=200,
    )
)
def test_arc_invariants_hold_for_any_workload(ops: list[tuple[str, int]]) -> None:
    capacity = 6
    arc: ARCPolicy[int] = ARCPolicy(capacity)
    for op, key in ops:
        if op == "use":
            if key in arc:
                arc.access(key)
            else:
                if len(arc) == capacity:
                    arc.evict(1, never_pinned)
                arc.insert(key)
        elif op == "evict":
            arc.evict(key % 3, lambda k: k % 2 == 0)
        else:
            arc.remove(key)
        arc.check_invariants()


# -- KVAwarePolicy ----------------------------------------------------------------------------


def test_kvaware_new_keys_go_first_and_a_second_use_protects() -> None:
    policy: KVAwarePolicy[int] = KVAwarePolicy(4)
    fill(policy, [3, 2, 1, 0])  # a request's blocks, last first: 0 is the prefix head
    policy.access(2)  # reused: protected
    assert policy.is_protected(2) and not policy.is_protected(3)
    # Probation goes first, oldest first: the request's tail (3), then 1, then 0.
    assert policy.evict(3, never_pinned) == [3, 1, 0]
    assert list(policy) == [2]


def test_kvaware_a_scan_of_one_off_blocks_cannot_flush_reused_ones() -> None:
    policy: KVAwarePolicy[int] = KVAwarePolicy(10)
    fill(policy, range(5))
    for key in range(5):
        policy.access(key)  # the shared head, reused
    for key in range(100, 200):  # one-off prefills, each making room for itself
        if len(policy) == policy.capacity:
            policy.evict(1, never_pinned)
        policy.insert(key)
    assert set(range(5)) <= set(policy)
    policy.check_invariants()


def test_kvaware_probation_ghost_hit_shrinks_the_protected_target() -> None:
    policy: KVAwarePolicy[int] = KVAwarePolicy(4, initial_protected=1.0)
    fill(policy, range(4))
    assert policy.protected_target == 4.0
    assert KVAwarePolicy(10).protected_target == 9.0  # the default starts at 90%
    assert policy.evict(1, never_pinned) == [0]
    assert policy.sizes().probation_ghosts == 1
    policy.insert(0)  # evicted from probation too early
    assert policy.is_protected(0) and policy.protected_target == 3.0


def test_kvaware_protected_ghost_hit_grows_the_target_and_evicts_protected_beyond_it() -> None:
    policy: KVAwarePolicy[int] = KVAwarePolicy(4, initial_protected=1.0)
    fill(policy, range(4))
    assert policy.evict(1, never_pinned) == [0]
    policy.insert(0)  # a probation ghost: protected, target 4 -> 3
    for key in (1, 2, 3):
        policy.access(key)
    assert policy.sizes().protected == 4 and policy.protected_target == 3.0
    assert policy.evict(1, never_pinned) == [0]  # protected exceeds its target
    assert policy.sizes().protected_ghosts == 1
    policy.insert(0)  # wanted again after leaving protection: target 3 -> 4
    assert policy.is_protected(0) and policy.protected_target == 4.0


def test_kvaware_ghost_lists_stay_bounded_and_remove_leaves_no_ghost() -> None:
    policy: KVAwarePolicy[int] = KVAwarePolicy(3, probation_ghosts=2.0, protected_ghosts=0.0)
    for key in range(50):
        if len(policy) == 3:
            policy.evict(1, never_pinned)
        policy.insert(key)
        policy.check_invariants()
    assert policy.sizes().probation_ghosts == 6 and policy.sizes().protected_ghosts == 0
    policy.remove(49)
    assert 49 not in policy and policy.sizes().probation_ghosts == 6


@pytest.mark.parametrize(
    "options",
    [
        {"probation_ghosts": -1},
        {"protected_ghosts": 65},
        {"probation_ghosts": float("nan")},
        {"initial_protected": 1.5},
    ],
)
def test_kvaware_rejects_bad_options(options: dict[str, float]) -> None:
    with pytest.raises(ValueError, match="must be"):
        KVAwarePolicy(4, **options)


def test_a_setting_that_builds_no_eviction_policy_is_refused() -> None:
    from tiering.policies.admission import resolve_admission

    with pytest.raises(ConfigError, match="not an EvictionPolicy"):
        make_policy(resolve_admission("reuse"), 4)


def test_adaptive_with_a_memory_under_one_use_keeps_its_counts_sane() -> None:
    """memory x shadow capacity < 1 made the decay negative: counts flipped sign each use."""
    import random

    policy = make_policy({"name": "adaptive", "memory": 0.1}, 4)
    draw = random.Random(1)
    for _ in range(400):
        key = draw.randrange(6)
        if key in policy:
            policy.access(key)
        else:
            if len(policy) == 4:
                policy.evict(1, lambda k: True)
            policy.insert(key)
        policy.check_invariants()
