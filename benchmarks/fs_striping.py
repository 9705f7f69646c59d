"""Striping across drives: one fs tier over N throttled loop devices, against N x one root.

For each N of ``--roots`` (1, 2, 4 by default) the benchmark makes N ext4
filesystems on loop devices, throttles each device to the same ``--bps`` for
reads and for writes (cgroup v1 ``blkio.throttle.*_bps_device``, applied to
this process and its fio children), and then, in that cgroup:

* stores ``--per-root-mib`` MiB per root through one ``FileSystemTier`` with
  ``root_dirs`` (O_DIRECT, ``--jobs-in-flight`` calls of ``--job-blocks``
  blocks at once), then loads them all back in another order;
* runs fio on the same N devices at once (one O_DIRECT job per device, the
  same block size): the devices' ceiling.

It prints, per N and phase, the tier's GB/s, its ratio to N x the one-root
figure of the same run (targets: >= 1.8x at N = 2, >= 3.4x at N = 4) and its
share of fio's. Throttled devices make the drives, not this machine's one
disk, the limit, so the ratio shows what striping adds. Needs root, losetup,
mkfs.ext4 and cgroup v1 blkio; says what is missing otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import mmap
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.support.common import MIB, print_aligned_table
from benchmarks.support.fio import FioRun, run_fio
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.support.native_probe import describe_cpu
from tiering.support.units import parse_size
from tiering.tier import TierContext
from tiers.fs import FileSystemTier

BLKIO = Path("/sys/fs/cgroup/blkio")
TARGETS = {2: 1.8, 4: 3.4}  # x the one-root figure of the same run


def missing_requirement() -> str | None:
    """Why this machine cannot run the benchmark (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (loop devices, mounts, cgroup throttles)"
    for tool in ("losetup", "mkfs.ext4", "mount", "umount"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not (BLKIO / "blkio.throttle.read_bps_device").exists():
        return "cgroup v1 blkio throttling is not mounted at /sys/fs/cgroup/blkio"
    return None


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.strip()


@contextlib.contextmanager
def loop_drives(scratch: Path, count: int, size: int) -> Iterator[list[tuple[Path, str]]]:
    """``count`` mounted ext4 loop devices of ``size`` bytes: (mount point, "MAJ:MIN") each."""
    drives: list[tuple[Path, str, str]] = []
    scratch.mkdir(parents=True, exist_ok=True)
    try:
        for i in range(count):
            image, mount = scratch / f"drive{i}.img", scratch / f"drive{i}"
            with open(image, "wb") as f:
                f.truncate(size)
            _run("mkfs.ext4", "-q", "-F", str(image))
            device = _run("losetup", "-f", "--show", str(image))
            mount.mkdir()
            _run("mount", device, str(mount))
            drives.append((mount, device, _run("lsblk", "-dno", "MAJ:MIN", device)))
            os.chmod(mount, 0o700)
        yield [(mount, numbers) for mount, _, numbers in drives]
    finally:
        for mount, device, _ in drives:
            subprocess.run(["umount", str(mount)], capture_output=True, check=False)
            subprocess.run(["losetup", "-d", device], capture_output=True, check=False)


@contextlib.contextmanager
def throttled(devices: list[str], bps: int) -> Iterator[None]:
    """This process (and the children it starts) limited to ``bps`` per device."""
    group = BLKIO / f"kv-tiering-striping-{os.getpid()}"
    group.mkdir()
    try:
        for numbers in devices:
            for kind in ("read", "write"):
                (group / f"blkio.throttle.{kind}_bps_device").write_text(f"{numbers} {bps}\n")
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
        try:
            yield
        finally:
            (BLKIO / "cgroup.procs").write_text(f"{os.getpid()}\n")
    finally:
        group.rmdir()


async def through_tier(
    roots: list[Path], block: int, per_root: int, job_blocks: int, in_flight: int
) -> tuple[float, float]:
    """Store then load ``per_root`` bytes per root through one striped tier: (store, load) GB/s."""
    count = per_root * len(roots) // block
    capacity = per_root + 64 * block  # every block fits: no eviction in the figures
    tier = FileSystemTier(
        root_dirs=roots if len(roots) > 1 else None,
        root_dir=roots[0] if len(roots) == 1 else None,
        capacity_bytes=capacity,
        direct_io=True,
        durability="none",
    )
    await tier.open(TierContext(block, "striping-bench", "striping"))
    buffers = memoryview(mmap.mmap(-1, in_flight * job_blocks * block))
    rows = [buffers[i * block : (i + 1) * block] for i in range(in_flight * job_blocks)]
    for i, row in enumerate(rows):  # distinct bytes per row, written once
        row[:8] = i.to_bytes(8, "little")
    keys: list[OffloadKey] = [make_offload_key(i.to_bytes(8, "big"), 0) for i in range(count)]
    jobs = [keys[i : i + job_blocks] for i in range(0, count, job_blocks)]
    try:
        store = await _jobs(tier, jobs, rows, job_blocks, in_flight, load=False)
        random.Random(0).shuffle(jobs)
        load = await _jobs(tier, jobs, rows, job_blocks, in_flight, load=True)
    finally:
        await tier.aclose()
    return count * block / store / 1e9, count * block / load / 1e9


async def _jobs(
    tier: FileSystemTier,
    jobs: list[list[OffloadKey]],
    rows: list[memoryview],
    job_blocks: int,
    in_flight: int,
    load: bool,
) -> float:
    """Seconds to run ``jobs``, ``in_flight`` at a time, each on its own rows."""
    queue = list(reversed(jobs))

    async def worker(slot: int) -> None:
        mine = rows[slot * job_blocks : (slot + 1) * job_blocks]
        while queue:
            job = queue.pop()
            call = tier.read_many if load else tier.write_many
            await call(job, mine[: len(job)])

    start = time.perf_counter()
    await asyncio.gather(*(worker(i) for i in range(in_flight)))
    return time.perf_counter() - start


def fio_on_each(mounts: list[Path], block: int, per_root: int, write: bool) -> float:
    """fio on every device at once, one job each: their summed GB/s (0 if fio failed)."""

    def one(mount: Path) -> FioRun | None:
        return run_fio(
            mount / "fio.dat", write=write, block=block, size=per_root, depth=32, end_fsync=write
        )

    with ThreadPoolExecutor(len(mounts)) as pool:
        runs = list(pool.map(one, mounts))
    if any(run is None for run in runs):
        return 0.0
    return sum(run.gbps for run in runs if run is not None)


def measure(args: argparse.Namespace, scratch: Path, n: int) -> dict[str, tuple[float, float]]:
    """{phase: (tier GB/s, fio GB/s)} for ``n`` throttled roots."""
    size = 2 * args.per_root + 512 * MIB  # the tier's slabs, fio's file, ext4's own
    with (
        loop_drives(scratch / f"n{n}", n, size) as drives,
        throttled([numbers for _, numbers in drives], args.bps),
    ):
        mounts = [mount for mount, _ in drives]
        roots = [mount / "kv" for mount in mounts]
        store, load = asyncio.run(
            through_tier(roots, args.block, args.per_root, args.job_blocks, args.jobs_in_flight)
        )
        fio_store = fio_on_each(mounts, args.block, args.per_root, write=True)
        fio_load = fio_on_each(mounts, args.block, args.per_root, write=False)
    return {"store": (store, fio_store), "load": (load, fio_load)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--roots", default="1,2,4", help="numbers of roots (1 is measured first)")
    # 50 MiB/s: four devices then stay under what this machine's own disk sustains (at
    # 100 MiB/s each, fio on four reached only 3.2x of one); the drives must be the limit.
    parser.add_argument("--bps", default="50MiB", help="throttle per device, each direction")
    parser.add_argument("--block", default="2MiB")
    parser.add_argument("--per-root-mib", type=int, default=512, help="data per root and phase")
    parser.add_argument("--job-blocks", type=int, default=16)
    parser.add_argument("--jobs-in-flight", type=int, default=8)
    parser.add_argument("--dir", default=None, help="scratch directory (default: $TMPDIR)")
    parser.add_argument("--smoke", action="store_true", help="1 and 2 roots, 16 MiB each")
    args = parser.parse_args()
    args.block = parse_size(args.block)
    args.bps = parse_size(args.bps)
    counts = sorted({1, *(int(n) for n in args.roots.split(","))})
    if args.smoke:
        counts, args.per_root_mib, args.bps = [1, 2], 16, 64 * MIB
    args.per_root = args.per_root_mib * MIB
    print(f"CPU: {describe_cpu()}")
    why = missing_requirement()
    if why is not None:
        print(f"skipped: {why}")
        return
    print(
        f"devices: ext4 on loop devices, each throttled to {args.bps / MIB:.0f} MiB/s read and "
        f"write (cgroup v1 blkio); {args.block // 1024} KiB blocks, "
        f"{args.per_root_mib} MiB per root and phase, O_DIRECT"
    )
    with tempfile.TemporaryDirectory(prefix="kvt-striping-", dir=args.dir) as tmp:
        results = {n: measure(args, Path(tmp), n) for n in counts}
    rows, verdicts = [], []
    for n in counts:
        for phase in ("store", "load"):
            gbps, fio = results[n][phase]
            one = results[1][phase][0]
            scale = gbps / one if one else 0.0
            target = TARGETS.get(n)
            rows.append(
                (
                    str(n),
                    phase,
                    f"{gbps:.3f}",
                    f"{n * one:.3f}",
                    f"{scale:.2f}x",
                    f"{fio:.3f}" if fio else "n/a",
                    f"{gbps / fio:.0%}" if fio else "n/a",
                    f">= {target}x" if target else "-",
                )
            )
            if target:
                met = "ok" if scale >= target else "BELOW"
                verdicts.append(
                    f"verdict: --roots {n} {phase} {scale:.2f}x of one root "
                    f"(target >= {target}x): {met}"
                )
    print_aligned_table(
        ("roots", "phase", "GB/s", "N x 1 root", "scaling", "fio GB/s", "of fio", "target"), rows
    )
    for line in verdicts:
        print(line)


if __name__ == "__main__":
    main()
