"""A striped fs tier when a root leaves service in the middle of things.

Each test is a race or a sequence a review found losing a block, raising the
wrong exception or miscounting: a store acknowledged on a root taken out while
it ran, a store waiting for room on such a root, the capacity figure of a root
whose disk filled, a key held by two roots after a root is listed again, and a
probe of a deleted root sized by ``capacity_blocks``.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tests.fs_support import BLOCK, FINGERPRINT, FaultyBackend, block_data, fill_disk, key
from tests.test_fs_faults import small_tmpfs
from tests.test_fs_striped import load, opened, store, striped
from tiering.core.keys import OffloadKey
from tiering.tier import TierContext
from tiers.fs import FileSystemTier
from tiers.fs.io import IoBackend, IoOp, OpKind, Priority
from tiers.fs.roots import FAILED_CALLS_LIMIT


def on_root(tier: FileSystemTier, root: Path, count: int, start: int = 0) -> list[OffloadKey]:
    """``count`` fresh keys a store would place on ``root``."""
    keys = (key(i) for i in range(start, start + 100_000))
    return [k for k in keys if tier._roots.destination(k).path == str(root)][:count]  # type: ignore[union-attr]


def under(fd: int, root: Path | None) -> bool:
    if root is None:
        return False
    with contextlib.suppress(OSError):
        return os.readlink(f"/proc/self/fd/{fd}").startswith(str(root) + "/")
    return False


class ReadsFailOn(FileSystemTier):
    """Reads of the files under ``failing`` answer EIO."""

    failing: Path | None = None

    def _make_backend(self, loop: asyncio.AbstractEventLoop, *, direct_io: bool) -> IoBackend:
        return FaultyBackend(super()._make_backend(loop, direct_io=direct_io), self._rule)

    def _rule(self, op: IoOp) -> OSError | None:
        if op.kind is OpKind.READ and under(op.fd, self.failing):
            return OSError(errno.EIO, "injected read EIO")
        return None


async def test_a_store_on_a_root_taken_out_while_it_ran_goes_to_another_root(
    tmp_path: Path,
) -> None:
    roots = [tmp_path / "d0", tmp_path / "d1"]
    tier = ReadsFailOn(root_dirs=roots, capacity_bytes="4MiB", durability="none")
    async with opened(tier) as removed:
        held = on_root(tier, roots[0], FAILED_CALLS_LIMIT)
        assert await store(tier, held) == {}
        (fresh,) = on_root(tier, roots[0], 1, start=50_000)
        tier.failing = roots[0]
        write = asyncio.ensure_future(tier.write(fresh, memoryview(block_data(fresh))))
        await load(tier, held)  # three failing reads take d0 out while the write runs
        await write
        assert tier.stats.roots_out_of_service == 1
        # Acknowledged, so it must be there (on d1), never reported removed.
        assert fresh not in removed
        assert await tier.contains(fresh)
        assert tier._roots.holder(fresh).path == str(roots[1])  # type: ignore[union-attr]
        assert (await load(tier, [fresh]))[fresh] == block_data(fresh)


class WritesHeldOn(FileSystemTier):
    """Writes to files under ``gate`` wait until released (a drive that stalls)."""

    gate: Path | None = None

    def _make_backend(self, loop: asyncio.AbstractEventLoop, *, direct_io: bool) -> IoBackend:
        backend = _Gated(super()._make_backend(loop, direct_io=direct_io), self)
        self.backends = [*getattr(self, "backends", []), backend]
        return backend


class _Gated(IoBackend):
    def __init__(self, inner: IoBackend, tier: WritesHeldOn) -> None:
        super().__init__(asyncio.get_running_loop())
        self.inner, self.tier, self.name = inner, tier, inner.name
        self.held: list[IoOp] = []

    def _enqueue(self, ops: Sequence[IoOp]) -> None:
        gated = [  # block writes only: the journal's (urgent) go through
            op
            for op in ops
            if op.kind is OpKind.WRITE
            and op.priority is not Priority.URGENT
            and under(op.fd, self.tier.gate)
        ]
        self.held += gated
        rest = [op for op in ops if op not in gated]
        if rest:
            self.inner._enqueue(rest)

    def release(self) -> None:
        held, self.held = self.held, []
        if held:
            self.inner._enqueue(held)

    def _withdraw(self, ops: Sequence[IoOp]) -> list[IoOp]:
        mine = [op for op in ops if op in self.held]
        self.held = [op for op in self.held if op not in mine]
        return mine + self.inner._withdraw([op for op in ops if op not in mine])

    async def aclose(self) -> None:
        self.release()
        self._closed = True
        await self.inner.aclose()


async def test_a_store_waiting_for_room_on_a_root_taken_out_goes_to_another_root(
    tmp_path: Path,
) -> None:
    roots = [tmp_path / "d0", tmp_path / "d1"]
    tier = WritesHeldOn(
        root_dirs=roots, capacity_bytes=4 * BLOCK, durability="none", io_backend="threads"
    )
    async with opened(tier):
        first = on_root(tier, roots[0], 4)
        (late,) = on_root(tier, roots[0], 1, start=50_000)
        (other,) = on_root(tier, roots[1], 1)
        tier.gate = roots[0]
        holding = asyncio.ensure_future(store(tier, first))  # every slot of d0, stalled
        await asyncio.sleep(0.2)
        waiting = asyncio.ensure_future(store(tier, [late, other]))  # late waits for room
        await asyncio.sleep(0.2)
        shutil.rmtree(roots[0])
        await tier.check_roots(probe=False)  # the deletion watch takes d0 out
        assert tier.stats.roots_out_of_service == 1
        # A plain answer (no ExceptionGroup, no TierClosedError): both blocks on d1.
        assert await waiting == {}
        assert await tier.contains(late) and await tier.contains(other)
        assert not tier.closed
        for backend in tier.backends:
            backend.release()
        await holding


async def test_capacity_counts_every_root_when_one_disk_fills(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "small", "2m") as small:
        tier = striped(
            [small, tmp_path / "big"],
            capacity_bytes=96 * BLOCK,
            slab_bytes=32 * BLOCK,
            durability="none",
        )
        async with opened(tier):
            assert tier.capacity_blocks == 192
            fill_disk(small / "filler")
            seen = []
            for start in range(0, 800, 16):
                await store(tier, [key(i) for i in range(start, start + 16)])
                roots = tier._roots.roots
                live = [r.state.index.capacity_slots for r in roots if r.state is not None]
                assert tier.capacity_blocks == sum(live), (tier.capacity_blocks, live)
                seen.append(tier.capacity_blocks)
                if tier.stats.roots_out_of_service:
                    break
            # The small root's capacity was lowered to what its disk holds, then taken out.
            assert min(seen[:-1]) < 192 and seen[-1] == 96


async def test_a_root_listed_again_keeps_no_second_copy_of_a_key(tmp_path: Path) -> None:
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"

    async def run(roots: list[Path], body: Any) -> Any:
        tier = striped(roots, durability="none")
        async with opened(tier):
            return await body(tier)

    async def first(tier: FileSystemTier) -> OffloadKey:
        (k,) = on_root(tier, b, 1)
        assert await store(tier, [k]) == {}
        return k

    k = await run([a, b, c], first)
    stored_again = await run([a, c], lambda t: store(t, [k]))  # b left: k stored elsewhere
    assert stored_again == {}

    async def third(tier: FileSystemTier) -> None:
        holding = [r.path for r in tier._roots.roots if k in r.state.index]  # type: ignore[union-attr]
        assert len(holding) == 1, holding
        assert tier.num_blocks() == 1 and len(list(await tier.list_keys())) == 1
        assert any("kept on one only" in note for note in tier.stats.notes)
        await tier.delete(k)
        assert not await tier.contains(k)

    await run([a, b, c], third)


async def test_probing_a_deleted_root_sized_by_capacity_blocks_keeps_the_watch_alive(
    tmp_path: Path,
) -> None:
    roots = [tmp_path / "d0", tmp_path / "d1"]
    tier = FileSystemTier(root_dirs=roots, capacity_blocks=64, durability="none")
    await tier.open(TierContext(BLOCK, FINGERPRINT, "probe"))
    tier._bind_removed_sink(lambda keys: None)
    try:
        shutil.rmtree(roots[0])
        await tier.check_roots(probe=False)
        assert tier.stats.roots_out_of_service == 1
        retiring = tier._roots.roots[0].retiring
        assert retiring is not None
        await retiring  # its files closed: the next check probes it
        assert tier._roots.waiting_for_probe() == [tier._roots.roots[0]]
        await tier.check_roots(probe=True)  # sizing the probe fails: the root stays out
        assert tier.stats.roots_out_of_service == 1
        assert tier._watching is not None and not tier._watching.done()
    finally:
        await tier.aclose()  # no error from the watch


async def test_a_drive_dead_at_start_leaves_the_tier_serving_on_the_others(
    tmp_path: Path,
) -> None:
    """The engine builds and opens a tier back to back: a dead drive must not fail either."""
    from tests.test_fs_striped import ext4_loop, shut_down

    other = tmp_path / "d1"
    with ext4_loop(tmp_path / "disk.img", tmp_path / "mnt") as drive:
        root = drive / "cache"
        async with opened(striped([root, other], capacity_bytes="8MiB", durability="none")):
            pass  # a cache on both roots
        shut_down(drive)  # every op on it answers EIO from now on
        tier = striped([root, other], capacity_bytes="8MiB", durability="none")
        async with opened(tier):
            assert tier.stats.roots_out_of_service == 1
            keys = [key(i) for i in range(20)]
            assert await store(tier, keys) == {}
            assert all(v is not None for v in (await load(tier, keys)).values())
