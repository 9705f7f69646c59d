"""The filesystem tier behind the runtime facade (AsyncTierManager), as the scheduler uses it."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tests.fs_support import flip_byte, slot_location
from tests.runtime_support import fill, key, load, one_result, primary, results, store, wait_until
from tiering.core.keys import NO_CONTEXT
from tiering.runtime import AsyncTierManager
from tiers.fs import FileSystemTier

BLOCK = 4096 * 4


def manager(root: Path, rows: np.ndarray, **config: object) -> AsyncTierManager:
    config.setdefault("capacity_bytes", 64 * BLOCK)
    tier = FileSystemTier(root_dir=root, **config)  # type: ignore[arg-type]
    return AsyncTierManager(tier, memoryview(rows.data), "fs", layout_fingerprint="facade-test")


def test_store_then_load_through_jobs(tmp_path: Path) -> None:
    rows = primary(32, BLOCK)
    data = {i: fill(rows, i) for i in range(16)}
    with manager(tmp_path, rows) as m:
        m.submit_store(store(1, [key(i) for i in range(16)], list(range(16))))
        assert one_result(m).success
        assert all(m.lookup(key(i), NO_CONTEXT) for i in range(16))
        rows[16:32] = 0
        m.submit_load(load(2, [key(i) for i in range(16)], list(range(16, 32))))
        result = one_result(m)
        assert result.success and result.transfer_bytes == 16 * BLOCK
        for i in range(16):
            assert rows[16 + i].tobytes() == data[i]
        assert m.get_num_blocks() == 16
        assert m.stats().capacity_blocks == 64


def test_blocks_survive_a_restart_and_are_found_without_a_round_trip(tmp_path: Path) -> None:
    rows = primary(8, BLOCK)
    data = {i: fill(rows, i) for i in range(8)}
    with manager(tmp_path, rows) as m:
        m.submit_store(store(1, [key(i) for i in range(8)], list(range(8))))
        assert one_result(m).success
    rows[:] = 0
    with manager(tmp_path, rows) as m:
        assert all(m.lookup(key(i), NO_CONTEXT) is True for i in range(8))
        m.submit_load(load(1, [key(i) for i in range(8)], list(range(8))))
        assert one_result(m).success
        for i in range(8):
            assert rows[i].tobytes() == data[i]


def test_evictions_reach_lookup_and_events(tmp_path: Path) -> None:
    rows = primary(8, BLOCK)
    for i in range(8):
        fill(rows, i)
    with manager(tmp_path, rows, capacity_bytes=4 * BLOCK) as m:
        m.submit_store(store(1, [key(i) for i in range(4)], list(range(4))))
        assert one_result(m).success
        m.submit_store(store(2, [key(i) for i in range(4, 8)], list(range(4, 8))))
        assert one_result(m).success
        removed = {k for keys, gone in m.take_events() if gone for k in keys}
        assert removed == {key(i) for i in range(4)}
        assert [m.lookup(key(i), NO_CONTEXT) for i in range(8)] == [False] * 4 + [True] * 4


def test_concurrent_stores_into_a_full_tier_wait_for_room(tmp_path: Path) -> None:
    rows = primary(12, BLOCK)
    for i in range(12):
        fill(rows, i)
    with manager(tmp_path, rows, capacity_bytes=4 * BLOCK) as m:
        for job in range(3):
            keys = [key(job * 4 + i) for i in range(4)]
            m.submit_store(store(job, keys, list(range(job * 4, job * 4 + 4))))
        assert all(r.success for r in results(m).values())
        wait_until(lambda: sum(bool(m.lookup(key(i), NO_CONTEXT)) for i in range(12)) == 4)


def test_a_corrupt_block_fails_the_load_and_becomes_a_miss(tmp_path: Path) -> None:
    rows = primary(4, BLOCK)
    for i in range(2):
        fill(rows, i)
    tier = FileSystemTier(root_dir=tmp_path, capacity_bytes=8 * BLOCK)
    with AsyncTierManager(tier, memoryview(rows.data), "fs") as m:
        m.submit_store(store(1, [key(0), key(1)], [0, 1]))
        assert one_result(m).success
        path, offset = m._thread.call(_locate, tier, key(1), timeout=5)
        flip_byte(path, offset + 7)
        m.submit_load(load(2, [key(0), key(1)], [2, 3]))
        result = one_result(m)
        assert not result.success
        assert result.successful_keys == frozenset({key(0)})
        wait_until(lambda: m.lookup(key(1), NO_CONTEXT) is False)
        assert m.lookup(key(0), NO_CONTEXT) is True
        assert m.stats().corrupt_reads == 1


async def _locate(tier: FileSystemTier, k: bytes) -> tuple[Path, int]:
    return slot_location(tier, k)  # type: ignore[arg-type]
