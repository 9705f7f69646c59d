"""FileSystemTier on real files: round trips, persistence, eviction, layout checks, locking."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from tests.fs_support import (
    BACKENDS,
    BLOCK,
    FINGERPRINT,
    Rows,
    block_data,
    disk_bytes,
    key,
    make_tier,
    opened,
    read_key,
    slab_files,
    write_keys,
)
from tiering.core.errors import BlockNotFound, ConfigError, PartialBatchError, TierClosedError
from tiering.tier import TierContext
from tiers.fs import RootInUseError, TierFullError
from tiers.fs import reads as fs_reads
from tiers.fs import writes as fs_writes
from tiers.fs.index import SLOT
from tiers.fs.layout import HEADER_NAME, JOURNAL_NAME
from tiers.fs.records import SYNC_MARKER


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct_io", [True, False])
async def test_round_trip_batches_from_aligned_rows(
    tmp_path: Path, backend: str, direct_io: bool
) -> None:
    keys = [key(i) for i in range(40)]
    src, dst = Rows(40), Rows(40)
    for i, k in enumerate(keys):
        src.row(i)[:] = block_data(k)
    async with opened(tmp_path, io_backend=backend, direct_io=direct_io) as tier:
        await tier.write_many(keys, src.rows(40))
        assert await tier.contains_many([*keys, key(999)]) == [True] * 40 + [False]
        await tier.read_many(list(reversed(keys)), list(reversed(dst.rows(40))))
        assert bytes(dst.view) == bytes(src.view)
        assert tier.stats.direct_io is direct_io
        assert tier.stats.io_backend == backend
        assert tier.num_blocks() == 40


@pytest.mark.parametrize("block_bytes", [1000, 4096 + 512, 3 * 4096])
async def test_odd_block_sizes_and_unaligned_buffers(tmp_path: Path, block_bytes: int) -> None:
    keys = [key(i) for i in range(9)]
    async with opened(tmp_path, block_bytes=block_bytes) as tier:
        # bytes objects and bytearray slices are not page-aligned: bounce buffers.
        await tier.write_many(keys, [memoryview(block_data(k, block_bytes)) for k in keys])
        backing = bytearray(block_bytes * 9 + 7)
        outs = [
            memoryview(backing)[7 + i * block_bytes : 7 + (i + 1) * block_bytes] for i in range(9)
        ]
        await tier.read_many(keys, outs)
        for k, out in zip(keys, outs, strict=True):
            assert bytes(out) == block_data(k, block_bytes)


@pytest.mark.parametrize("backend", BACKENDS)
async def test_every_block_leaves_the_caches_once_verified(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, backend: str
) -> None:
    """Stores evict each block once hashed, loads once the read bytes checked out."""
    evicted: list[bytes] = []
    for module in (fs_reads, fs_writes):
        monkeypatch.setattr(module, "evict_block", lambda block: evicted.append(bytes(block)))
    keys = [key(i) for i in range(6)]
    src, dst = Rows(6), Rows(6)
    for i, k in enumerate(keys):
        src.row(i)[:] = block_data(k)
    async with opened(tmp_path, io_backend=backend) as tier:
        await tier.write_many(keys, src.rows(6))
        assert sorted(evicted) == sorted(block_data(k) for k in keys)
        evicted.clear()
        await tier.read_many(keys, dst.rows(6))
    assert bytes(dst.view) == bytes(src.view)
    assert sorted(evicted) == sorted(block_data(k) for k in keys)  # as read, not before


async def test_restart_finds_every_block_and_reads_it_back(tmp_path: Path) -> None:
    keys = [key(i) for i in range(50)]
    async with opened(tmp_path) as tier:
        await write_keys(tier, keys[:30])
        await write_keys(tier, keys[30:])
        await tier.delete(keys[0])
    async with opened(tmp_path) as tier:
        assert set(await tier.list_keys()) == set(keys[1:])
        assert tier.stats.recovered_blocks == 49
        for k in keys[1:]:
            assert await read_key(tier, k) == block_data(k)
        with pytest.raises(BlockNotFound):
            await read_key(tier, keys[0])


async def test_overwrite_replaces_bytes_and_survives_restart(tmp_path: Path) -> None:
    k = key(1)
    async with opened(tmp_path) as tier:
        await write_keys(tier, [k])
        await tier.write(k, memoryview(block_data(b"other")))
        assert await read_key(tier, k) == block_data(b"other")
        assert tier.num_blocks() == 1
    async with opened(tmp_path) as tier:
        assert await read_key(tier, k) == block_data(b"other")


@pytest.mark.parametrize("policy", ["lru", "arc"])
async def test_capacity_is_never_exceeded_and_evictions_are_reported(
    tmp_path: Path, policy: str
) -> None:
    capacity_slots = 16
    removed: list[bytes] = []
    tier = make_tier(
        tmp_path,
        capacity_bytes=capacity_slots * BLOCK,
        eviction_policy=policy,
        slab_bytes=BLOCK * 5,
    )
    tier._bind_removed_sink(removed.extend)
    async with opened(tmp_path, tier=tier):
        for start in range(0, 80, 8):
            await write_keys(tier, [key(i) for i in range(start, start + 8)])
            assert tier.num_blocks() <= capacity_slots
            assert disk_bytes(tmp_path) <= capacity_slots * BLOCK
        present = {k for k in (key(i) for i in range(80)) if await tier.contains(k)}
        assert len(present) == capacity_slots
        assert len(removed) == 80 - capacity_slots
        assert not present & set(removed)
        assert tier.stats.evictions == len(removed)
        for k in present:
            assert await read_key(tier, k) == block_data(k)
    assert len(slab_files(tmp_path)) == 4  # 16 slots in slabs of 5: 5 + 5 + 5 + 1


async def test_lru_keeps_recently_read_blocks(tmp_path: Path) -> None:
    async with opened(tmp_path, capacity_bytes=4 * BLOCK) as tier:
        await write_keys(tier, [key(i) for i in range(4)])
        await read_key(tier, key(0))
        await tier.touch([key(1)])
        await write_keys(tier, [key(4), key(5)])
        assert await tier.contains_many([key(i) for i in range(6)]) == [
            True,
            True,
            False,
            False,
            True,
            True,
        ]


async def test_a_block_being_read_is_not_evicted_under_the_reader(tmp_path: Path) -> None:
    async with opened(tmp_path, capacity_bytes=2 * BLOCK) as tier:
        await write_keys(tier, [key(0), key(1)])
        index = tier._state().index
        entry = index.pin(key(0))  # a read in flight holds the slot
        assert entry is not None
        try:
            await write_keys(tier, [key(2)])
            assert await tier.contains(key(0))
            assert not await tier.contains(key(1))
            # Two slots are needed but only one can be evicted: the batch waits for the reader.
            waiting = asyncio.create_task(write_keys(tier, [key(3), key(4)]))
            await asyncio.sleep(0.05)
            assert not waiting.done()
            assert await tier.contains(key(0))
            assert await read_key(tier, key(0)) == block_data(key(0))
        finally:
            index.unpin(entry[SLOT])
        await read_key(tier, key(2))  # a read's end wakes the waiting batch
        await waiting
        assert await tier.contains_many([key(0), key(3), key(4)]) == [False, True, True]


async def test_a_batch_larger_than_the_tier_stores_what_fits(tmp_path: Path) -> None:
    async with opened(tmp_path, capacity_bytes=4 * BLOCK) as tier:
        keys = [key(i) for i in range(6)]
        with pytest.raises(PartialBatchError) as info:
            await write_keys(tier, keys)
        assert set(info.value.errors) == set(keys[4:])
        assert all(isinstance(e, TierFullError) for e in info.value.errors.values())
        assert "larger than" in str(info.value.errors[keys[5]])
        assert info.value.succeeded == set(keys[:4])


async def test_reads_of_missing_keys_in_a_batch(tmp_path: Path) -> None:
    async with opened(tmp_path) as tier:
        await write_keys(tier, [key(1)])
        outs = Rows(2).rows(2)
        with pytest.raises(PartialBatchError) as info:
            await tier.read_many([key(1), key(2)], outs)
        assert info.value.succeeded == {key(1)}
        assert isinstance(info.value.errors[key(2)], BlockNotFound)
        assert bytes(outs[0]) == block_data(key(1))


async def test_misuse_is_rejected_without_changing_anything(tmp_path: Path) -> None:
    async with opened(tmp_path) as tier:
        with pytest.raises(ValueError, match="exactly"):
            await tier.write(key(1), memoryview(bytes(BLOCK - 1)))
        with pytest.raises(ValueError, match="same key twice"):
            await write_keys(tier, [key(1), key(1)])
        with pytest.raises(ValueError, match="writable"):
            await tier.read(key(1), memoryview(bytes(BLOCK)))
        assert tier.num_blocks() == 0
        assert tier._state().index.reserved_count() == 0
    with pytest.raises(TierClosedError):
        await tier.contains(key(1))
    await tier.aclose()  # idempotent


@pytest.mark.parametrize("change", ["block_bytes", "fingerprint"])
async def test_a_cache_for_another_layout_is_reset_never_read(tmp_path: Path, change: str) -> None:
    async with opened(tmp_path) as tier:
        await write_keys(tier, [key(1)])
    other = {"block_bytes": 2 * BLOCK} if change == "block_bytes" else {"fingerprint": "other"}
    async with opened(tmp_path, **other) as tier:
        assert list(await tier.list_keys()) == []
        assert any("reset" in note for note in tier.stats.notes)
    with pytest.raises(ConfigError, match="another layout"):
        async with opened(tmp_path, on_layout_mismatch="error"):
            pass


async def test_header_describes_the_cache(tmp_path: Path) -> None:
    async with opened(tmp_path):
        pass
    header = json.loads((tmp_path / HEADER_NAME).read_text())
    assert header["format"] == "kv-tiering-fs"
    assert header["block_bytes"] == BLOCK
    assert header["slot_bytes"] == BLOCK
    assert header["layout_fingerprint"] == "test-model/bf16/16x2x8x128"
    assert header["checksum"] == "xxh3_128"


async def test_a_damaged_header_resets_the_cache(tmp_path: Path) -> None:
    async with opened(tmp_path) as tier:
        await write_keys(tier, [key(1)])
    (tmp_path / HEADER_NAME).write_text("{not json")
    async with opened(tmp_path) as tier:
        assert list(await tier.list_keys()) == []
        await write_keys(tier, [key(2)])
        assert await read_key(tier, key(2)) == block_data(key(2))


async def test_a_root_is_used_by_one_tier_at_a_time(tmp_path: Path) -> None:
    async with opened(tmp_path):
        second = make_tier(tmp_path)
        with pytest.raises(RootInUseError, match="in use"):
            await second.open(TierContext(BLOCK, "x"))
        await second.aclose()
    async with opened(tmp_path):  # released on close
        pass


async def test_lower_capacity_after_restart_drops_blocks_beyond_it(tmp_path: Path) -> None:
    keys = [key(i) for i in range(20)]
    async with opened(tmp_path, capacity_bytes=20 * BLOCK, slab_bytes=8 * BLOCK) as tier:
        await write_keys(tier, keys)
    async with opened(tmp_path, capacity_bytes=10 * BLOCK, slab_bytes=8 * BLOCK) as tier:
        kept = list(await tier.list_keys())
        assert len(kept) == 10
        assert tier.stats.dropped_on_recovery == 10
        for k in kept:
            assert await read_key(tier, k) == block_data(k)
    assert disk_bytes(tmp_path) <= 10 * BLOCK


@pytest.mark.parametrize("durability", ["none", "periodic", "fsync"])
async def test_every_durability_policy_round_trips_and_recovers(
    tmp_path: Path, durability: str
) -> None:
    keys = [key(i) for i in range(12)]
    async with opened(tmp_path, durability=durability, sync_interval_s=0.01) as tier:
        await write_keys(tier, keys)
        await asyncio.sleep(0.03)  # let a periodic sync run
    async with opened(tmp_path) as tier:
        assert set(await tier.list_keys()) == set(keys)


async def test_journal_is_compacted_and_still_recovers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("tiers.fs.journal.COMPACT_MIN_BYTES", 4096)
    async with opened(tmp_path, capacity_bytes=8 * BLOCK) as tier:
        for round_ in range(30):
            await write_keys(tier, [key(round_ * 4 + i) for i in range(4)])
        assert tier._state().journal.compactions > 0
        live = set(await tier.list_keys())
        assert (tmp_path / JOURNAL_NAME).stat().st_size < 8192
    async with opened(tmp_path, capacity_bytes=8 * BLOCK) as tier:
        assert set(await tier.list_keys()) == live
        for k in live:
            assert await read_key(tier, k) == block_data(k)


async def test_a_restart_rewrites_the_journal_only_when_it_needs_to(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An intact journal no larger than the running tier lets one grow is appended to as it
    is (rewriting costs a start 0.7 s per million blocks); one with a torn tail, or grown
    past that size, is rewritten compactly at open."""
    journal, config = tmp_path / JOURNAL_NAME, {"capacity_bytes": 16 * BLOCK}
    async with opened(tmp_path, **config) as tier:
        await write_keys(tier, [key(i) for i in range(4)])
    kept = journal.stat()
    async with opened(tmp_path, **config) as tier:
        await write_keys(tier, [key(i) for i in range(4, 8)])
    grown = journal.stat()
    assert grown.st_ino == kept.st_ino and grown.st_size > kept.st_size
    with journal.open("ab") as torn:
        torn.write(SYNC_MARKER + b"\x40")  # an append cut short
    async with opened(tmp_path, **config) as tier:
        assert set(await tier.list_keys()) == {key(i) for i in range(8)}
        assert any("torn tail" in note for note in tier.stats.notes)
    assert journal.stat().st_ino != grown.st_ino
    async with opened(tmp_path, **config) as tier:
        assert not tier.stats.notes  # the torn tail went with the rewrite
        for _ in range(8):  # 8 live blocks, 9 records of them: past 4x their size
            await write_keys(tier, [key(i) for i in range(8)])
    bloated = journal.stat()
    # Past the compaction size only without its 8 MiB floor (which kept the running tier
    # from compacting it above).
    monkeypatch.setattr("tiers.fs.journal.COMPACT_MIN_BYTES", 0)
    async with opened(tmp_path, **config) as tier:
        assert set(await tier.list_keys()) == {key(i) for i in range(8)}
        for i in range(8):
            assert await read_key(tier, key(i)) == block_data(key(i))
    compacted = journal.stat()
    assert compacted.st_ino != bloated.st_ino and compacted.st_size < bloated.st_size


async def test_cancelled_batch_write_releases_its_slots(tmp_path: Path) -> None:
    async with opened(tmp_path, capacity_bytes=64 * BLOCK) as tier:
        keys = [key(i) for i in range(64)]
        task = asyncio.create_task(write_keys(tier, keys))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        index, journal = tier._state().index, tier._state().journal
        # A commit already handed to the journal lands when its records are durable.
        await journal.wait_durable(journal.next_seq - 1)
        assert index.reserved_count() == 0
        index.check_invariants()
        for k in keys:
            if await tier.contains(k):
                assert await read_key(tier, k) == block_data(k)
        await write_keys(tier, keys)  # every slot is usable again
        assert tier.num_blocks() == 64


async def test_slabs_grow_lazily_with_the_data(tmp_path: Path) -> None:
    async with opened(tmp_path, capacity_bytes=32 * BLOCK, slab_bytes=8 * BLOCK) as tier:
        assert len(slab_files(tmp_path)) == 1
        await write_keys(tier, [key(i) for i in range(9)])
        assert len(slab_files(tmp_path)) == 2
    assert [p.stat().st_size for p in slab_files(tmp_path)] == [8 * BLOCK, 8 * BLOCK]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("direct_io", [True, False])
async def test_no_buffer_outlives_the_call(tmp_path: Path, backend: str, direct_io: bool) -> None:
    """The caller can release its views afterwards: nothing (an io_uring iovec...) kept them."""
    src, dst = Rows(8), Rows(8)
    keys = [key(i) for i in range(8)]
    async with opened(tmp_path, io_backend=backend, direct_io=direct_io) as tier:
        writes, reads = src.rows(8), dst.rows(8)
        readonly = [v.toreadonly() for v in writes[:4]]
        await tier.write_many(keys, readonly + writes[4:])
        await tier.read_many(keys, reads)
        for view in readonly + writes + reads:
            view.release()  # BufferError if an export of the view were still held
    src.view.release()
    dst.view.release()


async def test_a_write_waiting_for_room_fails_when_the_tier_closes(tmp_path: Path) -> None:
    tier = make_tier(tmp_path, capacity_bytes=2 * BLOCK)
    await tier.open(TierContext(BLOCK, FINGERPRINT, "fs-test"))
    try:
        holding = asyncio.ensure_future(write_keys(tier, [key(1), key(2)]))
        waiting = asyncio.ensure_future(write_keys(tier, [key(3)]))
        for _ in range(3):
            await asyncio.sleep(0)  # both started: the second waits for the first's slots
        assert not waiting.done()
    finally:
        await tier.aclose()
    async with asyncio.timeout(10):
        with pytest.raises(TierClosedError, match="closed while a write waited for room"):
            await waiting
        with contextlib.suppress(Exception):
            await holding


@pytest.mark.parametrize("durability", ["none", "periodic", "fsync"])
async def test_durability_policies_sync_what_they_promise(tmp_path: Path, durability: str) -> None:
    from tests.fs_support import FaultyFsTier
    from tiers.fs.io import IoOp

    tier = FaultyFsTier(
        root_dir=tmp_path, capacity_bytes="16MiB", durability=durability, sync_interval_s=3600
    )
    seen: list[tuple[str, str]] = []
    async with opened(tmp_path, tier=tier):
        journal_fd = tier._state().journal._fd

        def record(op: IoOp) -> None:
            seen.append(("journal" if op.fd == journal_fd else "slab", op.kind.name))

        tier.rule = record  # type: ignore[method-assign,assignment]
        await write_keys(tier, [key(1), key(2)])
        when_acknowledged = list(seen)
    assert ("slab", "WRITE") in when_acknowledged
    syncs = [entry for entry in when_acknowledged if entry[1] == "FSYNC"]
    if durability == "fsync":
        # Data first, then the journal record that makes the blocks visible, then its sync.
        slab_sync = when_acknowledged.index(("slab", "FSYNC"))
        record_write = when_acknowledged.index(("journal", "WRITE"), slab_sync)
        assert ("journal", "FSYNC") in when_acknowledged[record_write:]
        assert when_acknowledged.index(("slab", "WRITE")) < slab_sync
    else:
        assert syncs == [], f"{durability}: nothing is synced before the write is acknowledged"
    if durability != "none":  # closing syncs what is outstanding
        assert ("journal", "FSYNC") in seen[len(when_acknowledged) :] or syncs
