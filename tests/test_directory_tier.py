"""The directory tier: the conformance kit, verification, recovery, eviction, registry."""

from __future__ import annotations

import asyncio
import os
import threading
from pathlib import Path
from typing import Any

import aiofiles.os
import numpy as np
import pytest

from tests.runtime_support import key, load, one_result, store
from tiering.core.errors import BlockNotFound, ConfigError, CorruptBlock
from tiering.core.keys import NO_CONTEXT, OffloadKey
from tiering.registry import create_secondary_tier
from tiering.testing.conformance import conformance_tests
from tiering.tier import TierContext
from tiers.directory import DirectoryTier


def unbounded(tmp_path: Path) -> DirectoryTier:
    return DirectoryTier(tmp_path / "blocks")


def bounded_durable(tmp_path: Path) -> DirectoryTier:
    return DirectoryTier(tmp_path / "blocks", capacity_blocks=1000, fsync=True)


globals().update(conformance_tests(unbounded, prefix="test_kit_", persistent=True))
globals().update(conformance_tests(bounded_durable, prefix="test_kit_bounded_", persistent=True))

BLOCK = 4096
CONTEXT = TierContext(block_bytes=BLOCK, layout_fingerprint="model-a/fp16/16", name="dir")


async def _opened(root: Path, **options: object) -> DirectoryTier:
    tier = DirectoryTier(root, **options)  # type: ignore[arg-type]
    await tier.open(CONTEXT)
    return tier


async def _write(tier: DirectoryTier, k: OffloadKey, fill: int) -> bytes:
    data = bytes([fill]) * BLOCK
    await tier.write(k, memoryview(bytearray(data)))
    return data


async def _read(tier: DirectoryTier, k: OffloadKey) -> bytes:
    into = bytearray(BLOCK)
    await tier.read(k, memoryview(into))
    return bytes(into)


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda b: b[:-1], "file is"),
        (lambda b: b[:10], "truncated header"),
        (lambda b: b[:-1] + bytes([b[-1] ^ 1]), "checksum mismatch"),
        (lambda b: b"XXXX" + b[4:], "not a directory tier block file"),
    ],
)
async def test_a_damaged_file_is_a_corrupt_miss_and_is_deleted(
    tmp_path: Path, damage: object, reason: str
) -> None:
    tier = await _opened(tmp_path)
    await _write(tier, key(1), 7)
    path = tier.directory / f"{key(1).hex()}.blk"
    path.write_bytes(damage(path.read_bytes()))  # type: ignore[operator]
    with pytest.raises(CorruptBlock, match=reason):
        await _read(tier, key(1))
    assert not path.exists() and not await tier.contains(key(1))
    with pytest.raises(BlockNotFound):
        await _read(tier, key(1))


async def test_a_file_moved_under_another_keys_name_is_not_served(tmp_path: Path) -> None:
    tier = await _opened(tmp_path)
    await _write(tier, key(1), 1)
    await tier.aclose()
    directory = tier.directory
    os.replace(directory / f"{key(1).hex()}.blk", directory / f"{key(2).hex()}.blk")
    again = await _opened(tmp_path)
    assert await again.list_keys() == [key(2)]
    with pytest.raises(CorruptBlock, match="another key"):
        await _read(again, key(2))


async def test_reopening_recovers_blocks_drops_temp_files_and_trims_to_capacity(
    tmp_path: Path,
) -> None:
    tier = await _opened(tmp_path)
    written = {key(i): await _write(tier, key(i), i) for i in range(4)}
    await tier.aclose()
    leftover = tier.directory / f"{key(9).hex()}.blk.0badc0de.tmp"
    leftover.write_bytes(b"half a block")
    (tier.directory / "README").write_text("not ours")

    again = await _opened(tmp_path)
    assert sorted(await again.list_keys()) == sorted(written)
    assert [await _read(again, k) for k in written] == list(written.values())
    assert not leftover.exists() and (tier.directory / "README").exists()
    await again.aclose()

    trimmed = await _opened(tmp_path, capacity_blocks=2)
    assert len(await trimmed.list_keys()) == 2
    assert len(list(trimmed.directory.glob("*.blk"))) == 2


async def test_layouts_are_kept_apart_and_another_block_size_is_refused(tmp_path: Path) -> None:
    tier = await _opened(tmp_path)
    await _write(tier, key(1), 1)
    other_layout = DirectoryTier(tmp_path)
    await other_layout.open(TierContext(block_bytes=BLOCK, layout_fingerprint="model-b"))
    assert await other_layout.list_keys() == [] and not await other_layout.contains(key(1))

    same_layout_other_size = DirectoryTier(tmp_path)
    context = TierContext(block_bytes=2 * BLOCK, layout_fingerprint=CONTEXT.layout_fingerprint)
    with pytest.raises(ConfigError, match=f"holds blocks of {BLOCK} bytes"):
        await same_layout_other_size.open(context)

    (tier.directory / "tier.json").write_text("{not json")
    with pytest.raises(ConfigError, match="not a directory tier manifest"):
        await DirectoryTier(tmp_path).open(CONTEXT)


async def test_eviction_deletes_the_least_recently_used_and_reports_it(tmp_path: Path) -> None:
    tier = await _opened(tmp_path, capacity_blocks=2)
    removed: list[OffloadKey] = []
    tier._bind_removed_sink(removed.extend)
    await _write(tier, key(1), 1)
    await _write(tier, key(2), 2)
    await _read(tier, key(1))  # key(2) is now the least recently used
    await _write(tier, key(3), 3)
    assert removed == [key(2)]
    assert sorted(await tier.list_keys()) == sorted([key(1), key(3)])
    assert not (tier.directory / f"{key(2).hex()}.blk").exists()
    await tier.touch([key(1)])
    await _write(tier, key(4), 4)
    assert removed == [key(2), key(3)]


async def test_a_write_waits_for_a_deletion_of_the_same_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier = await _opened(tmp_path)
    await _write(tier, key(1), 1)
    entered, release = asyncio.Event(), asyncio.Event()
    real_remove = aiofiles.os.remove

    async def slow_remove(path: Path) -> None:
        entered.set()
        await release.wait()
        await real_remove(path)

    monkeypatch.setattr(aiofiles.os, "remove", slow_remove)
    deleting = asyncio.ensure_future(tier.delete(key(1)))
    await entered.wait()
    writing = asyncio.ensure_future(_write(tier, key(1), 2))
    for _ in range(20):
        await asyncio.sleep(0)
    assert not writing.done()  # it would otherwise land first and be deleted
    release.set()
    await deleting
    new = await writing
    assert await _read(tier, key(1)) == new


def test_bad_options_are_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="root_dir"):
        DirectoryTier("")
    with pytest.raises(ConfigError, match="capacity_blocks"):
        DirectoryTier(tmp_path, capacity_blocks=0)
    with pytest.raises(ConfigError, match="fsync"):
        DirectoryTier(tmp_path, fsync="yes")  # type: ignore[arg-type]


def test_the_directory_type_runs_behind_the_facade(tmp_path: Path) -> None:
    rows = np.zeros((4, BLOCK), dtype=np.uint8)
    config = {"type": "directory", "root_dir": str(tmp_path), "capacity_blocks": 8}
    with create_secondary_tier(config, rows.data, position=0, layout_fingerprint="fp") as manager:
        rows[0] = 42
        manager.submit_store(store(1, [key(1)], [0]))
        assert one_result(manager).success
        assert manager.lookup(key(1), NO_CONTEXT) is True
        manager.submit_load(load(2, [key(1)], [3]))
        assert one_result(manager).success
        assert rows[3].tolist() == [42] * BLOCK
        assert manager.stats().capacity_blocks == 8
    # Persistent: a new manager over the same directory finds the block.
    with create_secondary_tier(config, rows.data, position=0, layout_fingerprint="fp") as manager:
        assert manager.lookup(key(1), NO_CONTEXT) is True


async def test_evicting_a_key_being_rewritten_leaves_its_new_file_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tiers.directory as directory_module

    tier = await _opened(tmp_path, capacity_blocks=1)
    await _write(tier, key(1), 1)
    started, gate = threading.Event(), threading.Event()
    real_write = directory_module._write_block_file

    loop = asyncio.get_running_loop()
    rewritten = asyncio.Event()  # the new file of key(1) is in place

    def gated_write(temp: Path, path: Path, k: bytes, *rest: Any) -> None:
        if k == key(1):
            started.set()
            gate.wait(5)
        real_write(temp, path, k, *rest)
        if k == key(1):
            loop.call_soon_threadsafe(rewritten.set)

    real_remove = aiofiles.os.remove

    async def remove_after_the_rewrite(path: Path) -> None:
        await rewritten.wait()  # the worst order: the eviction's delete after the new file
        await real_remove(path)

    monkeypatch.setattr(directory_module, "_write_block_file", gated_write)
    monkeypatch.setattr(aiofiles.os, "remove", remove_after_the_rewrite)

    rewriting = asyncio.ensure_future(_write(tier, key(1), 2))
    await asyncio.to_thread(started.wait, 5)
    other = asyncio.ensure_future(_write(tier, key(2), 3))  # evicts key(1): capacity 1
    # The eviction runs while key(1) is still being rewritten - always this order, never the
    # easier one (a polling loop once fell through to it on a slow machine).
    await asyncio.wait_for(asyncio.shield(other), 5)
    gate.set()
    new = await rewriting
    await other
    assert await _read(tier, key(1)) == new


async def test_a_read_whose_key_is_evicted_meanwhile_still_returns_its_bytes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write of another key may evict this one while its file is read: the read got the
    bytes, and must not fail with a bare KeyError afterwards."""
    import tiers.directory as directory

    tier = await _opened(tmp_path)
    try:
        k = key(1)
        await tier.write(k, memoryview(b"\x07" * tier.block_bytes))
        read_file = directory._read_block_file

        def evicted_while_reading(*args: Any) -> Any:
            tier._index.pop(k, None)  # as a concurrent write's eviction does
            return read_file(*args)

        monkeypatch.setattr(directory, "_read_block_file", evicted_while_reading)
        into = bytearray(tier.block_bytes)
        await tier.read(k, memoryview(into))
        assert into == b"\x07" * tier.block_bytes
    finally:
        await tier.aclose()
