"""Request filters in our manager: ``kv_load_tiers``, ``kv_store_tiers``, tier locality and events.

Two in-memory tiers that declare different media and localities: a CPU tier
that is local and a storage tier that is remote. A request's filter decides
which of them it may load from or cascade to; the CPU primary tier is always
consulted. Events carry the tier's locality and stop for a tier whose
``enable_kv_events`` is off.
"""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.manager_helpers import key, make_primary, settle, store
from tiering.core.keys import NO_CONTEXT, ReqContext
from tiering.manager import TieringOffloadingManager
from tiering.manager.filters import ALL, TierFilter, TierMatcher, parse_tier_filter
from tiering.registry import create_secondary_tier


def build(**tier_overrides: Any) -> TieringOffloadingManager:
    primary = make_primary(8)
    near = {"type": "memory", "name": "near", "locality": "local"}
    far = {"type": "memory", "name": "far", "medium": "storage", "locality": "REMOTE"}
    near.update(tier_overrides.get("near", {}))
    far.update(tier_overrides.get("far", {}))
    tiers = [
        create_secondary_tier(entry, primary.kv_view, position=i)
        for i, entry in enumerate((near, far))
    ]
    return TieringOffloadingManager(primary, tiers, metrics_registry=False)


def request(**params: Any) -> ReqContext:
    return ReqContext(req_id="r", kv_transfer_params=params)


def evict_primary(manager: TieringOffloadingManager, start: int = 1000) -> None:
    """Store unrelated blocks until the primary tier holds none of the earlier ones."""
    for i in range(start, start + 16, 4):
        store(manager, [key(j) for j in range(i, i + 4)])
        settle(manager)


TIER_NAMES = ("near", "far")


def source_of(manager: TieringOffloadingManager, k: bytes, ctx: ReqContext) -> str | None:
    """Which tier a lookup promotes ``k`` from (None: a miss)."""
    before = [t.hits for t in manager.stats().secondary]
    answer = manager.lookup(k, ctx)
    after = [t.hits for t in manager.stats().secondary]
    if answer is False:
        return None
    assert answer is None  # a promotion started
    (served,) = [i for i, (b, a) in enumerate(zip(before, after, strict=True)) if a > b]
    return TIER_NAMES[served]


# -- parsing (vLLM 0.33's _parse_tier_filter rules) ----------------------------------------


def test_parsing_follows_vllms_rules(caplog: pytest.LogCaptureFixture) -> None:
    assert parse_tier_filter([{"medium": "cpu"}]) == TierFilter((TierMatcher("CPU", None),))
    assert parse_tier_filter([{"medium": "Storage", "locality": "local"}]) == TierFilter(
        (TierMatcher("STORAGE", "LOCAL"),)
    )
    assert parse_tier_filter([]) == TierFilter(())  # explicitly nothing
    with caplog.at_level(logging.WARNING, logger="tiering.manager"):
        assert parse_tier_filter("cpu") is ALL  # not a list: every tier
        assert parse_tier_filter([{"medium": "GPU"}, "x"]) is ALL  # all skipped: every tier
        mixed = parse_tier_filter([{"medium": "GPU"}, {"locality": "remote"}])
    assert mixed == TierFilter((TierMatcher(None, "REMOTE"),))
    assert len(caplog.records) == 4
    undeclared = TierMatcher("CPU", "LOCAL")
    assert undeclared.matches(None, None)  # a tier that declares nothing matches anything


# -- loads ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kv_load_tiers", "expected"),
    [
        (None, "near"),  # no filter: tiers in order
        ([{"medium": "STORAGE"}], "far"),
        ([{"locality": "remote"}], "far"),
        ([{"medium": "CPU", "locality": "LOCAL"}], "near"),
        ([{"medium": "CPU", "locality": "REMOTE"}], None),  # no tier is both
        ([], None),  # nothing but the primary tier
        ([{"medium": "GPU"}], "near"),  # every entry invalid: every tier
    ],
)
def test_kv_load_tiers_chooses_the_tiers_a_request_loads_from(
    kv_load_tiers: Any, expected: str | None
) -> None:
    manager = build()
    held = [key(i) for i in range(4)]
    store(manager, held)
    settle(manager)
    evict_primary(manager)
    ctx = NO_CONTEXT if kv_load_tiers is None else request(kv_load_tiers=kv_load_tiers)
    assert source_of(manager, held[0], ctx) == expected
    manager.shutdown()


# -- stores --------------------------------------------------------------------------------


def test_kv_store_tiers_chooses_the_tiers_a_request_is_cascaded_to() -> None:
    manager = build()
    remote_only = request(kv_store_tiers=[{"locality": "REMOTE"}])
    store(manager, [key(i) for i in range(3)], remote_only)
    store(manager, [key(i) for i in range(3, 5)])  # unfiltered: both tiers
    store(manager, [key(9)], request(kv_store_tiers=[]))  # the primary tier only
    settle(manager)
    near, far = manager.stats().secondary
    assert (near.cascades, far.cascades) == (2, 5)
    manager.shutdown()


def test_kv_store_tiers_holds_for_an_admission_policys_late_cascades_too() -> None:
    """A block admitted on its reuse is cascaded in the using request's context: its filter."""
    from tiering.policies.admission import ReuseAdmission

    primary = make_primary(8)
    far = {"type": "memory", "name": "far", "medium": "storage", "locality": "REMOTE"}
    tiers = [create_secondary_tier(far, primary.kv_view, position=0)]
    manager = TieringOffloadingManager(
        primary, tiers, metrics_registry=False, cascade_admission=ReuseAdmission(8)
    )
    primary_only, anyone = request(kv_store_tiers=[]), request()
    mine, shared = [key(1), key(2)], [key(3), key(4)]
    store(manager, mine + shared, primary_only)
    manager.touch(mine, primary_only)  # reuse admits them, but not for this request's tiers
    settle(manager)
    assert manager.stats().secondary[0].cascades == 0
    manager.touch(shared, anyone)  # another request's use, without a filter: cascaded
    settle(manager)
    assert manager.stats().secondary[0].cascades == 2
    manager.shutdown()


def test_kv_store_tiers_holds_for_backfill_after_a_load() -> None:
    """A block promoted from 'far' is backfilled into 'near' only if the request allows it."""
    manager = build()  # backfill_earlier_tiers is on by default
    remote_only = request(kv_store_tiers=[{"locality": "REMOTE"}])
    store(manager, [key(1)], remote_only)
    settle(manager)
    evict_primary(manager)
    near_before = manager.stats().secondary[0].cascades
    assert source_of(manager, key(1), remote_only) == "far"
    settle(manager)
    assert manager.stats().secondary[0].cascades == near_before  # no backfill into near
    evict_primary(manager, start=2000)
    near_before = manager.stats().secondary[0].cascades
    assert source_of(manager, key(1), request()) == "far"  # a request without a filter
    settle(manager)
    assert manager.stats().secondary[0].cascades == near_before + 1  # backfilled
    manager.shutdown()


# -- identity and events -------------------------------------------------------------------


def test_tiers_declare_medium_and_locality_and_events_say_where() -> None:
    manager = build(near={"enable_kv_events": False})
    near, far = manager.secondary_tiers
    assert (near.medium, near.locality, near.events_enabled) == ("CPU", "LOCAL", False)
    assert (far.medium, far.locality, far.events_enabled) == ("STORAGE", "REMOTE", True)
    list(manager.take_events())
    store(manager, [key(1), key(2)])
    settle(manager)
    secondary = [e for e in manager.take_events() if e.medium != "CPU"]
    assert {(e.medium, e.locality) for e in secondary} == {("memory", "REMOTE")}
    manager.shutdown()


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"medium": "GPU"}, "medium must be 'STORAGE' or 'CPU', got 'GPU'"),
        ({"locality": "nearby"}, "locality must be 'LOCAL' or 'REMOTE', got 'nearby'"),
        ({"enable_kv_events": "yes"}, "enable_kv_events must be true or false, got 'yes'"),
    ],
)
def test_a_bad_identity_is_refused_naming_the_key(entry: dict[str, Any], message: str) -> None:
    from tiering.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        create_secondary_tier({"type": "memory", **entry}, make_primary(8).kv_view, position=0)


def test_tiers_are_labelled_by_their_configured_names() -> None:
    """docs/metrics.md: the `tier` label is each secondary tier's name."""
    from types import SimpleNamespace

    from tiering.manager.state import tier_names

    def tier(kind: str, name: str) -> Any:
        return SimpleNamespace(tier_type=kind, name=name)

    named = [tier("fs", "nvme0"), tier("fs", "nvme1"), tier("memory", "memory-2")]
    assert tier_names(named) == ["nvme0", "nvme1", "memory"]  # memory-2: the default name
    unnamed = [tier("fs", "fs-0"), tier("fs", "fs-1"), tier("redis", "cpu")]
    assert tier_names(unnamed) == ["fs#0", "fs#1", "cpu#2"]  # "cpu" is the primary's label
