"""Files under root_dir that try to redirect the tier, and files deleted under a running tier.

Each test asserts: nothing outside root_dir is touched, no wrong bytes are served,
no store into a deleted file is acknowledged, and every acknowledged block that
was not reported removed survives a restart.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from tiering.core.errors import BlockNotFound, ConfigError, PartialBatchError
from tiering.core.keys import OffloadKey
from tiers.fs import FileSystemTier, FsTierStats
from tiers.fs.deletion import FilesDeletedError
from tiers.fs.files import UnsafeFileError
from tiers.fs.index import SLOT
from tiers.fs.layout import HEADER_NAME, JOURNAL_NAME, LOCK_NAME

from .fs_support import BLOCK, block_data, key, make_tier, opened, read_key, write_keys

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("no_fd_leak")]

SLAB0 = "slab-000000.bin"


@pytest.fixture
def no_fd_leak() -> Iterator[None]:
    """Refused opens and repairs close every descriptor they opened."""
    before = set(os.listdir("/proc/self/fd"))
    yield
    leaked = set(os.listdir("/proc/self/fd")) - before
    targets = {os.readlink(f"/proc/self/fd/{fd}") for fd in leaked if _exists(fd)}
    assert not {t for t in targets if "cache" in t or "victim" in t}, targets


def _exists(fd: str) -> bool:
    return os.path.lexists(f"/proc/self/fd/{fd}")


def _victim(tmp_path: Path) -> tuple[Path, bytes]:
    """A file outside root_dir that a planted link points at, and its original bytes."""
    victim = tmp_path / "victim.bin"
    content = os.urandom(3 * BLOCK + 17)
    victim.write_bytes(content)
    return victim, content


async def _make_cache(root: Path, n: int = 4) -> None:
    async with opened(root) as tier:
        await write_keys(tier, [key(i) for i in range(n)])


# -- links and odd files planted under root_dir ---------------------------------------------


@pytest.mark.parametrize("name", [SLAB0, JOURNAL_NAME, HEADER_NAME, LOCK_NAME])
async def test_a_planted_symlink_is_refused_and_never_followed(tmp_path: Path, name: str) -> None:
    root = tmp_path / "cache"
    await _make_cache(root)
    victim, content = _victim(tmp_path)
    (root / name).unlink()
    (root / name).symlink_to(victim)
    with pytest.raises(UnsafeFileError, match=rf"{name}.*symbolic link"):
        async with opened(root):
            pass
    assert victim.read_bytes() == content
    assert (root / name).is_symlink()


async def test_a_symlink_in_a_fresh_root_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    root.mkdir(mode=0o700)
    victim, content = _victim(tmp_path)
    (root / SLAB0).symlink_to(victim)
    (root / HEADER_NAME).symlink_to(tmp_path / "nowhere.json")
    with pytest.raises(UnsafeFileError, match="symbolic link"):
        async with opened(root):
            pass
    assert victim.read_bytes() == content
    assert not (tmp_path / "nowhere.json").exists()


async def test_a_hard_link_to_another_file_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    await _make_cache(root)
    victim, content = _victim(tmp_path)
    (root / SLAB0).unlink()
    os.link(victim, root / SLAB0)
    with pytest.raises(UnsafeFileError, match="hard links"):
        async with opened(root):
            pass
    assert victim.read_bytes() == content


async def test_a_fifo_as_the_journal_is_refused_without_blocking(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    await _make_cache(root)
    (root / JOURNAL_NAME).unlink()
    os.mkfifo(root / JOURNAL_NAME)
    with pytest.raises(UnsafeFileError, match="not a regular file"):
        async with opened(root):
            pass


async def test_a_symlink_as_a_temp_file_is_replaced_not_followed(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    await _make_cache(root)
    victim, content = _victim(tmp_path)
    (root / f".{JOURNAL_NAME}.tmp").symlink_to(victim)
    async with opened(root) as tier:  # opening rewrites the journal through its temp file
        assert len(list(await tier.list_keys())) == 4
    assert victim.read_bytes() == content


async def test_files_are_created_owner_only(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    await _make_cache(root)
    for path in root.iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o600, path.name
    assert stat.S_IMODE(root.stat().st_mode) == 0o700


@pytest.mark.parametrize(("mode", "who"), [(0o770, "its group"), (0o707, "other users")])
def test_a_root_others_can_write_is_refused_at_construction(
    tmp_path: Path, mode: int, who: str
) -> None:
    root = tmp_path / "shared"
    root.mkdir()
    root.chmod(mode)
    with pytest.raises(ConfigError, match=rf"writable by {who}.*chmod go-w"):
        make_tier(root)
    root.chmod(0o755)
    make_tier(root)  # readable by others is fine: they cannot plant files


async def test_a_root_made_writable_after_construction_is_refused_at_open(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = make_tier(root)
    root.chmod(0o777)
    with pytest.raises(UnsafeFileError, match="other users"):
        async with opened(root, tier=tier):
            pass


# -- files deleted under a running tier ---------------------------------------------------------


@pytest.fixture
def no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the checks a test makes (or a store makes) run: the timer would race them."""
    monkeypatch.setattr("tiers.fs.deletion.CHECK_INTERVAL_S", 3600.0)


class _Removed:
    def __init__(self, tier: FileSystemTier) -> None:
        self.keys: set[OffloadKey] = set()
        tier._bind_removed_sink(self.keys.update)


async def _checked_restart(root: Path, acked: set[OffloadKey], removed: set[OffloadKey]) -> None:
    """Every acknowledged block not reported removed is back, with its own bytes."""
    async with opened(root) as tier:
        present = set(await tier.list_keys())
        assert acked - removed <= present
        for k in present:
            assert await read_key(tier, k) == block_data(k)


@pytest.mark.usefixtures("no_timer")
async def test_a_deleted_slab_is_noticed_reported_and_recreated(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    root = tmp_path / "cache"
    first = [key(i) for i in range(8)]
    tier = make_tier(root, slab_bytes=4 * BLOCK, capacity_bytes=16 * BLOCK)
    removed = _Removed(tier)
    async with opened(root, tier=tier):
        await write_keys(tier, first)  # slabs 0 and 1
        (root / SLAB0).unlink()
        with caplog.at_level(logging.ERROR):
            await tier._state().watch.check()
        errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
        assert len(errors) == 1 and SLAB0 in errors[0].getMessage()
        assert removed.keys == set(first[:4])
        assert (root / SLAB0).exists()
        for k in first[:4]:
            with pytest.raises(BlockNotFound):
                await read_key(tier, k)
        second = [key(100 + i) for i in range(8)]
        await write_keys(tier, second)
    await _checked_restart(root, set(first) | set(second), removed.keys)


@pytest.mark.usefixtures("no_timer")
async def test_a_store_into_a_slab_deleted_mid_run_is_never_acknowledged(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = make_tier(root, slab_bytes=64 * BLOCK, capacity_bytes=64 * BLOCK)
    removed = _Removed(tier)
    acked: set[OffloadKey] = set()
    async with opened(root, tier=tier):
        await write_keys(tier, [key(0)])
        acked.add(key(0))
        (root / SLAB0).unlink()  # before the timer has looked
        batch = [key(i) for i in range(1, 5)]
        with pytest.raises(PartialBatchError) as info:
            await write_keys(tier, batch)
        assert set(info.value.errors) == set(batch)
        assert all(isinstance(e, FilesDeletedError) for e in info.value.errors.values())
        assert key(0) in removed.keys
        later = [key(i) for i in range(10, 14)]
        await write_keys(tier, later)  # the slab was recreated
        acked.update(later)
    await _checked_restart(root, acked, removed.keys)


@pytest.mark.usefixtures("no_timer")
async def test_a_deleted_journal_is_written_again_without_losing_blocks(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = make_tier(root)
    removed = _Removed(tier)
    keys = [key(i) for i in range(6)]
    async with opened(root, tier=tier):
        await write_keys(tier, keys[:3])
        (root / JOURNAL_NAME).unlink()
        await write_keys(tier, keys[3:])  # checked before it is acknowledged
        assert (root / JOURNAL_NAME).exists()
    assert removed.keys == set()
    await _checked_restart(root, set(keys), removed.keys)


async def test_the_timer_notices_a_deleted_journal_and_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tiers.fs.deletion.CHECK_INTERVAL_S", 0.02)
    root = tmp_path / "cache"
    tier = make_tier(root)
    noticed = asyncio.Event()
    count = FsTierStats.count_deletion

    def count_and_tell(stats: FsTierStats) -> None:
        count(stats)
        noticed.set()

    monkeypatch.setattr(FsTierStats, "count_deletion", count_and_tell)
    async with opened(root, tier=tier):
        await write_keys(tier, [key(1), key(2)])
        (root / JOURNAL_NAME).unlink()
        (root / HEADER_NAME).unlink()
        async with asyncio.timeout(30):
            await noticed.wait()
        await tier._state().watch.check()  # waits for the repair under way
        assert (root / JOURNAL_NAME).exists() and (root / HEADER_NAME).exists()
        assert tier.stats.deletions_noticed >= 1
    await _checked_restart(root, {key(1), key(2)}, set())


@pytest.mark.usefixtures("no_timer")
async def test_a_deleted_root_refuses_stores_and_reports_every_block(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    tier = make_tier(root)
    removed = _Removed(tier)
    keys = [key(i) for i in range(4)]
    async with opened(root, tier=tier):
        await write_keys(tier, keys)
        shutil.rmtree(root)
        await tier._state().watch.check()
        assert removed.keys == set(keys)
        assert tier.num_blocks() == 0
        with pytest.raises(FilesDeletedError, match="stores refused"):
            await write_keys(tier, [key(9)])
    assert not root.exists()


async def test_deletions_during_a_stream_of_stores_lose_only_reported_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Slabs and the journal unlinked while stores flow: every acknowledged block that was
    not reported removed is back after a restart, with its own bytes."""
    monkeypatch.setattr("tiers.fs.deletion.CHECK_INTERVAL_S", 0.01)
    root = tmp_path / "cache"
    tier = make_tier(root, slab_bytes=8 * BLOCK, capacity_bytes=64 * BLOCK)
    removed = _Removed(tier)
    acked: set[OffloadKey] = set()
    refused = 0
    async with opened(root, tier=tier):

        async def store(first: int) -> None:
            nonlocal refused
            batch = [key(first + i) for i in range(4)]
            try:
                await write_keys(tier, batch)
                acked.update(batch)
            except PartialBatchError as exc:
                refused += len(exc.errors)
                acked.update(k for k in batch if k not in exc.errors)

        for round_ in range(12):
            stores = [asyncio.create_task(store(1000 * round_ + 10 * j)) for j in range(4)]
            await asyncio.sleep(0)
            victim = [f"slab-{round_ % 8:06d}.bin", JOURNAL_NAME][round_ % 2]
            if (root / victim).exists():
                (root / victim).unlink()
            await asyncio.gather(*stores)
        await tier._state().watch.check()
        assert tier.stats.deletions_noticed >= 1
    await _checked_restart(root, acked, removed.keys)


async def test_compactions_are_not_mistaken_for_deletions(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A compaction renames a new journal over the old one (whose link count drops to 0)."""
    monkeypatch.setattr("tiers.fs.deletion.CHECK_INTERVAL_S", 0.0005)
    monkeypatch.setattr("tiers.fs.journal.COMPACT_MIN_BYTES", 1)  # compact after every flush
    monkeypatch.setattr("tiers.fs.journal.COMPACT_FACTOR", 0)
    keys = [key(i) for i in range(40)]
    with caplog.at_level(logging.ERROR):
        async with opened(tmp_path / "cache", capacity_bytes=64 * BLOCK) as tier:
            for i in range(0, len(keys), 2):
                await write_keys(tier, keys[i : i + 2])
            assert tier._state().journal.compactions >= 10
            assert tier.stats.deletions_noticed == 0
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    await _checked_restart(tmp_path / "cache", set(keys), set())


async def test_a_symlink_planted_for_a_slab_not_yet_created_is_refused(tmp_path: Path) -> None:
    root = tmp_path / "cache"
    victim, content = _victim(tmp_path)
    async with opened(root, slab_bytes=4 * BLOCK, capacity_bytes=8 * BLOCK) as tier:
        await write_keys(tier, [key(i) for i in range(4)])  # fills slab 0
        (root / "slab-000001.bin").symlink_to(victim)
        with pytest.raises(PartialBatchError) as info:
            await write_keys(tier, [key(10), key(11)])  # would grow into slab 1
        assert all(isinstance(e, UnsafeFileError) for e in info.value.errors.values())
        assert "symbolic link" in str(next(iter(info.value.errors.values())))
        assert tier._state().index.reserved_count() == 0
        for i in range(4):
            assert await read_key(tier, key(i)) == block_data(key(i))
    assert victim.read_bytes() == content


@pytest.mark.parametrize("gone", [SLAB0, "slab-000001.bin", "slab-000002.bin"])
async def test_a_slab_deleted_while_closed_costs_only_its_blocks(tmp_path: Path, gone: str) -> None:
    """The first, a middle (the blocks of the slabs after it stay) or the last slab."""
    root = tmp_path / "cache"
    keys = [key(i) for i in range(12)]
    async with opened(root, slab_bytes=4 * BLOCK, capacity_bytes=12 * BLOCK) as tier:
        await write_keys(tier, keys)
        in_slab = {k for k in keys if tier._state().index.get(k)[SLOT] // 4 == int(gone[5:11])}  # type: ignore[index]
    (root / gone).unlink()
    async with opened(root, slab_bytes=4 * BLOCK, capacity_bytes=12 * BLOCK) as tier:
        present = set(await tier.list_keys())
        assert len(in_slab) == 4 and present == set(keys) - in_slab
        assert any("dropped" in note for note in tier.stats.notes)
        for k in present:
            assert await read_key(tier, k) == block_data(k)
        assert tier.stats.corrupt_blocks == 0
        await write_keys(tier, [key(20), key(21)])


@pytest.mark.usefixtures("no_timer")
async def test_stores_are_refused_while_a_repair_fails_and_accepted_once_it_works(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "cache"
    tier = make_tier(root)
    removed = _Removed(tier)
    async with opened(root, tier=tier):
        await write_keys(tier, [key(1), key(2)])
        journal = tier._state().journal
        real_rotate = journal.rotate

        async def no_space() -> bool:
            return False  # as when the disk is full

        monkeypatch.setattr(journal, "rotate", no_space)
        (root / JOURNAL_NAME).unlink()
        await tier._state().watch.check()
        assert removed.keys == {key(1), key(2)}  # nothing acknowledged into the deleted file
        with pytest.raises(FilesDeletedError, match="stores refused"):
            await write_keys(tier, [key(3)])
        await tier._state().watch.check()  # still failing: still refused
        with pytest.raises(FilesDeletedError):
            await write_keys(tier, [key(3)])
        monkeypatch.setattr(journal, "rotate", real_rotate)
        await tier._state().watch.check()
        await write_keys(tier, [key(4)])
        assert tier.stats.deletions_noticed == 1
    await _checked_restart(root, {key(4)}, removed.keys)
