"""The adaptive policy: the contract (state machine, derandomized), its experts and shadows,
request context (one use per request), and where it stands against LRU and ARC."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tiering.core.errors import ConfigError
from tiering.policies import (
    AdaptivePolicy,
    ARCPolicy,
    LRUPolicy,
    PolicyChoice,
    RequestAwarePolicy,
    RequestContext,
    access_with,
    insert_with,
    make_policy,
    resolve_policy,
)
from tiering.policies.base import EvictionPolicy
from tiering.replay.families import family_requests
from tiering.replay.offline import simulate_policy
from tiering.replay.trace import trace_footprint
from tiering.testing import make_policy_state_machine, make_policy_test_case

# Deterministic: a fixed example sequence wherever no timing is involved.
DERANDOMIZED = settings(derandomize=True)


class ContextDriven(AdaptivePolicy[int]):
    """Drives the request-aware path from the key-only state machine: every third use
    starts a new request, so repeated uses within one request are deduplicated."""

    def __init__(self, capacity: int, **options: object) -> None:
        super().__init__(capacity, **options)  # type: ignore[arg-type]
        self.uses = 0

    def access(self, key: int) -> None:
        self.uses += 1
        self.access_in(key, RequestContext(self.uses // 3, key % 4))

    def insert(self, key: int) -> None:
        self.uses += 1
        self.insert_in(key, RequestContext(self.uses // 3, key % 4))


def _small_shadow(capacity: int) -> AdaptivePolicy[int]:
    return AdaptivePolicy(capacity, shadow=2, memory=1.0, margin=0.0)


TestAdaptiveContract = make_policy_state_machine(
    AdaptivePolicy, capacity=6, settings=DERANDOMIZED
).TestCase
TestAdaptiveCapacityOne = make_policy_test_case(AdaptivePolicy, capacity=1, settings=DERANDOMIZED)
# Sampled shadows (rate > 1) and a margin of 0: the experts switch often.
TestAdaptiveSampledShadows = make_policy_test_case(
    _small_shadow, capacity=8, key_space=30, settings=DERANDOMIZED
)
TestAdaptiveKVAwareExpert = make_policy_test_case(
    lambda c: AdaptivePolicy(c, expert="kvaware", margin=0.0), capacity=5, settings=DERANDOMIZED
)
TestAdaptiveWithRequests = make_policy_test_case(
    lambda c: ContextDriven(c, margin=0.0), capacity=6, settings=DERANDOMIZED
)


def all_keys(_key: object) -> bool:
    return True


def test_registered_as_a_builtin_with_options() -> None:
    choice = resolve_policy("Adaptive(expert=kvaware,shadow=64)")
    assert choice.factory is AdaptivePolicy and choice.label.startswith("adaptive(")
    policy = make_policy("adaptive", 10)
    assert isinstance(policy, AdaptivePolicy) and isinstance(policy, RequestAwarePolicy)


@pytest.mark.parametrize(
    "options",
    [
        {"expert": "lfu"},
        {"shadow": 0},
        {"shadow": True},
        {"memory": 0},
        {"memory": float("nan")},
        {"margin": -0.1},
        {"margin": 2},
        {"start": "arc"},
        {"evidence": -1},
    ],
)
def test_bad_options_are_config_errors(options: dict[str, object]) -> None:
    with pytest.raises(ConfigError, match="rejected its options"):
        resolve_policy({"name": "adaptive", **options})


def test_a_hot_set_under_a_scan_follows_the_reuse_expert() -> None:
    """Four hot keys used every round, eight one-off keys per round: LRU loses the hot keys
    every round, ARC keeps them, and the shadows say so."""
    policy: AdaptivePolicy[int] = AdaptivePolicy(8, margin=0.0)
    new = 100
    for _ in range(30):
        for key in range(4):
            if key in policy:
                policy.access(key)
            else:
                _store(policy, key)
            policy.access(key)  # a second use in the round: ARC protects it
        for _ in range(8):
            _store(policy, new)
            new += 1
    lru_hits, reuse_hits = policy.shadow_hits()
    assert reuse_hits > lru_hits and policy.following == "reuse"
    assert all(key in policy for key in range(4))
    policy.check_invariants()


def test_recency_ahead_follows_lru() -> None:
    """The scan-heavy family at 10% of its footprint, where LRU is ahead of ARC (follow-ups on
    recent documents): the shadows see it and LRU chooses victims for most of the run."""
    seen: list[str] = []

    class Recording(AdaptivePolicy[int]):
        def evict(self, n: int, can_evict: Callable[[int], bool]) -> list[int]:
            seen.append(self.following)
            return super().evict(n, can_evict)

    requests = family_requests("scan-heavy", 800, 0)
    capacity = max(1, int(trace_footprint(requests) * 0.1))
    simulate_policy(requests, capacity, PolicyChoice("recording", Recording))
    assert seen.count("lru") > len(seen) / 2


def _store(policy: EvictionPolicy[int], key: int) -> None:
    if len(policy) >= policy.capacity:
        assert len(policy.evict(1, all_keys)) == 1
    policy.insert(key)


def test_following_lru_evicts_in_lru_order_and_keeps_the_expert_in_step() -> None:
    policy: AdaptivePolicy[int] = AdaptivePolicy(4)
    policy._follow_lru = True  # what the shadows decide; the order is what is tested
    for key in (3, 2, 1, 0):  # a request's blocks, last block first
        policy.insert(key)
    policy.access(3)
    assert policy.evict(2, all_keys) == [2, 1]
    assert policy.evict(5, lambda k: k != 0) == [3]
    assert list(policy) == [0]
    policy.check_invariants()


def test_following_the_reuse_expert_evicts_tails_before_heads() -> None:
    """Stored last block first, a prefix leaves from its tail: 4, 3, ... before 0."""
    policy: AdaptivePolicy[int] = AdaptivePolicy(8)
    for key in (4, 3, 2, 1, 0):
        policy.insert(key)
    assert policy.following == "reuse"
    assert policy.evict(2, all_keys) == [4, 3]
    policy.check_invariants()


def test_one_use_per_request() -> None:
    policy: AdaptivePolicy[int] = AdaptivePolicy(4, shadow=4)
    insert_with(policy, 7, RequestContext("r1", position=0))
    before = policy.shadow_hits()
    for _ in range(5):  # vLLM touches once per decoded block
        access_with(policy, 7, RequestContext("r1", position=0))
    assert policy.shadow_hits() == before
    access_with(policy, 7, RequestContext("r2", position=0))
    assert policy.shadow_hits()[0] > before[0] * policy._decay
    policy.remove(7)
    assert 7 not in policy and not policy._last_request
    policy.check_invariants()


def test_key_only_policies_take_plain_calls() -> None:
    lru: LRUPolicy[int] = LRUPolicy(3)
    insert_with(lru, 1, RequestContext("r"))
    insert_with(lru, 2, None)
    access_with(lru, 1, RequestContext("r", position=0, group=1))
    assert list(lru) == [2, 1]


def test_request_aware_defaults_fall_back_to_key_calls() -> None:
    class Plain(RequestAwarePolicy[int], LRUPolicy[int]):
        pass

    policy = Plain(2)
    policy.insert_in(1, RequestContext("r"))
    policy.insert_in(2, RequestContext("r"))
    policy.access_in(1, RequestContext("r"))
    assert list(policy) == [2, 1]


def test_decode_touches_do_not_move_a_request_aware_policy() -> None:
    """Touching a request's blocks once per decoded block counts as one use for adaptive:
    one decode pass or many give the same hits (the repeated touches only keep the
    request's blocks most recently used, head last); a key-only frequency policy counts
    the decode touches as uses."""
    requests = [
        dataclasses.replace(r, output_length=8 * 512) for r in family_requests("builtin", 400, 0)
    ]
    one_pass = [dataclasses.replace(r, output_length=1) for r in requests]
    capacity = max(1, trace_footprint(requests) // 50)
    many = simulate_policy(requests, capacity, "adaptive", decode_touches=True)
    once = simulate_policy(one_pass, capacity, "adaptive", decode_touches=True)
    assert many == once
    assert simulate_policy(requests, capacity, "kvaware", decode_touches=True) != (
        simulate_policy(requests, capacity, "kvaware")
    )


@pytest.mark.parametrize(
    ("family", "fraction"),
    [("builtin", 0.01), ("builtin", 0.5), ("chat-long", 0.02), ("scan-heavy", 0.05)],
)
def test_close_to_the_better_of_lru_and_arc(family: str, fraction: float) -> None:
    """A regression guard on small generated workloads (deterministic): within a point of
    max(LRU, ARC) where one of them is far ahead of the other."""
    requests = family_requests(family, 800, 0)
    capacity = max(1, int(trace_footprint(requests) * fraction))
    rates = {
        name: simulate_policy(requests, capacity, name).token_hit_rate
        for name in ("lru", "arc", "adaptive")
    }
    assert rates["adaptive"] >= max(rates["lru"], rates["arc"]) - 0.01, rates


def test_capacity_one_stores_and_evicts() -> None:
    policy: AdaptivePolicy[int] = AdaptivePolicy(1)
    for key in range(5):
        _store(policy, key)
        assert list(policy) == [key]
    policy.check_invariants()


@pytest.mark.parametrize("follow", ["lru", "reuse"])
@pytest.mark.parametrize("expert", ["arc", "kvaware"])
def test_a_request_touching_again_protects_the_block_like_lru(follow: str, expert: str) -> None:
    """A block a request looked up again (touched before its read) is the most recently used,
    as under LRU: the next evictions take the blocks stored since, not it. The repeated touch
    is not a second use (the reuse expert keeps the block among those seen once)."""
    policy: AdaptivePolicy[int] = AdaptivePolicy(4, expert=expert, start=follow)
    lru: LRUPolicy[int] = LRUPolicy(4)
    for each in (policy, lru):
        insert_with(each, 0, RequestContext("r1"))  # r1 stores block 0
        for key in (1, 2, 3):  # other requests store after it
            insert_with(each, key, RequestContext(f"s{key}"))
        access_with(each, 0, RequestContext("r1"))  # r1 looks block 0 up again
        assert each.evict(3, all_keys) == [1, 2, 3]
        assert list(each) == [0]
    assert policy.following == follow
    assert 0 in policy._reuse
    if expert == "arc":
        assert policy._reuse.list_of(0) == "T1"  # type: ignore[union-attr]
    else:
        assert not policy._reuse.is_protected(0)  # type: ignore[union-attr]
    policy.check_invariants()


@pytest.mark.parametrize("guided", [True, False])
def test_exact_shadows_guide_the_victims_after_a_switch(guided: bool) -> None:
    """With exact shadows (rate 1), following LRU evicts first the resident key the LRU shadow
    (LRU alone on the same uses) has dropped, not the oldest of the resident set's own LRU
    order: the resident set becomes what LRU alone would hold. Unguided, the resident order."""
    policy: AdaptivePolicy[str] = AdaptivePolicy(2, guided=guided)
    assert policy.sample_rate == 1 and policy.following == "reuse"
    insert_with(policy, "a", RequestContext("r"))
    access_with(policy, "a", RequestContext("s"))  # a second use: ARC protects a
    insert_with(policy, "b", RequestContext("r"))
    assert policy.evict(1, all_keys) == ["b"]  # ARC's victim
    insert_with(policy, "c", RequestContext("t"))  # LRU alone would have dropped a, not b
    access_with(policy, "a", RequestContext("s"))  # the same request again: no use, a refresh
    assert list(policy) == ["c", "a"]
    policy._follow_lru = True  # what the shadows decide; the victim is what is tested
    assert policy.evict(1, all_keys) == (["a"] if guided else ["c"])
    policy.check_invariants()


def test_guided_takes_a_bool() -> None:
    with pytest.raises(ConfigError, match="rejected its options"):
        resolve_policy({"name": "adaptive", "guided": "yes"})
    assert make_policy("adaptive(guided=false)", 10) is not None


@DERANDOMIZED
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["use", "evict", "remove"]), st.integers(0, 30)),
        max_size=200,
    )
)
def test_arc_evict_one_is_evict_of_one_unpinned(ops: list[tuple[str, int]]) -> None:
    """The shadows' single-victim eviction (ARCPolicy.evict_one) picks what evict(1) picks
    when every key is evictable, and leaves ARC in the same state (lists, ghosts, p)."""
    capacity = 6
    one: ARCPolicy[int] = ARCPolicy(capacity)
    listed: ARCPolicy[int] = ARCPolicy(capacity)
    for op, key in ops:
        if op == "use":
            if key in one:
                one.access(key)
                listed.access(key)
            else:
                if len(one) == capacity:
                    assert one.evict_one() == listed.evict(1, all_keys)[0]
                one.insert(key)
                listed.insert(key)
        elif op == "evict" and len(one):
            assert one.evict_one() == listed.evict(1, all_keys)[0]
        else:
            one.remove(key)
            listed.remove(key)
        assert one.sizes() == listed.sizes() and one.target_t1 == listed.target_t1
        assert [one.list_of(k) for k in range(31)] == [listed.list_of(k) for k in range(31)]
        one.check_invariants()
    empty: ARCPolicy[int] = ARCPolicy(2)
    with pytest.raises(KeyError):
        empty.evict_one()


def test_arc_evict_one_takes_t1_above_p_else_t2() -> None:
    arc: ARCPolicy[int] = ARCPolicy(4)
    for key in range(4):
        arc.insert(key)
    arc.access(2)
    arc.access(3)  # T1 = [0, 1], T2 = [2, 3], p = 0
    assert arc.evict_one() == 0 and arc.list_of(0) == "B1"
    arc.insert(0)  # a B1 ghost: p grows to 1, 0 joins T2
    assert arc.target_t1 == 1.0 and arc.sizes()[:2] == (1, 3)
    assert arc.evict_one() == 2 and arc.list_of(2) == "B2"  # |T1| = 1 <= p: from T2
    for key in (3, 0):
        assert arc.evict_one() == key
    assert arc.evict_one() == 1  # T2 empty: T1 after all
