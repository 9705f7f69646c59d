"""Our tiers inside vLLM 0.33's own TieringOffloadingManager, configured as a user would.

Every test builds vLLM's manager with ``OffloadingSpecFactory`` ->
``TieringOffloadingSpec.get_manager()`` (CPU primary tier in shared memory)
with our tiers in ``secondary_tiers`` through ``module_path``, and drives it
only through the scheduler-facing API (:class:`SchedulerDriver`). Bytes are
written into the primary rows at store time and verified after every round
trip; the primary buffer is scrubbed after evicting, so a pass means the bytes
really came back from our tier.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import pytest
from vllm.v1.kv_offload.base import LookupResult, Medium
from vllm.v1.kv_offload.tiering.base import SecondaryTierManager, TieringOffloadingMetrics
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.vllm.conftest import preload_fsio_stubs, shut_down
from tiering.core.errors import ConfigError
from tiering.integrations.vllm import (
    MODULE_PATH,
    KVTieringFileSystemTier,
    KVTieringMemoryTier,
    KVTieringRedisTier,
    KVTieringTier,
)
from tiering.integrations.vllm.driver import (
    PatternChecker,
    SchedulerDriver,
    chained_keys,
    fill_pattern,
)
from tiering.integrations.vllm.tiers import VLLM_SHUTDOWN_TIMEOUT_S
from tiering.testing.faults import FaultPlan

BLOCK = 64 * 1024
SCRUB = 0xEE


def ours(cls: str, **options: Any) -> dict[str, Any]:
    """A ``secondary_tiers`` entry for one of our classes, as a vLLM user writes it."""
    return {"type": cls, "module_path": MODULE_PATH, **options}


class Metrics:
    """vLLM's own tiering metrics, accumulated across ``get_stats()`` calls (it resets them)."""

    def __init__(self, manager: Any) -> None:
        self.manager = manager
        self.totals: dict[tuple[str, tuple[str, ...]], float] = {}

    def collect(self) -> None:
        stats = self.manager.get_stats()
        if stats is None:
            return
        _types, values = stats.metric_sections()
        for name, series in values.items():
            for labels, value in series.items():
                amount = sum(value) if isinstance(value, list) else value
                key = (name, tuple(labels))
                self.totals[key] = self.totals.get(key, 0) + amount

    def total(self, name: str, tier_label: str) -> float:
        self.collect()
        return sum(
            v for (n, labels), v in self.totals.items() if n == name and tier_label in labels
        )


def round_trip(driver: SchedulerDriver, keys: list[bytes], name: str = "rt") -> PatternChecker:
    """Store, cascade, evict from the CPU tier, scrub it, promote back, verify every byte."""
    assert len(driver.store(f"{name}-store", keys, fill_pattern)) == len(keys)
    driver.run_until_idle()
    assert driver.evict_primary() >= len(keys)
    with driver.lock():
        for key in keys:  # really gone from the CPU tier: only our tier can serve them
            assert driver.manager.primary_tier.lookup(key, _ctx()) is LookupResult.MISS
    driver.rows[:] = SCRUB
    checker = PatternChecker()
    hits = driver.load(f"{name}-load", keys, checker)
    assert hits == len(keys), f"only {hits} of {len(keys)} blocks came back"
    assert checker.bad == [] and checker.good == len(keys)
    return checker


def _ctx() -> Any:
    from vllm.v1.kv_offload.base import ReqContext

    return ReqContext(req_id="probe")


def tier_of(manager: Any, index: int = 0) -> KVTieringTier:
    tier = manager.secondary_tiers[index]
    assert isinstance(tier, KVTieringTier)
    return tier


# -- loading through vLLM's factory ----------------------------------------------------------


@pytest.mark.parametrize(
    ("cls", "medium", "source"),
    [
        ("KVTieringFileSystemTier", Medium.STORAGE, CacheHitSource.DISK),
        ("KVTieringRedisTier", Medium.STORAGE, CacheHitSource.DISK),
        ("KVTieringMemoryTier", Medium.CPU, CacheHitSource.HOST),
        ("KVTieringTier", Medium.STORAGE, CacheHitSource.DISK),
    ],
)
def test_classes_resolve_through_vllms_factory(cls: str, medium: Any, source: Any) -> None:
    tier_class = SecondaryTierFactory.get_tier_class(ours(cls))
    assert tier_class.__module__.startswith("tiering.integrations.vllm")
    assert issubclass(tier_class, SecondaryTierManager)
    assert tier_class.medium is medium
    assert tier_class.cache_hit_source is source


# -- round trips -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "entry",
    [
        pytest.param(lambda tmp: ours("KVTieringMemoryTier"), id="memory"),
        pytest.param(
            lambda tmp: ours("KVTieringFileSystemTier", root_dir=str(tmp / "fs")), id="fs"
        ),
        pytest.param(
            lambda tmp: ours("KVTieringTier", tier="fs", root_dir=str(tmp / "fs")),
            id="generic-fs",
        ),
        pytest.param(
            lambda tmp: ours("KVTieringTier", tier="tiers.memory:MemoryTier", medium="cpu"),
            id="generic-path",
        ),
    ],
)
def test_round_trip_through_vllms_manager(make_manager: Any, tmp_path: Any, entry: Any) -> None:
    manager, driver = make_manager([entry(tmp_path)])
    tier = tier_of(manager)
    metrics = Metrics(manager)
    label = f"1:{tier.tier_type}"
    first, second = chained_keys("prompt-a", 12), chained_keys("prompt-b", 8)

    round_trip(driver, first, "a")
    round_trip(driver, second, "b")

    expected = CacheHitSource.HOST if tier.medium is Medium.CPU else CacheHitSource.DISK
    assert driver.last_load_sources == [expected] * len(second)
    stats = tier.stats()
    assert stats.blocks_stored == 20 and stats.blocks_loaded == 20
    assert stats.jobs_failed == 0
    # vLLM's own metrics saw our results: bytes both ways, times, no failures.
    assert metrics.total(TieringOffloadingMetrics.WRITE_BYTES, label) == 20 * BLOCK
    assert metrics.total(TieringOffloadingMetrics.READ_BYTES, label) == 20 * BLOCK
    assert metrics.total(TieringOffloadingMetrics.WRITE_TIME, label) > 0
    assert metrics.total(TieringOffloadingMetrics.PROMOTION_JOB_FAILURES, label) == 0
    assert metrics.total(TieringOffloadingMetrics.CASCADE_JOB_FAILURES, label) == 0

    # Already in the CPU tier now: a plain HIT, served without our tier.
    checker = PatternChecker()
    assert driver.load("again", second, checker) == len(second) and checker.bad == []
    assert tier.stats().blocks_loaded == 20
    # A prompt that was never stored is a clean miss.
    assert driver.load("never", chained_keys("prompt-c", 4), PatternChecker()) == 0


def test_store_of_blocks_the_tier_holds_moves_no_bytes(make_manager: Any) -> None:
    manager, driver = make_manager([ours("KVTieringMemoryTier")])
    keys = chained_keys("dup", 6)
    round_trip(driver, keys)
    # Evict again, then store the same prompt: vLLM cascades it again, our tier skips it.
    driver.evict_primary()
    driver.store("again", keys, fill_pattern)
    driver.run_until_idle()
    stats = tier_of(manager).stats()
    assert stats.blocks_stored == 6 and stats.store_jobs_submitted == 2


def test_partial_prefix_hit_and_touch(make_manager: Any) -> None:
    manager, driver = make_manager([ours("KVTieringMemoryTier", capacity_blocks=64)])
    keys = chained_keys("prefix", 10)
    driver.store("s", keys[:6], fill_pattern)
    driver.run_until_idle()
    driver.evict_primary()
    driver.rows[:] = SCRUB
    checker = PatternChecker()
    assert driver.load("l", keys, checker) == 6 and checker.good == 6 and checker.bad == []
    with driver.lock():
        manager.touch(keys[:6], _ctx())  # reaches our tier's policy, in the background
    assert tier_of(manager).stats().jobs_failed == 0


# -- persistence and layout ------------------------------------------------------------------


def test_fs_tier_serves_blocks_after_a_restart_and_never_another_layout(
    make_manager: Any, tmp_path: Any
) -> None:
    entry = ours("KVTieringFileSystemTier", root_dir=str(tmp_path / "fs"))
    keys = chained_keys("persist", 10)
    manager, driver = make_manager([entry])
    driver.store("s", keys, fill_pattern)
    driver.run_until_idle()
    shut_down(manager, driver)

    # A fresh engine on the same root: the blocks come back from disk, byte-exact.
    manager, driver = make_manager([entry])
    assert tier_of(manager).stats().blocks_held == 10
    checker = PatternChecker()
    assert driver.load("after-restart", keys, checker) == 10
    assert checker.good == 10 and checker.bad == []
    assert driver.last_load_sources == [CacheHitSource.DISK] * 10
    shut_down(manager, driver)

    # Another model on the same root: its layout fingerprint differs, nothing is served.
    manager, driver = make_manager([entry], model="another/model")
    assert driver.load("other-model", keys, PatternChecker()) == 0


# -- events ----------------------------------------------------------------------------------


def test_events_carry_medium_ownership_and_evictions(make_manager: Any) -> None:
    manager, driver = make_manager(
        [ours("KVTieringMemoryTier", capacity_blocks=8, enable_kv_events=True, locality="local")],
        enable_kv_cache_events=True,
    )
    tier = tier_of(manager)
    keys = chained_keys("events", 20)
    driver.store("first", keys[:5], fill_pattern)
    driver.run_until_idle()
    driver.store("rest", keys[5:], fill_pattern)  # one cascade bigger than the tier
    driver.run_until_idle()
    assert tier_of(manager).stats().blocks_held == 8
    with driver.lock():
        events = [e for e in manager.take_events() if e.ownership == tier.tier_type]
    # Replaying the events gives exactly what the tier holds (vLLM's event tracker
    # relies on it): the 8 last blocks, the others stored and then removed or never
    # announced (a block evicted by the same cascade that wrote it).
    held: set[bytes] = set()
    for event in events:
        if event.removed:
            assert set(event.keys) <= held, "a removal of a block never announced as stored"
            held -= set(event.keys)
        else:
            held |= set(event.keys)
    assert held == set(keys[-8:])
    removed = [k for e in events if e.removed for k in e.keys]
    assert set(removed) <= set(keys[:5])  # the first cascade's blocks, evicted by the second
    for event in events:
        assert event.medium is Medium.CPU
        assert event.locality is not None and event.locality.value == "LOCAL"
        assert event.removal_expected
    # What the tier evicted is a miss for vLLM too (after the CPU tier lets go of it).
    driver.evict_primary()
    assert driver.load("gone", [keys[0]], PatternChecker()) == 0


def test_events_stay_off_when_vllm_has_them_disabled(
    make_manager: Any, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="tiering.integrations.vllm"):
        manager, driver = make_manager([ours("KVTieringMemoryTier", enable_kv_events=True)])
    assert "disabled globally" in caplog.text
    driver.store("s", chained_keys("quiet", 4), fill_pattern)
    driver.run_until_idle()
    with driver.lock():
        assert list(tier_of(manager).take_events()) == []


# -- failures vLLM must see cleanly ----------------------------------------------------------


def faulty(**options: Any) -> dict[str, Any]:
    return ours("KVTieringTier", tier="tests.vllm.faulty:FaultyMemoryTier", **options)


def set_plan(manager: Any, plan: FaultPlan) -> Any:
    inner = tier_of(manager).runtime.tier
    inner.plan = plan
    return inner


def test_failed_promotion_is_a_miss_not_a_livelock_nor_wrong_bytes(make_manager: Any) -> None:
    manager, driver = make_manager([faulty(failed_load_backoff_s=0.3)])
    metrics = Metrics(manager)
    label = f"1:{tier_of(manager).tier_type}"
    keys = chained_keys("doomed", 6)
    driver.store("s", keys, fill_pattern)
    driver.run_until_idle()
    driver.evict_primary()
    driver.rows[:] = SCRUB
    inner = set_plan(manager, FaultPlan(error_rate=1.0, ops={"read"}))

    steps_before = driver.steps
    assert driver.load("fails", keys, PatternChecker(), timeout_s=10) == 0
    assert driver.steps - steps_before < 20  # resolved to MISS, not retried every step
    assert inner.injected["error:read"] >= 1
    assert metrics.total(TieringOffloadingMetrics.PROMOTION_JOB_FAILURES, label) >= 1
    with driver.lock():
        for key in keys:
            assert manager.primary_tier.lookup(key, _ctx()) is LookupResult.MISS

    # Once the backoff is over and the tier reads again, the blocks come back intact.
    inner.plan = FaultPlan()
    time.sleep(0.35)
    checker = PatternChecker()
    assert driver.load("recovered", keys, checker) == 6
    assert checker.good == 6 and checker.bad == []


def test_partial_promotion_failure_keeps_the_blocks_that_loaded(make_manager: Any) -> None:
    manager, driver = make_manager([faulty()])
    keys = chained_keys("partial", 8)
    driver.store("s", keys, fill_pattern)
    driver.run_until_idle()
    driver.evict_primary()
    driver.rows[:] = SCRUB
    set_plan(manager, FaultPlan(error_rate=1.0, ops={"read"}, keys={keys[5]}))

    checker = PatternChecker()
    assert driver.load("partial", keys, checker) == 5  # the prefix stops at the failed block
    assert checker.good == 5 and checker.bad == []
    with driver.lock():
        # vLLM kept what loaded after the failed block too (successful_keys).
        assert manager.primary_tier.lookup(keys[6], _ctx()) is LookupResult.HIT
        assert manager.primary_tier.lookup(keys[5], _ctx()) is LookupResult.MISS


def test_corrupt_block_is_dropped_and_missed(make_manager: Any) -> None:
    manager, driver = make_manager([faulty()])
    keys = chained_keys("corrupt", 4)
    driver.store("s", keys, fill_pattern)
    driver.run_until_idle()
    driver.evict_primary()
    driver.rows[:] = SCRUB
    set_plan(manager, FaultPlan(corrupt_rate=1.0, detect=True, ops={"read"}, keys={keys[0]}))
    assert driver.load("corrupt", keys, PatternChecker()) == 0
    stats = tier_of(manager).stats()
    assert stats.corrupt_reads == 1 and stats.blocks_held == 3  # dropped from our tier


def test_failed_cascade_is_counted_and_releases_the_cpu_chunks(make_manager: Any) -> None:
    manager, driver = make_manager([faulty()])
    metrics = Metrics(manager)
    label = f"1:{tier_of(manager).tier_type}"
    set_plan(manager, FaultPlan(error_rate=1.0, ops={"write"}))
    keys = chained_keys("unwritable", 6)
    driver.store("s", keys, fill_pattern)
    driver.run_until_idle()
    assert metrics.total(TieringOffloadingMetrics.CASCADE_JOB_FAILURES, label) == 1
    assert metrics.total(TieringOffloadingMetrics.WRITE_BYTES, label) == 0
    assert driver.evict_primary() >= 6  # the cascade's pins were released
    assert driver.load("l", keys, PatternChecker()) == 0


def test_hung_tier_fails_at_the_job_deadline(make_manager: Any) -> None:
    manager, driver = make_manager([faulty(job_timeout_s=0.5)])
    metrics = Metrics(manager)
    label = f"1:{tier_of(manager).tier_type}"
    set_plan(manager, FaultPlan(hang_rate=1.0, ops={"write"}))
    driver.store("s", chained_keys("hang", 4), fill_pattern)
    driver.run_until_idle(timeout_s=10)
    assert metrics.total(TieringOffloadingMetrics.CASCADE_JOB_FAILURES, label) == 1
    assert tier_of(manager).stats().timeouts == 1


def test_reset_cache_drains_jobs_in_flight(make_manager: Any) -> None:
    manager, driver = make_manager([faulty()])
    set_plan(manager, FaultPlan(delay_rate=1.0, delay_s=0.2, ops={"write"}))
    keys = chained_keys("reset", 8)
    driver.store("s", keys, fill_pattern)
    tier = tier_of(manager)
    assert tier.has_pending_work()  # the cascade is still writing
    with driver.lock():
        manager.reset_cache()  # drain_jobs blocks until our writes finished
        assert not manager.has_pending_work()
        manager.on_reset_flushed()
    stats = tier.stats()
    assert stats.jobs_in_flight == 0 and stats.blocks_stored == 8
    # The CPU tier was reset; our tier kept the blocks and serves them.
    driver.rows[:] = SCRUB
    checker = PatternChecker()
    assert driver.load("after-reset", keys, checker) == 8 and checker.bad == []


# -- construction and shutdown ---------------------------------------------------------------


def test_shutdown_stops_our_thread_and_lets_vllm_unmap_the_buffer(make_manager: Any) -> None:
    manager, driver = make_manager([ours("KVTieringMemoryTier", name="bye")])
    round_trip(driver, chained_keys("bye", 4))
    assert any(t.name == "tier-bye" for t in threading.enumerate())
    region = manager.primary_tier._mmap_region
    tier = tier_of(manager)
    shut_down(manager, driver)
    assert not any(t.name == "tier-bye" for t in threading.enumerate())
    assert tier.runtime.closed
    assert region.mmap_obj is None, "a view of the primary buffer outlived shutdown"
    tier.shutdown()  # idempotent
    assert list(tier.get_finished_jobs()) == [] and not tier.has_pending_work()


def test_the_cpus_key_pins_our_loop_thread(make_manager: Any) -> None:
    cpu = max(os.sched_getaffinity(0))
    manager, driver = make_manager([ours("KVTieringMemoryTier", name="pinned", cpus=[cpu])])
    (thread,) = [t for t in threading.enumerate() if t.name == "tier-pinned"]
    assert thread.native_id is not None and os.sched_getaffinity(thread.native_id) == {cpu}
    round_trip(driver, chained_keys("pinned", 4))
    shut_down(manager, driver)


def test_fs_tier_lets_vllm_unmap_the_buffer(make_manager: Any, tmp_path: Any) -> None:
    manager, driver = make_manager([ours("KVTieringFileSystemTier", root_dir=str(tmp_path))])
    round_trip(driver, chained_keys("fs-bye", 4))
    region = manager.primary_tier._mmap_region
    shut_down(manager, driver)
    assert region.mmap_obj is None, "a view of the primary buffer outlived shutdown"


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        (ours("KVTieringMemoryTier", capacity_blockz=4), "capacity_blockz"),
        (ours("KVTieringTier"), "needs a 'tier' option"),
        (ours("KVTieringTier", tier="no.such.module:Tier"), "no.such.module"),
        (ours("KVTieringMemoryTier", tier="fs"), "drop the 'tier' option"),
        (ours("KVTieringTier", tier="memory", medium="tape"), "medium"),
        (ours("KVTieringMemoryTier", locality="moon"), "locality"),
        (ours("KVTieringMemoryTier", failed_load_backoff_s=-1), "failed_load_backoff_s"),
        (ours("KVTieringMemoryTier", cpus=[]), "cpus must name at least one CPU"),
        (ours("KVTieringFileSystemTier"), "root_dir"),
    ],
)
def test_bad_config_fails_get_manager_with_a_clear_error(
    make_manager: Any, entry: dict[str, Any], message: str
) -> None:
    threads_before = {t.name for t in threading.enumerate()}
    with pytest.raises(ConfigError, match=message):
        make_manager([entry])
    leaked = {t.name for t in threading.enumerate()} - threads_before
    assert not {n for n in leaked if n.startswith("tier-")}


def test_config_errors_name_the_tiers_position(make_manager: Any) -> None:
    entries = [ours("KVTieringMemoryTier"), ours("KVTieringMemoryTier", capacity_blokcs=1)]
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\].*capacity_blokcs"):
        make_manager(entries)


def test_vllms_backpressure_detector_fed_by_our_jobs_drops_stores_to_a_slow_tier(
    make_manager: Any,
) -> None:
    """vLLM's EMA detector, configured for our tier, sees our jobs' transfer times: with a
    high-water mark no real store can meet, the tier goes under pressure after its second
    store (the first seeds the EMA) and vLLM drops the cascades that follow (our tier never
    sees them)."""
    entry = ours(
        "KVTieringMemoryTier",
        backpressure={
            "backpressure_cls": "EMABackpressureDetector",
            "high_water_s": 1e-12,
            "low_water_s": 1e-13,
            "warmup_completions": 1,
            "decay_half_life_s": 3600.0,
        },
    )
    manager, driver = make_manager([entry])
    tier = tier_of(manager)
    assert tier._pinned_share is None  # vLLM's detector replaces our default
    round_trip(driver, chained_keys("bp-first", 4))  # promotions are not stores: no sample
    driver.store("bp-second", chained_keys("bp-second", 4), fill_pattern)
    driver.run_until_idle()
    assert tier.stats().store_jobs_submitted == 2
    assert tier.bp_detector.is_under_pressure()
    assert tier.bp_detector.stats["store_latency_ema"] > 1e-12
    stores_before = tier.stats().store_jobs_submitted
    for prompt in range(3):
        driver.store(f"bp-{prompt}", chained_keys(f"bp-{prompt}", 4), fill_pattern)
    driver.run_until_idle()
    assert tier.stats().store_jobs_submitted == stores_before  # every cascade dropped


def test_ours_next_to_vllms_own_fs_tier(make_manager: Any, tmp_path: Any) -> None:
    preload_fsio_stubs()
    manager, driver = make_manager(
        [
            {"type": "fs", "root_dir": str(tmp_path / "vllm-fs")},
            ours("KVTieringFileSystemTier", root_dir=str(tmp_path / "ours")),
        ]
    )
    keys = chained_keys("both", 10)
    round_trip(driver, keys)
    assert tier_of(manager, 1).stats().blocks_stored == 10  # every tier gets the cascade


# -- Redis -----------------------------------------------------------------------------------


def test_redis_tier_round_trip_and_sharing(
    make_manager: Any,
    redis_server: RedisServer,  # noqa: F811
) -> None:
    entry = ours("KVTieringRedisTier", url=redis_server.url, namespace="vllm-test")
    manager, driver = make_manager([entry])
    assert isinstance(tier_of(manager), KVTieringRedisTier)
    keys = chained_keys("redis", 8)
    round_trip(driver, keys)
    assert driver.last_load_sources == [CacheHitSource.DISK] * 8

    # Another engine on the same server finds the blocks the first one stored.
    other, other_driver = make_manager([entry])
    checker = PatternChecker()
    assert other_driver.load("shared", keys, checker) == 8
    assert checker.good == 8 and checker.bad == []
    assert tier_of(other).stats().blocks_stored == 0


def test_class_names_are_exported() -> None:
    assert {KVTieringFileSystemTier, KVTieringMemoryTier, KVTieringRedisTier} <= set(
        KVTieringTier.__subclasses__()
    )


@pytest.mark.parametrize("mac", ["ghash-aes", "blake3", "hmac-sha256"])
def test_auth_mac_reaches_our_fs_tier_through_vllms_factory(
    make_manager: Any, tmp_path: Any, monkeypatch: pytest.MonkeyPatch, mac: str
) -> None:
    monkeypatch.setenv("KVT_VLLM_AUTH_KEY", "k" * 32)
    entry = ours(
        "KVTieringFileSystemTier",
        root_dir=str(tmp_path / "fs"),
        auth_key_env="KVT_VLLM_AUTH_KEY",
        auth_mac=mac,
    )
    manager, driver = make_manager([entry])
    authenticator = tier_of(manager).runtime.tier.config.authenticator  # type: ignore[attr-defined]
    assert authenticator is not None and authenticator.mac == mac
    round_trip(driver, chained_keys(f"auth-{mac}", 4))
    bad = {**entry, "auth_mac": "md5", "root_dir": str(tmp_path / "bad")}
    with pytest.raises(
        ConfigError, match="auth_mac must be one of 'ghash-aes', 'blake3', 'hmac-sha256'"
    ):
        make_manager([bad])


def test_root_dirs_stripe_our_fs_tier_through_vllms_factory(
    make_manager: Any, tmp_path: Any
) -> None:
    roots = [str(tmp_path / "d0"), str(tmp_path / "d1")]
    entry = ours("KVTieringFileSystemTier", root_dirs=roots, capacity_bytes="4MiB")
    manager, driver = make_manager([entry])
    tier = tier_of(manager).runtime.tier  # type: ignore[attr-defined]
    assert tuple(map(str, tier.config.root_dirs)) == tuple(roots)
    keys = chained_keys("striped", 16)
    round_trip(driver, keys)
    held = {root.path: len(root.state.index) for root in tier._roots.in_service()}
    assert set(held) == set(roots) and sum(held.values()) == 16 and min(held.values()) > 0


def test_enable_kv_events_must_be_a_boolean(make_manager: Any) -> None:
    """bool("false") is True: a string must be refused, not read as events on."""
    with pytest.raises(ConfigError, match="enable_kv_events must be true or false, got 'false'"):
        make_manager([ours("KVTieringMemoryTier", enable_kv_events="false")])


def test_each_entry_gets_its_own_position(make_manager: Any) -> None:
    """Names and metric labels are vllm-<type>-<position>: entries that differ only in a
    keyword argument (medium) or not at all still get one each; errors name the right one."""
    same = ours("KVTieringTier", tier="memory", capacity_blocks=8)
    manager, _ = make_manager([same, {**same, "medium": "CPU"}, dict(same)])
    names = [tier_of(manager, i)._runtime.name for i in range(3)]
    assert names == [f"vllm-KVTieringTier-{i}" for i in range(3)]
    fs_without_root = ours("KVTieringTier", tier="fs", capacity_blocks=8)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\] \(type 'fs'\)"):
        make_manager([same, fs_without_root])


def test_process_isolation_is_refused_naming_why(make_manager: Any) -> None:
    with pytest.raises(ConfigError, match="isolation 'process' is not available inside vLLM"):
        make_manager([ours("KVTieringMemoryTier", capacity_blocks=8, isolation="process")])


def test_null_runtime_keys_take_the_defaults_inside_vllm(make_manager: Any) -> None:
    entry = ours("KVTieringMemoryTier", capacity_blocks=8, shutdown_timeout_s=None)
    manager, _ = make_manager([{**entry, "job_timeout_s": None}])
    runtime = tier_of(manager)._runtime
    assert runtime.shutdown_timeout_s == VLLM_SHUTDOWN_TIMEOUT_S and runtime.job_timeout_s == 30


def test_max_events_is_checked_even_with_events_off(make_manager: Any) -> None:
    with pytest.raises(ConfigError, match="max_events"):
        make_manager([ours("KVTieringMemoryTier", capacity_blocks=8, max_events=-5)])
