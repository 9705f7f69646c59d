"""Every key ``docs/configuration.md`` documents does what it says inside vLLM, or is refused.

The keys are read from the page's table, so a key documented later without a
check here fails this test. Each check runs the engine-side path: our
``KVTieringOffloadingSpec`` and vLLM's own ``TieringOffloadingManager`` as
vLLM builds them, not our replay.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.vllm.conftest import shut_down
from tests.vllm.test_vllm_tiers import ours, tier_of
from tiering.core.errors import ConfigError
from tiering.integrations.vllm.driver import SchedulerDriver, build_manager, offloading_config
from tiering.integrations.vllm.spec import KVTieringOffloadingSpec
from tiering.integrations.vllm.tiers import VLLM_SHUTDOWN_TIMEOUT_S
from tiering.metrics.server import running_metrics_server, stop_metrics_server

DOCS = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"
OUR_SPEC = {"spec_name": "KVTieringOffloadingSpec", "spec_module_path": "tiering.integrations.vllm"}
BLOCK = 64 * 1024


def documented_keys() -> list[str]:
    """The first column of the table under '## Keys'."""
    text = DOCS.read_text()
    section = text.split("\n## Keys\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `([a-z_]+)` \|", section, flags=re.MULTILINE)


@pytest.fixture
def engine() -> Iterator[Callable[..., Any]]:
    """``engine(extra, tiers=[...])``: vLLM's manager built through our spec; shut down after."""
    built: list[tuple[Any, Any]] = []

    def make(extra: dict[str, Any], tiers: list[dict[str, Any]] | None = None) -> Any:
        config = offloading_config(
            tiers or [ours("KVTieringMemoryTier", capacity_blocks=8)],
            block_bytes=BLOCK,
            num_chunks=16,
            extra_config={**OUR_SPEC, **extra},
        )
        manager = build_manager(config)
        built.append((manager, SchedulerDriver(manager)))
        return manager

    yield make
    for manager, driver in reversed(built):
        shut_down(manager, driver)


def spec(extra: dict[str, Any]) -> KVTieringOffloadingSpec:
    config = offloading_config(
        [], block_bytes=BLOCK, num_chunks=16, extra_config={**OUR_SPEC, **extra}
    )
    return KVTieringOffloadingSpec(config)


def test_copy_engine_null_means_the_default() -> None:
    assert spec({"cpu_bytes_to_use": "1MiB", "copy_engine": None}).copy_engine == "host"


def check_cpu_bytes_to_use(engine: Callable[..., Any]) -> None:
    assert spec({"cpu_bytes_to_use": "1MiB"}).num_chunks == 16
    # Less than one block: refused naming the key (vLLM failed later: "cannot mmap an empty file").
    with pytest.raises(ConfigError, match="cpu_bytes_to_use=1024 is smaller than one offloaded"):
        spec({"cpu_bytes_to_use": "1KiB"})


def check_block_size(engine: Callable[..., Any]) -> None:
    """vLLM's own key: its connector turns it into ``blocks_per_chunk`` before any spec runs
    (the real engine runs it in tests/vllm_engine); our spec passes it through untouched."""
    import inspect

    from vllm.distributed.kv_transfer.kv_connector.v1.offloading.config import (
        build_offloading_config,
    )

    assert 'extra_config.get("block_size")' in inspect.getsource(build_offloading_config)
    assert spec({"block_size": 32}).extra_config["block_size"] == 32


def check_eviction_policy(engine: Callable[..., Any]) -> None:
    built = spec({"eviction_policy": "kvaware"})
    assert built.cache_policy_module_path == "tiering.integrations.vllm.policy"
    manager = engine({"eviction_policy": "kvaware"})
    assert "kvaware" in type(manager.primary_tier._policy).__doc__


def check_cache_policy_module_path(engine: Callable[..., Any]) -> None:
    extra = {
        "eviction_policy": "LRUCachePolicy",
        "cache_policy_module_path": "vllm.v1.kv_offload.cpu.policies.lru",
    }
    manager = engine(extra)
    assert type(manager.primary_tier._policy).__name__ == "LRUCachePolicy"


def check_cascade_admission(engine: Callable[..., Any]) -> None:
    """Applied by our tiers (what it does there: tests/vllm/test_vllm_admission.py)."""
    assert tier_of(engine({"cascade_admission": "all"}))._admission is None
    assert tier_of(engine({"cascade_admission": "reuse"}))._admission is not None
    with pytest.raises(ConfigError, match="cascade_admission 'reuse' has no effect"):
        spec({"cascade_admission": "reuse"})  # no tier of ours to apply it
    with pytest.raises(ConfigError, match="cascade_admission"):
        spec({"cascade_admission": "no-such-policy"})


def check_secondary_tiers(engine: Callable[..., Any]) -> None:
    manager = engine({}, [ours("KVTieringMemoryTier", capacity_blocks=8)] * 2)
    assert len(manager.secondary_tiers) == 2


def check_store_threshold(engine: Callable[..., Any]) -> None:
    engine({"store_threshold": 0})
    with pytest.raises(ValueError, match="store_threshold is not supported"):
        engine({"store_threshold": 2})


def check_shutdown_timeout_s(engine: Callable[..., Any]) -> None:
    manager = engine({"shutdown_timeout_s": 3.5})
    assert tier_of(manager)._runtime.shutdown_timeout_s == 3.5
    # Unset: inside vLLM's 5 s window before it force-kills the engine core.
    assert tier_of(engine({}))._runtime.shutdown_timeout_s == VLLM_SHUTDOWN_TIMEOUT_S < 5
    with pytest.raises(ConfigError, match="shutdown_timeout_s must be a positive"):
        spec({"shutdown_timeout_s": 0})


def check_failed_promotion_backoff_s(engine: Callable[..., Any]) -> None:
    manager = engine({"failed_promotion_backoff_s": 2.5})
    assert tier_of(manager)._runtime.failed_load_backoff_s == 2.5
    own = ours("KVTieringMemoryTier", capacity_blocks=8, failed_load_backoff_s=1.0)
    manager = engine({"failed_promotion_backoff_s": 2.5}, [own])
    assert tier_of(manager)._runtime.failed_load_backoff_s == 1.0  # the entry's own wins


def check_backfill_earlier_tiers(engine: Callable[..., Any]) -> None:
    engine({"backfill_earlier_tiers": False})  # what vLLM's manager does
    with pytest.raises(ConfigError, match="backfill_earlier_tiers true has no effect"):
        spec({"backfill_earlier_tiers": True})


def check_metrics_port(engine: Callable[..., Any]) -> None:
    from tests.support.redis_server import free_port

    # Validated as our spec does, and refused where no tier of ours would serve them.
    with pytest.raises(ConfigError, match="metrics_host must be a host name"):
        engine({"metrics_port": 0, "metrics_host": 123})
    with pytest.raises(ConfigError, match="metrics_host is set but metrics_port is not"):
        engine({"metrics_host": "127.0.0.1"})
    with pytest.raises(ConfigError, match="metrics_port has no effect: only kv-tiering's tiers"):
        spec({"metrics_port": 0})

    port = free_port()
    engine({"metrics_port": port, "metrics_host": "127.0.0.1"})
    server = running_metrics_server(port)
    try:
        assert server is not None and server.host == "127.0.0.1"
    finally:
        if server is not None:
            stop_metrics_server(server)


def check_cascade_max_pinned_fraction(engine: Callable[..., Any]) -> None:
    from tiering.integrations.vllm.backpressure import PinnedShareDetector

    detector = tier_of(engine({"cascade_max_pinned_fraction": 0.5})).bp_detector
    assert isinstance(detector, PinnedShareDetector) and detector.budget_blocks == 8
    with pytest.raises(ConfigError, match="cascade_max_pinned_fraction must be a number in"):
        engine({"cascade_max_pinned_fraction": 2})
    with pytest.raises(ConfigError, match="cascade_max_pinned_fraction has no effect"):
        spec({"cascade_max_pinned_fraction": 0.5})  # no tier of ours


def test_a_misspelled_key_is_named_under_vllm_too(caplog: pytest.LogCaptureFixture) -> None:
    spec({"cpu_bytes_to_use": "1MiB", "failed_promotion_backof_s": 3})
    assert "did you mean 'failed_promotion_backoff_s'?" in caplog.text


CHECKS: dict[str, Callable[[Callable[..., Any]], None]] = {
    "cpu_bytes_to_use": check_cpu_bytes_to_use,
    "block_size": check_block_size,
    "eviction_policy": check_eviction_policy,
    "cache_policy_module_path": check_cache_policy_module_path,
    "cascade_admission": check_cascade_admission,
    "secondary_tiers": check_secondary_tiers,
    "store_threshold": check_store_threshold,
    "shutdown_timeout_s": check_shutdown_timeout_s,
    "failed_promotion_backoff_s": check_failed_promotion_backoff_s,
    "backfill_earlier_tiers": check_backfill_earlier_tiers,
    "cascade_max_pinned_fraction": check_cascade_max_pinned_fraction,
    "metrics_port": check_metrics_port,
    "metrics_host": check_metrics_port,
}


def test_every_documented_key_has_a_check() -> None:
    keys = documented_keys()
    assert len(keys) >= 12, keys  # the table was found
    assert sorted(set(keys) - set(CHECKS)) == [], "documented keys nobody checks under vLLM"


@pytest.mark.parametrize("key", documented_keys())
def test_a_documented_key_works_under_vllm_or_is_refused(
    key: str, engine: Callable[..., Any]
) -> None:
    CHECKS[key](engine)


def test_our_manager_keys_are_refused_under_vllms_own_spec_too(engine: Callable[..., Any]) -> None:
    """With vLLM's TieringOffloadingSpec our tiers are the first code that sees the keys."""
    config = offloading_config(
        [ours("KVTieringMemoryTier", capacity_blocks=8)],
        block_bytes=BLOCK,
        num_chunks=16,
        extra_config={"backfill_earlier_tiers": True},
    )
    with pytest.raises(ConfigError, match="backfill_earlier_tiers true has no effect"):
        build_manager(config)
