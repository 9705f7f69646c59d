"""A striped fs tier (``root_dirs``): placement, restarts, a changed set of roots, failing roots.

The failing-root tests run on real kernels' failures where this machine
allows it (a small tmpfs that fills up, an ext4 loop device shut down so that
every op answers EIO) and on injected EIO otherwise. Each checks the two
promises: no wrong byte is ever served, and no call waits on the failed root.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import shutil
import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.fs_support import BLOCK, FINGERPRINT, FaultyBackend, block_data, fill_disk, key
from tests.test_fs_faults import small_tmpfs
from tiering.core.errors import ConfigError, PartialBatchError
from tiering.core.keys import OffloadKey
from tiering.tier import TierContext
from tiers.fs import FileSystemTier
from tiers.fs.files import RootDir
from tiers.fs.io import IoBackend, IoOp
from tiers.fs.layout import read_header
from tiers.fs.roots import FAILED_CALLS_LIMIT


def striped(roots: list[Path], **config: Any) -> FileSystemTier:
    config.setdefault("capacity_bytes", "4MiB")
    return FileSystemTier(root_dirs=roots, **config)


@contextlib.asynccontextmanager
async def opened(tier: FileSystemTier) -> Any:
    removed: list[OffloadKey] = []
    await tier.open(TierContext(BLOCK, FINGERPRINT, "striped"))
    tier._bind_removed_sink(removed.extend)
    try:
        yield removed
    finally:
        await tier.aclose()


def holder(tier: FileSystemTier, k: OffloadKey) -> str | None:
    root = tier._roots.holder(k)
    return None if root is None else root.path


async def store(tier: FileSystemTier, keys: list[OffloadKey]) -> dict[bytes, BaseException]:
    try:
        await tier.write_many(keys, [memoryview(block_data(k)) for k in keys])
    except PartialBatchError as exc:
        return dict(exc.errors)
    return {}


async def load(tier: FileSystemTier, keys: list[OffloadKey]) -> dict[OffloadKey, bytes | None]:
    """Each key's bytes, or None for a miss; a wrong byte fails the test."""
    out: dict[OffloadKey, bytes | None] = {}
    for k in keys:
        into = bytearray(BLOCK)
        try:
            await tier.read(k, memoryview(into))
        except (KeyError, OSError, Exception):
            out[k] = None
            continue
        assert bytes(into) == block_data(k), f"wrong bytes served for {k.hex()}"
        out[k] = bytes(into)
    return out


# -- placement and restarts ----------------------------------------------------------------


async def test_blocks_spread_over_every_root_and_stay_put_across_restarts(tmp_path: Path) -> None:
    roots = [tmp_path / f"d{i}" for i in range(3)]
    keys = [key(i) for i in range(300)]
    tier = striped(roots)
    async with opened(tier):
        assert await store(tier, keys) == {}
        where = {k: holder(tier, k) for k in keys}
        per_root = {str(r): sum(1 for w in where.values() if w == str(r)) for r in roots}
        assert all(60 <= n <= 140 for n in per_root.values()), per_root
        assert tier.stats.roots == 3 and tier.num_blocks() == 300
        assert tier.capacity_blocks == 3 * (4 << 20) // BLOCK
    # The order of root_dirs does not matter: every block is where it was.
    tier = striped(list(reversed(roots)))
    async with opened(tier):
        assert tier.stats.recovered_blocks == 300
        assert {k: holder(tier, k) for k in keys} == where
        assert all(v is not None for v in (await load(tier, keys)).values())
        # A new block of a key goes where the key goes: the same root again.
        more = [key(i) for i in range(300, 330)]
        assert await store(tier, more) == {}
    for root in roots:
        header = read_header(RootDir.open(root))
        assert header is not None and header.root_set == tuple(sorted(map(str, roots)))


async def test_a_root_that_left_costs_only_its_own_blocks(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    roots = [tmp_path / f"d{i}" for i in range(3)]
    keys = [key(i) for i in range(200)]
    tier = striped(roots)
    async with opened(tier):
        await store(tier, keys)
        where = {k: holder(tier, k) for k in keys}
    kept = [k for k in keys if where[k] != str(roots[2])]
    tier = striped(roots[:2])
    with caplog.at_level(logging.WARNING):
        async with opened(tier):
            assert set(await tier.list_keys()) == set(kept)
            assert all(v is not None for v in (await load(tier, kept)).values())
            assert tier.stats.recovered_blocks == len(kept)
            fresh = [key(i) for i in range(1000, 1100)]
            await store(tier, fresh)
            assert {holder(tier, k) for k in fresh} == {str(roots[0]), str(roots[1])}
    note = f"root_dirs changed: 1 left ['{roots[2]}'], 0 joined []"
    assert note in caplog.text
    assert read_header(RootDir.open(roots[0])).root_set == tuple(sorted(map(str, roots[:2])))  # type: ignore[union-attr]


async def test_root_dirs_of_one_is_root_dir(tmp_path: Path) -> None:
    tier = FileSystemTier(root_dirs=[tmp_path / "d"], capacity_bytes="1MiB")
    assert not tier.config.striped
    async with opened(tier):
        await store(tier, [key(1)])
    header = read_header(RootDir.open(tmp_path / "d"))
    assert header is not None and header.root_set == ()
    assert '"root_set"' not in (tmp_path / "d" / "header.json").read_text()
    tier = FileSystemTier(root_dir=tmp_path / "d", capacity_bytes="1MiB")
    async with opened(tier):
        assert await tier.contains(key(1))


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"root_dir": "a", "root_dirs": ["b"]}, "give root_dir or root_dirs, not both"),
        ({}, "root_dir (or root_dirs, a list of directories) is required"),
        ({"root_dirs": "abc"}, "root_dirs must be a non-empty list of directories"),
        ({"root_dirs": []}, "root_dirs must be a non-empty list of directories"),
        ({"root_dirs": ["a", "a/../a"]}, "root_dirs lists one directory twice"),
    ],
)
def test_bad_root_dirs_are_refused_naming_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, options: dict[str, Any], message: str
) -> None:
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a").mkdir(mode=0o700)
    with pytest.raises(ConfigError, match="fs tier: ") as info:
        FileSystemTier(capacity_bytes="1MiB", **options)
    assert message in str(info.value)


# -- failing roots -------------------------------------------------------------------------


class FailingRootTier(FileSystemTier):
    """Ops on files under ``failing`` answer ``code`` while ``failing`` is set."""

    failing: Path | None = None
    code = errno.EIO

    def _make_backend(self, loop: Any, *, direct_io: bool) -> IoBackend:
        return FaultyBackend(super()._make_backend(loop, direct_io=direct_io), self._rule)

    def _rule(self, op: IoOp) -> OSError | None:
        failing = self.failing
        if failing is None:
            return None
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{op.fd}").startswith(str(failing) + "/"):
                return OSError(self.code, "injected: the drive is failing")
        return None


async def test_a_failing_root_is_taken_out_and_the_others_serve_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    roots = [tmp_path / f"d{i}" for i in range(3)]
    tier = FailingRootTier(root_dirs=roots, capacity_bytes="4MiB", durability="none")
    keys = [key(i) for i in range(150)]
    async with opened(tier) as removed:
        await store(tier, keys)
        lost = [k for k in keys if holder(tier, k) == str(roots[1])]
        tier.failing = roots[1]
        with caplog.at_level(logging.ERROR):
            for i in range(FAILED_CALLS_LIMIT):  # every call that reaches it fails
                got = await load(tier, [lost[i]])
                assert got == {lost[i]: None}
        errors = [r for r in caplog.records if "taken out of service" in r.getMessage()]
        assert len(errors) == 1 and str(roots[1]) in errors[0].getMessage()
        assert tier.stats.roots_out_of_service == 1 and tier.stats.root_failures == 1
        assert set(lost) <= set(removed)
        assert not any(await tier.contains_many(lost))
        # The others serve their blocks, and stores go to them only.
        others = [k for k in keys if k not in lost]
        assert all(v is not None for v in (await load(tier, others)).values())
        fresh = [key(i) for i in range(500, 600)]
        assert await store(tier, fresh) == {}
        assert {holder(tier, k) for k in fresh} == {str(roots[0]), str(roots[2])}
        # The drive heals: the probe brings it back, empty, and it takes stores again.
        tier.failing = None
        await tier.check_roots()
        assert tier.stats.roots_out_of_service == 0 and tier.stats.root_returns == 1
        assert not any(await tier.contains_many(lost))
        later = [key(i) for i in range(700, 800)]
        assert await store(tier, later) == {}
        assert str(roots[1]) in {holder(tier, k) for k in later}
        assert all(v is not None for v in (await load(tier, later)).values())


async def test_a_store_meant_for_a_root_that_fails_goes_to_the_next_one(tmp_path: Path) -> None:
    roots = [tmp_path / f"d{i}" for i in range(2)]
    tier = FailingRootTier(root_dirs=roots, capacity_bytes="8MiB", durability="none")
    async with opened(tier):
        tier.failing = roots[0]
        keys = [key(i) for i in range(400)]
        errors: dict[bytes, BaseException] = {}
        for start in range(0, 400, 20):
            errors.update(await store(tier, keys[start : start + 20]))
        # Only the calls before the one that took it out lost blocks to it: that one's
        # went to the other root. Nothing waited.
        assert tier.stats.roots_out_of_service == 1
        assert 0 < len(errors) <= (FAILED_CALLS_LIMIT - 1) * 20
        stored = [k for k in keys if k not in errors]
        assert {holder(tier, k) for k in stored} == {str(roots[1])}
        assert all(v is not None for v in (await load(tier, stored)).values())


async def test_a_root_deleted_under_the_tier_is_taken_out_and_never_refilled_bare(
    tmp_path: Path,
) -> None:
    roots = [tmp_path / f"d{i}" for i in range(2)]
    tier = striped(roots, durability="none")
    keys = [key(i) for i in range(100)]
    async with opened(tier) as removed:
        await store(tier, keys)
        gone = [k for k in keys if holder(tier, k) == str(roots[0])]
        shutil.rmtree(roots[0])
        await tier.check_roots()
        assert tier.stats.roots_out_of_service == 1
        assert set(gone) <= set(removed)
        fresh = [key(i) for i in range(200, 260)]
        assert await store(tier, fresh) == {}
        assert {holder(tier, k) for k in fresh} == {str(roots[1])}
        # An empty directory where it was (a mount point without its drive) stays out.
        roots[0].mkdir(mode=0o700)
        await tier.check_roots()
        assert tier.stats.roots_out_of_service == 1
        assert list(roots[0].iterdir()) == []


async def test_a_root_that_fills_up_is_taken_out(tmp_path: Path) -> None:
    other = tmp_path / "d1"
    with small_tmpfs(tmp_path / "small", "1m") as small:
        tier = striped([small, other], capacity_bytes=16 * BLOCK, durability="none")
        async with opened(tier):
            await store(tier, [key(i) for i in range(8)])
            fill_disk(small / "filler")
            errors: dict[bytes, BaseException] = {}
            for start in range(0, 400, 8):
                errors.update(await store(tier, [key(i) for i in range(start + 8, start + 16)]))
                if tier.stats.roots_out_of_service:
                    break
            assert tier.stats.roots_out_of_service == 1
            assert all(getattr(e, "errno", 0) == errno.ENOSPC for e in errors.values())
            fresh = [key(i) for i in range(1000, 1016)]
            assert await store(tier, fresh) == {}
            assert {holder(tier, k) for k in fresh} == {str(other)}


# -- a real drive failing: an ext4 loop device shut down under the tier ----------------------

EXT4_IOC_SHUTDOWN = 0x8004587D  # _IOR('X', 125, __u32)
EXT4_GOING_FLAGS_NOLOGFLUSH = 2


@contextlib.contextmanager
def ext4_loop(image: Path, mount: Path) -> Iterator[Path]:
    subprocess.run(["truncate", "-s", "48M", str(image)], check=True)
    made = subprocess.run(["mkfs.ext4", "-q", "-F", str(image)], capture_output=True, check=False)
    mount.mkdir()
    mounted = (
        subprocess.run(["mount", "-o", "loop", str(image), str(mount)], capture_output=True)
        if made.returncode == 0
        else made
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount an ext4 loop device here: {mounted.stderr.decode().strip()}")
    try:
        os.chmod(mount, 0o700)
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def shut_down(mount: Path) -> None:
    """Make the filesystem answer EIO to every op, as a dead drive does."""
    fd = os.open(mount, os.O_RDONLY)
    try:
        fcntl.ioctl(fd, EXT4_IOC_SHUTDOWN, struct.pack("I", EXT4_GOING_FLAGS_NOLOGFLUSH))
    finally:
        os.close(fd)


async def test_a_drive_that_dies_mid_run_costs_only_its_blocks(tmp_path: Path) -> None:
    other = tmp_path / "d1"
    with ext4_loop(tmp_path / "disk.img", tmp_path / "mnt") as drive:
        root = drive / "cache"
        tier = striped([root, other], capacity_bytes="8MiB", durability="none")
        keys = [key(i) for i in range(200)]
        async with opened(tier) as removed:
            assert await store(tier, keys) == {}
            on_drive = [k for k in keys if holder(tier, k) == str(root)]
            assert on_drive
            shut_down(drive)
            served = await load(tier, keys)  # its blocks fail (misses) until it is out
            assert tier.stats.roots_out_of_service == 1
            assert set(on_drive) <= set(removed)
            elsewhere = [k for k in keys if k not in on_drive]
            assert all(served[k] is not None for k in elsewhere)
            fresh = [key(i) for i in range(300, 400)]
            assert await store(tier, fresh) == {}
            assert {holder(tier, k) for k in fresh} == {str(other)}
            assert all(v is not None for v in (await load(tier, fresh)).values())
            await tier.check_roots()  # the dead drive stays out
            assert tier.stats.roots_out_of_service == 1


# -- every entry point -----------------------------------------------------------------------


def test_the_cli_list_syntax_gives_root_dirs() -> None:
    from tiering.cli.arguments import parse_tier_spec

    assert parse_tier_spec("fs:root_dirs=[/mnt/a, /mnt/b],capacity_bytes=8GiB") == {
        "type": "fs",
        "root_dirs": ["/mnt/a", "/mnt/b"],
        "capacity_bytes": "8GiB",
    }
    from tiering.cli.exits import UsageError

    with pytest.raises(UsageError, match="'\\[' without its '\\]'"):
        parse_tier_spec("fs:root_dirs=[/mnt/a,/mnt/b")


def test_replay_and_our_spec_take_root_dirs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from tiering.cli import main
    from tiering.spec import build_manager

    roots = [tmp_path / "d0", tmp_path / "d1"]
    tier = f"fs:root_dirs=[{roots[0]},{roots[1]}],capacity_bytes=16MiB"
    argv = ["replay", "--requests", "60", "--block-bytes", "8KiB", "--no-progress"]
    assert main([*argv, "--cpu-bytes", "1MiB", "--tier", tier]) == 0
    assert "verified byte for byte" in capsys.readouterr().out
    assert all((root / "header.json").exists() for root in roots)
    config = tmp_path / "striped.yaml"
    config.write_text(
        "cpu_bytes_to_use: 1MiB\n"
        f"secondary_tiers:\n  - {{type: fs, root_dirs: [{roots[0]}, {roots[1]}],"
        " capacity_bytes: 16MiB}\n"
    )
    assert main([*argv, "--config", str(config)]) == 0
    assert "verified byte for byte" in capsys.readouterr().out
    entry = {"type": "fs", "root_dirs": [str(r) for r in roots], "capacity_bytes": 1 << 20}
    manager = build_manager(
        {"cpu_bytes_to_use": 8 * 4096, "secondary_tiers": [entry]}, block_bytes=4096
    )
    try:
        assert manager.secondary_tiers[0].tier.config.root_dirs == tuple(roots)
    finally:
        manager.shutdown()


# -- the gauge: runtime statistics, the manager's snapshot, Prometheus -----------------------


def test_a_root_out_of_service_shows_in_stats_and_metrics(tmp_path: Path) -> None:
    import numpy as np

    from tests.runtime_support import load as load_job
    from tests.runtime_support import one_result
    from tests.runtime_support import store as store_job
    from tiering.core.stats import ManagerStats, TierCounters
    from tiering.manager.statistics import tier_holdings
    from tiering.metrics import MetricsExport
    from tiering.runtime import AsyncTierManager

    prometheus = pytest.importorskip("prometheus_client")
    roots = [tmp_path / "d0", tmp_path / "d1"]
    tier = FailingRootTier(root_dirs=roots, capacity_bytes="4MiB", durability="none")
    rows = np.zeros((64, BLOCK), dtype=np.uint8)
    keys = [key(i) for i in range(32)]
    with AsyncTierManager(tier, memoryview(rows), "fs", layout_fingerprint="fp") as runtime:
        runtime.submit_store(store_job(1, keys, list(range(32))))
        assert one_result(runtime).success
        assert runtime.stats().parts_out_of_service == 0
        on_d1 = [k for k in keys if holder(tier, k) == str(roots[1])]
        tier.failing = roots[1]  # read by the rule on the loop thread
        for job in range(FAILED_CALLS_LIMIT):
            runtime.submit_load(load_job(10 + job, on_d1[job : job + 1], [40]))
            assert not one_result(runtime).success
        assert runtime.stats().parts_out_of_service == 1
        held, _, out = tier_holdings(runtime)  # type: ignore[arg-type]
        assert out == 1 and held == len(keys) - len(on_d1)
    registry = prometheus.CollectorRegistry()
    export = MetricsExport("striped", registry)
    fs = TierCounters("fs", "disk").snapshot(
        blocks_held=1, capacity_blocks=2, parts_out_of_service=1
    )
    export.publish(ManagerStats((fs,), 0, 0, 0, 0, 0, 0, 0, 0, 0.0, False))
    labels = {"manager": "striped", "tier": "fs", "medium": "disk"}
    assert registry.get_sample_value("kv_tiering_tier_parts_out_of_service", labels) == 1
