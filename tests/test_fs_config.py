"""Configuration of the filesystem tier: defaults, sizes, and clear errors at construction."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from tiering.core.errors import ConfigError
from tiering.tier import TierContext
from tiers.fs import FileSystemTier
from tiers.fs.config import DEFAULT_CAPACITY_BYTES, GiB, MiB, parse_size


def test_defaults_work_out_of_the_box(tmp_path: Path) -> None:
    tier = FileSystemTier(root_dir=tmp_path / "cache")
    cfg = tier.config
    assert cfg.root_dir == tmp_path / "cache" and cfg.root_dir.is_dir()
    free = shutil.disk_usage(tmp_path).free
    assert cfg.capacity_bytes == min(DEFAULT_CAPACITY_BYTES, free // 2)
    assert (cfg.io_backend, cfg.durability, cfg.eviction_policy) == ("auto", "periodic", "lru")
    assert (cfg.n_read_threads, cfg.n_write_threads) == (8, 4)
    assert tier.max_concurrency >= 256  # whole jobs per call: they coalesce into large I/Os


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("64GiB", 64 * GiB),
        ("500MB", 500 * 10**6),
        ("1.5 GiB", int(1.5 * GiB)),
        ("4096", 4096),
        (8192, 8192),
        (1e6, 10**6),
    ],
)
def test_sizes_accept_units(text: object, expected: int) -> None:
    assert parse_size("capacity_bytes", text) == expected


@pytest.mark.parametrize("bad", ["lots", "12 parsecs", True, None, [1]])
def test_bad_sizes_name_the_key(bad: object) -> None:
    with pytest.raises(ConfigError, match="capacity_bytes"):
        parse_size("capacity_bytes", bad)


@pytest.mark.parametrize(
    ("option", "value", "message"),
    [
        ("n_read_threads", 0, "n_read_threads must be a positive integer"),
        ("n_write_threads", "4", "n_write_threads must be a positive integer"),
        ("io_backend", "aio", "io_backend must be one of auto, uring, threads"),
        ("durability", "sometimes", "durability must be one of none, periodic, fsync"),
        ("eviction_policy", "fifo", "eviction_policy must be one of"),
        ("sync_interval_s", 0, "sync_interval_s"),
        ("slab_bytes", 100, "slab_bytes must be at least 4KiB"),
        ("queue_depth", -1, "queue_depth"),
        ("max_io_bytes", "1KiB", "max_io_bytes"),
        ("direct_io", "maybe", "direct_io"),
        ("on_layout_mismatch", "ignore", "on_layout_mismatch"),
        ("capacity_bytes", 100, "at least 4KiB"),
        ("capacity_bytes", "1000TiB", "can hold only"),
    ],
)
def test_bad_values_fail_at_construction(
    tmp_path: Path, option: str, value: Any, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        FileSystemTier(root_dir=tmp_path, **{option: value})


def test_missing_root_is_an_error_unless_it_may_be_created(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        FileSystemTier(root_dir=tmp_path / "absent", create_root_dir=False)
    (tmp_path / "a-file").write_text("x")
    with pytest.raises(ConfigError, match="cannot be created"):
        FileSystemTier(root_dir=tmp_path / "a-file" / "cache")
    with pytest.raises(ConfigError, match="not a directory"):
        FileSystemTier(root_dir=tmp_path / "a-file")


def test_an_unwritable_root_is_an_error() -> None:
    # /proc refuses new files even to root, like a read-only mount would.
    with pytest.raises(ConfigError, match="not writable"):
        FileSystemTier(root_dir="/proc/self", capacity_bytes="1MiB")


async def test_a_capacity_below_one_block_fails_at_open(tmp_path: Path) -> None:
    tier = FileSystemTier(root_dir=tmp_path, capacity_bytes="64KiB")
    with pytest.raises(ConfigError, match="cannot hold one block"):
        await tier.open(TierContext(block_bytes=2 * MiB))
    await tier.aclose()


def test_the_registry_builds_it_from_a_vllm_style_dict(tmp_path: Path) -> None:
    import numpy as np

    from tiering.registry import create_secondary_tier

    primary = np.zeros((8, 4096), dtype=np.uint8)
    config = {"type": "fs", "root_dir": str(tmp_path), "capacity_bytes": "1MiB"}
    manager = create_secondary_tier(config, memoryview(primary.data), position=0)
    try:
        assert manager.tier_type == "fs"
        assert isinstance(manager.tier, FileSystemTier)
    finally:
        manager.shutdown()
    with pytest.raises(ConfigError, match=r"secondary_tiers\[1\].*unknown option 'root'"):
        create_secondary_tier(
            {"type": "fs", "root": str(tmp_path)}, memoryview(primary.data), position=1
        )
    with pytest.raises(ConfigError, match=r"secondary_tiers\[2\].*durability"):
        create_secondary_tier(
            {"type": "fs", "root_dir": str(tmp_path), "durability": "x"},
            memoryview(primary.data),
            position=2,
        )


async def test_capacity_in_blocks_is_resolved_at_open(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not both"):
        FileSystemTier(root_dir=tmp_path, capacity_bytes="1MiB", capacity_blocks=4)
    tier = FileSystemTier(root_dir=tmp_path, capacity_blocks=5)
    before_open = tier.capacity_blocks
    await tier.open(TierContext(block_bytes=10000))  # slots of 12288 bytes
    try:
        assert (before_open, tier.capacity_blocks) == (None, 5)
    finally:
        await tier.aclose()
    huge = FileSystemTier(root_dir=tmp_path, capacity_blocks=10**9)
    with pytest.raises(ConfigError, match="can hold only"):
        await huge.open(TierContext(block_bytes=2 * MiB))
    await huge.aclose()
