"""Configuration: every bad value of ``kv_connector_extra_config`` raises a ConfigError
naming the key and what is accepted; good values build the whole stack; a failed
build leaves nothing behind."""

from __future__ import annotations

import errno
import logging
import math
import os
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from tests.manager_helpers import key, leftover_threads, settle
from tiering.config import BlockGeometry, TieringConfig
from tiering.core.errors import ConfigError, TierClosedError
from tiering.core.keys import NO_CONTEXT
from tiering.primary import CPUPrimaryTier
from tiering.spec import TieringOffloadingSpec
from tiering.tier import TierContext
from tiers.memory import MemoryTier

GIB = 1 << 30
BASE: dict[str, Any] = {"cpu_bytes_to_use": 64 * 4096}


def parse(**overrides: Any) -> TieringConfig:
    return TieringConfig.from_extra_config({**BASE, **overrides})


def test_minimal_config_has_the_documented_defaults() -> None:
    config = TieringConfig.from_extra_config({"cpu_bytes_to_use": 10 * GIB})
    assert config == TieringConfig(cpu_bytes_to_use=10 * GIB)
    assert config.block_size is None
    assert config.eviction_policy == "lru"
    assert config.secondary_tiers == ()
    assert config.store_threshold == 0
    assert config.backfill_earlier_tiers is True


def test_full_seed_example_parses() -> None:
    config = TieringConfig.from_extra_config(
        {
            "cpu_bytes_to_use": 10737418240,
            "block_size": 16,
            "eviction_policy": "arc",
            "secondary_tiers": [{"type": "memory", "capacity_blocks": 67}],
            "store_threshold": 1,
            # keys of the engine itself are not ours and are ignored
            "spec_name": "TieringOffloadingSpec",
            "spec_module_path": "tiering.integrations.vllm",
        }
    )
    assert config.cpu_bytes_to_use == 10737418240
    assert config.block_size == 16
    assert config.eviction_policy == "arc"
    assert [dict(t) for t in config.secondary_tiers] == [{"type": "memory", "capacity_blocks": 67}]
    assert config.store_threshold == 1


def test_json_style_values_are_accepted() -> None:
    # JSON from a command line may give integral floats and nulls for "default".
    config = parse(
        cpu_bytes_to_use=1e9,
        block_size=None,
        eviction_policy=" ARC ",
        secondary_tiers=None,
        store_threshold=None,
    )
    assert config.cpu_bytes_to_use == 1_000_000_000
    assert isinstance(config.cpu_bytes_to_use, int)
    assert config.eviction_policy == "arc"
    assert config.secondary_tiers == ()
    assert config.store_threshold == 0


def test_tier_configs_are_copied_and_read_only() -> None:
    tiers = [{"type": "memory", "capacity_blocks": 3}]
    config = parse(secondary_tiers=tiers)
    tiers[0]["capacity_blocks"] = 99
    assert config.secondary_tiers[0]["capacity_blocks"] == 3
    with pytest.raises(TypeError):
        config.secondary_tiers[0]["capacity_blocks"] = 5  # type: ignore[index]


def test_not_a_mapping() -> None:
    with pytest.raises(ConfigError, match="must be a mapping"):
        TieringConfig.from_extra_config([("cpu_bytes_to_use", 1)])  # type: ignore[arg-type]


def test_cpu_bytes_to_use_is_required() -> None:
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use is required.*bytes"):
        TieringConfig.from_extra_config({"block_size": 16})


@pytest.mark.parametrize(
    "value", [0, -1, True, "10 parsecs", "-8MiB", 1.5, math.nan, math.inf, None, [1], "0GiB"]
)
def test_bad_cpu_bytes_to_use(value: object) -> None:
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use must be a positive integer"):
        parse(cpu_bytes_to_use=value)


@pytest.mark.parametrize(
    ("value", "expected"),
    [("8MiB", 8 << 20), ("10GB", 10**10), ("1.5 KiB", 1536), ("4096", 4096), (1e9, 10**9)],
)
def test_cpu_bytes_to_use_takes_units(value: object, expected: int) -> None:
    assert parse(cpu_bytes_to_use=value).cpu_bytes_to_use == expected


@pytest.mark.parametrize("value", [1e30, 2**70, "1000000000 TiB"])
def test_an_impossible_cpu_bytes_to_use_is_a_config_error(value: object) -> None:
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use.*larger than any machine"):
        parse(cpu_bytes_to_use=value)


def test_more_cpu_bytes_than_the_host_has_is_refused_before_allocating() -> None:
    from tiering.config import HostMemory, check_host_memory, host_memory

    small = HostMemory(available_bytes=23 * GIB, total_bytes=24 * GIB, source="test")
    with pytest.raises(ConfigError) as info:
        check_host_memory("cpu_bytes_to_use", 32 * GIB, small)
    message = str(info.value)
    assert "cpu_bytes_to_use=32.0 GiB" in message and "23.0 GiB available of 24.0 GiB" in message
    check_host_memory("cpu_bytes_to_use", 22 * GIB, small)  # fits: no error
    # A buffer shared with the workers must also fit in /dev/shm (64 MiB in a default container).
    with pytest.raises(ConfigError) as info:
        check_host_memory("cpu_bytes_to_use", 1 * GIB, small, shared=True, shm_free_bytes=64 << 20)
    assert "does not fit in /dev/shm" in str(info.value) and "64.0 MiB free" in str(info.value)
    assert "--shm-size" in str(info.value)
    check_host_memory("cpu_bytes_to_use", 1 * GIB, small, shared=True, shm_free_bytes=2 * GIB)
    memory = host_memory()
    if memory is None:
        pytest.skip("this platform does not say how much memory it has")
    assert 0 < memory.available_bytes <= memory.total_bytes
    # Through the spec, before any memory is allocated: twice the machine's total.
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use=.*more memory than this machine"):
        TieringOffloadingSpec({"cpu_bytes_to_use": 2 * memory.total_bytes}, block_bytes=4096)


def test_error_messages_cut_huge_values() -> None:
    huge = ["x" * 1000] * 1000
    with pytest.raises(ConfigError) as info:
        parse(cpu_bytes_to_use=huge)
    assert len(str(info.value)) < 400


@pytest.mark.parametrize("value", [0, -16, False, "16", 2.5])
def test_bad_block_size(value: object) -> None:
    with pytest.raises(ConfigError, match=r"block_size must be a positive integer"):
        parse(block_size=value)


@pytest.mark.parametrize("value", ["fifo", "", 3, ["lru"], "lru2"])
def test_bad_eviction_policy(value: object) -> None:
    with pytest.raises(ConfigError, match=r"eviction_policy must be one of lru, arc, kvaware"):
        parse(eviction_policy=value)


@pytest.mark.parametrize("value", [{"type": "memory"}, "memory", 3, b"x"])
def test_secondary_tiers_must_be_a_list(value: object) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers must be a list"):
        parse(secondary_tiers=value)


def test_secondary_tier_entry_must_be_a_mapping() -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\] must be a mapping"):
        parse(secondary_tiers=[{"type": "memory"}, "memory"])


@pytest.mark.parametrize("entry", [{}, {"type": ""}, {"type": "  "}, {"type": 3}, {"type": None}])
def test_secondary_tier_needs_a_type(entry: dict[str, Any]) -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]\.type is required"):
        parse(secondary_tiers=[entry])


def test_secondary_tier_keys_must_be_strings() -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\] \(memory\): keys must be"):
        parse(secondary_tiers=[{"type": "memory", 3: "x"}])


@pytest.mark.parametrize("value", [2, 3, 100, 2.0])
def test_store_threshold_two_or_more_is_unsupported(value: object) -> None:
    with pytest.raises(ConfigError, match=r"store_threshold=\d+ is not supported"):
        parse(store_threshold=value)


@pytest.mark.parametrize("value", [-1, "1", 1.5, True])
def test_bad_store_threshold(value: object) -> None:
    with pytest.raises(ConfigError, match=r"store_threshold must be 0 or 1"):
        parse(store_threshold=value)


@pytest.mark.parametrize("value", [0, 1])
def test_store_threshold_zero_or_one_is_fine(value: int) -> None:
    assert parse(store_threshold=value).store_threshold == value


@pytest.mark.parametrize("value", [0, -1, math.inf, math.nan, "5", True])
def test_bad_shutdown_timeout(value: object) -> None:
    with pytest.raises(ConfigError, match=r"shutdown_timeout_s must be a positive finite"):
        parse(shutdown_timeout_s=value)


@pytest.mark.parametrize("value", [-0.5, math.inf, "1", False])
def test_bad_failed_promotion_backoff(value: object) -> None:
    with pytest.raises(ConfigError, match=r"failed_promotion_backoff_s must be a non-negative"):
        parse(failed_promotion_backoff_s=value)


def test_zero_backoff_is_allowed() -> None:
    assert parse(failed_promotion_backoff_s=0).failed_promotion_backoff_s == 0.0


@pytest.mark.parametrize("value", ["yes", 1, 0])
def test_bad_backfill_flag(value: object) -> None:
    with pytest.raises(ConfigError, match=r"backfill_earlier_tiers must be true or false"):
        parse(backfill_earlier_tiers=value)


def test_misspelt_key_is_reported(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiering.config"):
        config = parse(evicton_policy="arc")
    assert config.eviction_policy == "lru"  # the misspelt key had no effect...
    assert "did you mean 'eviction_policy'" in caplog.text  # ...and the user is told


def test_foreign_keys_are_silent(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="tiering.config"):
        parse(spec_name="X", spec_module_path="y.z")
    assert caplog.text == ""


# -- geometry ---------------------------------------------------------------------------------


def test_geometry_from_gpu_pages() -> None:
    geometry = BlockGeometry.from_gpu_pages(
        gpu_block_size=16, gpu_page_bytes=8192, block_size=64, world_size=2
    )
    assert geometry == BlockGeometry(block_bytes=8192 * 4 * 2, block_size=64, block_size_factor=4)
    default = BlockGeometry.from_gpu_pages(gpu_block_size=16, gpu_page_bytes=8192)
    assert default == BlockGeometry(block_bytes=8192, block_size=16, block_size_factor=1)


@pytest.mark.parametrize("block_size", [8, 24, 0, -16])
def test_block_size_must_be_a_multiple_of_the_gpu_block_size(block_size: int) -> None:
    with pytest.raises(ConfigError, match=r"block_size must be a positive multiple of the GPU"):
        BlockGeometry.from_gpu_pages(gpu_block_size=16, gpu_page_bytes=4096, block_size=block_size)


@pytest.mark.parametrize(
    ("name", "kwargs"),
    [
        ("gpu_block_size", {"gpu_block_size": 0, "gpu_page_bytes": 4096}),
        ("gpu_page_bytes", {"gpu_block_size": 16, "gpu_page_bytes": -1}),
        ("world_size", {"gpu_block_size": 16, "gpu_page_bytes": 4096, "world_size": 0}),
    ],
)
def test_bad_gpu_geometry(name: str, kwargs: dict[str, int]) -> None:
    with pytest.raises(ConfigError, match=rf"{name} must be a positive integer"):
        BlockGeometry.from_gpu_pages(**kwargs)


def test_bad_block_bytes() -> None:
    with pytest.raises(ConfigError, match="block_bytes must be a positive integer"):
        BlockGeometry(block_bytes=0)


def test_num_blocks_is_derived_from_bytes_and_block_bytes() -> None:
    geometry = BlockGeometry(block_bytes=4096)
    assert geometry.num_blocks(10 * 4096 + 4095) == 10
    with pytest.raises(ConfigError, match=r"cpu_bytes_to_use=4095 is smaller than one"):
        geometry.num_blocks(4095)


# -- the spec ---------------------------------------------------------------------------------


def test_spec_derives_block_bytes_and_num_blocks_without_building() -> None:
    spec = TieringOffloadingSpec(
        {"cpu_bytes_to_use": 100 * 65536, "block_size": 32},
        gpu_block_size=16,
        gpu_page_bytes=16384,
        world_size=2,
        layout_fingerprint="model/bf16",
    )
    assert spec.block_bytes == 16384 * 2 * 2
    assert spec.block_size == 32
    assert spec.block_size_factor == 2
    assert spec.num_blocks == 100
    assert spec.layout_fingerprint == "model/bf16"


def test_spec_config_errors_come_from_the_constructor() -> None:
    with pytest.raises(ConfigError, match="store_threshold=2 is not supported"):
        TieringOffloadingSpec({**BASE, "store_threshold": 2}, block_bytes=4096)
    with pytest.raises(ConfigError, match="cpu_bytes_to_use=100 is smaller than one"):
        TieringOffloadingSpec({"cpu_bytes_to_use": 100}, block_bytes=4096)


def test_spec_needs_exactly_one_geometry() -> None:
    with pytest.raises(ConfigError, match="needs the KV geometry"):
        TieringOffloadingSpec(BASE)
    with pytest.raises(ConfigError, match="needs the KV geometry"):
        TieringOffloadingSpec(BASE, gpu_block_size=16)
    with pytest.raises(ConfigError, match="not both"):
        TieringOffloadingSpec(BASE, block_bytes=4096, gpu_block_size=16, gpu_page_bytes=4096)
    with pytest.raises(ConfigError, match="world_size applies to gpu_page_bytes"):
        TieringOffloadingSpec(BASE, block_bytes=4096, world_size=2)


def test_spec_rejects_unaligned_blocks_when_alignment_is_required() -> None:
    with pytest.raises(ConfigError, match=r"block_size=16 gives offloaded blocks of 1600 bytes"):
        TieringOffloadingSpec(BASE, gpu_block_size=16, gpu_page_bytes=1600)
    with pytest.raises(ConfigError, match=r"block_bytes=1000 not a multiple of 4096"):
        TieringOffloadingSpec(BASE, block_bytes=1000)
    spec = TieringOffloadingSpec(BASE, block_bytes=1000, require_alignment=False)
    assert spec.num_blocks == BASE["cpu_bytes_to_use"] // 1000


def test_spec_rejects_a_non_string_fingerprint() -> None:
    with pytest.raises(ConfigError, match="layout_fingerprint must be a string"):
        TieringOffloadingSpec(BASE, block_bytes=4096, layout_fingerprint=3)  # type: ignore[arg-type]


def test_shut_down_spec_refuses_to_build() -> None:
    spec = TieringOffloadingSpec(BASE, block_bytes=4096)
    spec.shutdown()
    spec.shutdown()  # idempotent
    with pytest.raises(TierClosedError):
        spec.get_manager()


# -- building the stack (real primary tier, registry and runtime) --------------------------------


SHM_NAME = f"kvtier-test-config-{os.getpid()}"


class FailingOpenTier(MemoryTier):
    """A tier whose medium cannot be opened (e.g. a missing mount)."""

    primary_buffer_existed: list[bool] = []  # noqa: RUF012 - a record for the test

    async def open(self, context: TierContext) -> None:
        await super().open(context)
        # a stat of a tmpfs path: far below anything that could stall the loop
        self.primary_buffer_existed.append(os.path.exists(f"/dev/shm/{SHM_NAME}"))  # noqa: ASYNC240
        raise OSError(errno.ENOENT, "no such device: /mnt/kv")


@pytest.fixture
def no_new_threads() -> Iterator[None]:
    before = set(threading.enumerate())
    yield
    assert leftover_threads(before) == []


def test_spec_builds_the_whole_stack(no_new_threads: None) -> None:
    spec = TieringOffloadingSpec(
        {
            "cpu_bytes_to_use": 16 * 4096,
            "block_size": 32,
            "eviction_policy": "arc",
            "secondary_tiers": [
                {"type": "memory", "capacity_blocks": 64},
                {"type": "memory", "name": "second", "job_timeout_s": 5},
            ],
        },
        gpu_block_size=16,
        gpu_page_bytes=2048,
        layout_fingerprint="test-model/fp16",
        metrics_registry=False,
    )
    manager = spec.get_manager()
    assert spec.get_manager() is manager  # built once
    primary = manager.primary
    assert isinstance(primary, CPUPrimaryTier)
    assert (primary.num_blocks, primary.block_bytes) == (16, 4096)
    assert type(primary.eviction_policy).__name__ == "ARCPolicy"
    assert [t.tier_type for t in manager.secondary_tiers] == ["memory", "memory"]
    assert [t.name for t in manager.secondary_tiers] == ["memory-0", "second"]  # type: ignore[attr-defined]
    # end to end: a stored block is cascaded to both tiers, events carry block_size tokens
    output = manager.prepare_store([key(1)], NO_CONTEXT)
    assert output is not None
    manager.complete_store(output.keys_to_store)
    settle(manager)
    assert [t.lookup(key(1), NO_CONTEXT) for t in manager.secondary_tiers] == [True, True]
    assert {e.block_size for e in manager.take_events()} == {32}
    spec.shutdown()
    assert manager.closed
    spec.shutdown()


def test_unknown_tier_type_fails_at_construction() -> None:
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\] \(type 'nope'\): .*unknown tier"):
        TieringOffloadingSpec(
            {**BASE, "secondary_tiers": [{"type": "memory"}, {"type": "nope"}]}, block_bytes=4096
        )
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*cannot import"):
        TieringOffloadingSpec(
            {**BASE, "secondary_tiers": [{"type": "no_such_module_xyz:Tier"}]}, block_bytes=4096
        )


def test_a_misspelled_or_missing_tier_option_fails_at_construction(no_new_threads: None) -> None:
    tiers = [{"type": "memory"}, {"type": "memory"}, {"type": "memory", "capacity_blok": 3}]
    with pytest.raises(ConfigError, match=r"secondary_tiers\[2\].*unknown option 'capacity_blok'"):
        TieringOffloadingSpec({**BASE, "secondary_tiers": tiers}, block_bytes=4096)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*missing required option"):
        TieringOffloadingSpec(
            {**BASE, "secondary_tiers": [{"type": "directory"}]}, block_bytes=4096
        )
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*root_dir \(or root_dirs"):
        TieringOffloadingSpec({**BASE, "secondary_tiers": [{"type": "fs"}]}, block_bytes=4096)
    # The runtime's own keys are values the framework knows: checked here too.
    bad_timeout = [{"type": "memory"}, {"type": "memory", "job_timeout_s": -1}]
    with pytest.raises(
        ConfigError, match=r"secondary_tiers\[1\].*job_timeout_s must be a positive number"
    ):
        TieringOffloadingSpec({**BASE, "secondary_tiers": bad_timeout}, block_bytes=4096)
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*'name' must be a non-empty"):
        TieringOffloadingSpec(
            {**BASE, "secondary_tiers": [{"type": "memory", "name": ""}]}, block_bytes=4096
        )


def test_bad_tier_option_value_leaves_nothing_behind(no_new_threads: None) -> None:
    spec = TieringOffloadingSpec(
        {
            **BASE,
            "secondary_tiers": [
                {"type": "memory"},
                {"type": "memory"},
                {"type": "memory", "capacity_blocks": -3},
            ],
        },
        block_bytes=4096,
        metrics_registry=False,
    )
    with pytest.raises(ConfigError, match=r"secondary_tiers\[2\].*capacity_blocks"):
        spec.get_manager()


def test_tier_that_fails_to_open_shuts_down_the_tiers_built_before(no_new_threads: None) -> None:
    spec = TieringOffloadingSpec(
        {
            **BASE,
            "secondary_tiers": [
                {"type": "memory"},
                {"type": "memory"},
                {"type": "tests.test_config:FailingOpenTier"},
            ],
        },
        block_bytes=4096,
        shared_name=SHM_NAME,
        metrics_registry=False,
    )
    with pytest.raises(OSError, match="no such device") as info:
        spec.get_manager()
    # The error keeps its type and carries a note naming the tier (for the CLI's one line).
    from tiering.registry import tier_start_failure

    failure = tier_start_failure(info.value)
    assert failure is not None and failure.startswith(
        "secondary_tiers[2] (type 'tests.test_config:FailingOpenTier'): cannot start: "
        "FileNotFoundError"
    )
    # tiers #0 and #1 are shut down (their loop threads joined: the fixture checks), and the
    # primary tier's shared buffer, which existed while tier #2 opened, is unlinked
    assert FailingOpenTier.primary_buffer_existed == [True]
    assert not os.path.exists(f"/dev/shm/{SHM_NAME}")
    spec.shutdown()


def test_byte_sizes_take_units_in_every_config_of_ours() -> None:
    from tiering.support.units import config_bytes

    assert config_bytes("x", "8MiB") == 8 << 20 and config_bytes("x", 4096) == 4096
    tier = MemoryTier(capacity_bytes="64KiB")
    assert tier._capacity_bytes == 64 << 10
    with pytest.raises(ConfigError, match=r"capacity_bytes.*not a size"):
        MemoryTier(capacity_bytes="lots")
    config = TieringConfig.from_extra_config(
        {
            "cpu_bytes_to_use": "8MiB",
            "secondary_tiers": [{"type": "memory", "capacity_bytes": "1GB"}],
        }
    )
    assert config.cpu_bytes_to_use == 8 << 20


@pytest.mark.parametrize(
    "key", ["shutdown_timeout_s", "failed_promotion_backoff_s", "cascade_max_pinned_fraction"]
)
def test_an_integer_beyond_any_float_is_a_config_error_naming_the_key(key: str) -> None:
    with pytest.raises(ConfigError, match=key):
        TieringConfig.from_extra_config({"cpu_bytes_to_use": "1MiB", key: 10**400})
