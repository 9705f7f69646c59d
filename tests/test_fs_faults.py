"""Fault injection: bit flips, torn and short blocks, EIO, ENOSPC, damaged journal tails."""

from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fs_support import (
    BLOCK,
    FaultyFsTier,
    append,
    block_data,
    disk_bytes,
    fail_data_ops,
    fill_disk,
    flip_byte,
    key,
    make_tier,
    opened,
    overwrite,
    read_key,
    slot_location,
    write_keys,
)
from tiering.core.errors import BlockNotFound, CorruptBlock, PartialBatchError
from tiers.fs import opening as fs_opening
from tiers.fs.io import OpKind
from tiers.fs.layout import JOURNAL_NAME


async def test_a_flipped_bit_fails_the_read_and_drops_the_block(tmp_path: Path) -> None:
    removed: list[bytes] = []
    async with opened(tmp_path) as tier:
        tier._bind_removed_sink(removed.extend)
        await write_keys(tier, [key(1), key(2)])
        path, offset = slot_location(tier, key(1))
        flip_byte(path, offset + 1234)
        with pytest.raises(CorruptBlock, match="checksum mismatch"):
            await read_key(tier, key(1))
        assert removed == [key(1)]
        assert not await tier.contains(key(1))
        assert tier.stats.corrupt_blocks == 1
        assert await read_key(tier, key(2)) == block_data(key(2))
    async with opened(tmp_path) as tier:  # the drop was journaled
        assert list(await tier.list_keys()) == [key(2)]


async def test_a_torn_block_listed_after_restart_is_never_served(tmp_path: Path) -> None:
    """Power loss can persist the journal record but not all of the data (durability none)."""
    async with opened(tmp_path, durability="none") as tier:
        await write_keys(tier, [key(1), key(2), key(3)])
        path, offset = slot_location(tier, key(2))
    # The second half of the block never reached the disk.
    overwrite(path, offset + BLOCK // 2, bytes(BLOCK // 2))
    async with opened(tmp_path) as tier:
        assert set(await tier.list_keys()) == {key(1), key(2), key(3)}
        outs = [memoryview(bytearray(BLOCK)) for _ in range(3)]
        with pytest.raises(PartialBatchError) as info:
            await tier.read_many([key(1), key(2), key(3)], outs)
        assert set(info.value.errors) == {key(2)}
        assert isinstance(info.value.errors[key(2)], CorruptBlock)
        assert bytes(outs[0]) == block_data(key(1)) and bytes(outs[2]) == block_data(key(3))
        assert not await tier.contains(key(2))


async def test_a_short_read_fails_the_block(tmp_path: Path) -> None:
    async with opened(tmp_path, capacity_bytes=4 * BLOCK) as tier:
        await write_keys(tier, [key(i) for i in range(4)])
        path, offset = slot_location(tier, key(3))
        os.truncate(path, offset + BLOCK // 2)  # the slab lost its tail under us
        with pytest.raises(CorruptBlock, match="short read"):
            await read_key(tier, key(3))
        assert not await tier.contains(key(3))
        assert await read_key(tier, key(0)) == block_data(key(0))


async def test_eio_on_read_is_a_miss_and_drops_the_block(tmp_path: Path) -> None:
    removed: list[bytes] = []
    tier = FaultyFsTier(root_dir=tmp_path, capacity_bytes="1MiB")
    tier._bind_removed_sink(removed.extend)
    async with opened(tmp_path, tier=tier):
        await write_keys(tier, [key(1)])
        tier.rule = fail_data_ops(OpKind.READ)
        with pytest.raises(OSError) as info:
            await read_key(tier, key(1))
        assert info.value.errno == errno.EIO
        assert removed == [key(1)]
        tier.rule = lambda op: None
        with pytest.raises(BlockNotFound):
            await read_key(tier, key(1))


@pytest.mark.parametrize("code", [errno.EIO, errno.ENOSPC])
async def test_a_failed_data_write_leaves_nothing_visible(tmp_path: Path, code: int) -> None:
    tier = FaultyFsTier(root_dir=tmp_path, capacity_bytes=8 * BLOCK)
    async with opened(tmp_path, tier=tier):
        tier.rule = fail_data_ops(OpKind.WRITE, code)
        with pytest.raises(PartialBatchError) as info:
            await write_keys(tier, [key(i) for i in range(8)])
        assert all(getattr(e, "errno", None) == code for e in info.value.errors.values())
        assert tier.num_blocks() == 0
        assert tier._state().index.reserved_count() == 0
        tier.rule = lambda op: None
        await write_keys(tier, [key(i) for i in range(8)])  # every slot came back
        assert tier.num_blocks() == 8
    async with opened(tmp_path, capacity_bytes=8 * BLOCK) as reopened:
        assert len(list(await reopened.list_keys())) == 8


def _journal(root: Path) -> Path:
    return root / JOURNAL_NAME


@pytest.mark.parametrize("damage", ["truncate_mid_record", "garbage_tail", "flip_last_record"])
async def test_restart_with_a_damaged_journal_tail_keeps_the_valid_prefix(
    tmp_path: Path, damage: str
) -> None:
    async with opened(tmp_path, durability="none") as tier:
        await write_keys(tier, [key(i) for i in range(5)])
        size_before = _journal(tmp_path).stat().st_size
        await write_keys(tier, [key(99)])  # the last record, which gets damaged
    journal = _journal(tmp_path)
    size = journal.stat().st_size
    assert size > size_before
    if damage == "truncate_mid_record":
        os.truncate(journal, size - 5)
    elif damage == "garbage_tail":
        os.truncate(journal, size_before)
        append(journal, os.urandom(100))
    else:
        flip_byte(journal, size - 12)
    async with opened(tmp_path) as tier:
        assert set(await tier.list_keys()) == {key(i) for i in range(5)}
        assert any("journal" in note for note in tier.stats.notes)
        for i in range(5):
            assert await read_key(tier, key(i)) == block_data(key(i))
        await write_keys(tier, [key(7)])  # appends after the valid prefix
    async with opened(tmp_path) as tier:
        assert set(await tier.list_keys()) == {key(i) for i in (*range(5), 7)}


async def test_a_journal_from_another_cache_is_ignored(tmp_path: Path) -> None:
    async with opened(tmp_path / "a") as tier:
        await write_keys(tier, [key(1)])
    async with opened(tmp_path / "b"):
        pass
    os.replace(_journal(tmp_path / "a"), _journal(tmp_path / "b"))
    async with opened(tmp_path / "b") as tier:
        assert list(await tier.list_keys()) == []


# -- a real full filesystem ---------------------------------------------------------------


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir()
    mounted = subprocess.run(
        # mode=700: the tier refuses a root_dir other users can write to (tmpfs's default is 1777)
        ["mount", "-t", "tmpfs", "-o", f"size={size},mode=700", "tmpfs", str(path)],
        capture_output=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


async def test_enospc_when_growing_lowers_capacity_and_evicts_instead(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt", "2m") as root:
        async with opened(
            root, capacity_bytes=96 * BLOCK, slab_bytes=32 * BLOCK, durability="none"
        ) as tier:
            await write_keys(tier, [key(i) for i in range(32)])  # fills slab 0
            # Something else takes the disk space the next slabs would need.
            (root / "other-data").write_bytes(bytes(1200 * 1024))
            with pytest.raises(PartialBatchError) as info:
                await write_keys(tier, [key(i) for i in range(32, 48)])
            assert all(getattr(e, "errno", 0) == errno.ENOSPC for e in info.value.errors.values())
            assert tier.stats.capacity_slots < 96
            # From now on the tier evicts within what it could allocate.
            await write_keys(tier, [key(i) for i in range(100, 116)])
            assert tier.num_blocks() <= tier.stats.capacity_slots
            for i in range(100, 116):
                assert await read_key(tier, key(i)) == block_data(key(i))
            assert disk_bytes(root) <= 96 * BLOCK


async def test_a_full_disk_fails_writes_until_space_returns(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt", "1m") as root:
        async with opened(root, capacity_bytes=16 * BLOCK, durability="none") as tier:
            await write_keys(tier, [key(i) for i in range(4)])
            filler = root / "filler"
            fill_disk(filler)
            # Once the journal's last page is full it cannot grow: writes fail rather than
            # becoming visible unjournaled.
            failures: list[BaseException] = []
            for round_ in range(100):
                try:
                    await write_keys(tier, [key(1000 + round_ * 8 + i) for i in range(8)])
                except PartialBatchError as exc:
                    failures.extend(exc.errors.values())
                    break
            assert failures and all(getattr(e, "errno", 0) == errno.ENOSPC for e in failures)
            filler.unlink()
            await write_keys(tier, [key(50)])
            assert await read_key(tier, key(50)) == block_data(key(50))
            visible = set(await tier.list_keys())
            tier._state().index.check_invariants()
        async with opened(root, capacity_bytes=16 * BLOCK) as tier:
            listed = set(await tier.list_keys())
            assert key(50) in listed
            assert listed == visible
            for k in listed:
                assert await read_key(tier, k) == block_data(k)


async def test_a_restart_on_a_full_disk_keeps_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The journal cannot be compacted at open: it is appended to as it is, nothing lost."""
    # A journal that needs compacting (a small intact one is appended to as it is anyway).
    monkeypatch.setattr(fs_opening, "_compact", lambda result, live: False)
    keys = [key(i) for i in range(8)]
    with small_tmpfs(tmp_path / "mnt", "2m") as root:
        config: dict[str, Any] = {"capacity_bytes": 32 * BLOCK, "slab_bytes": 32 * BLOCK}
        async with opened(root, durability="none", **config) as tier:
            await write_keys(tier, keys[:4])
            await write_keys(tier, keys[4:])
        fill_disk(root / "filler")
        async with opened(root, **config) as tier:
            assert set(await tier.list_keys()) == set(keys)
            assert any("no space" in note for note in tier.stats.notes)
            for k in keys:
                assert await read_key(tier, k) == block_data(k)
        assert not any(p.name.endswith(".tmp") for p in root.iterdir())
        (root / "filler").unlink()
        async with opened(root, **config) as tier:
            assert set(await tier.list_keys()) == set(keys)
            assert not tier.stats.notes
            await write_keys(tier, [key(20)])
        async with opened(root, **config) as tier:
            assert set(await tier.list_keys()) == {*keys, key(20)}


async def test_a_new_cache_on_a_full_disk_is_one_clear_error(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "mnt", "1m") as root:
        tier = make_tier(root, capacity_bytes=8 * BLOCK)
        fill_disk(root / "filler")
        with pytest.raises(OSError, match=r"cannot create a cache under root_dir.*free space"):
            async with opened(root, tier=tier):
                pass
