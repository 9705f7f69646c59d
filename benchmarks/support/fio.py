"""fio: the disk's O_DIRECT ceiling, for the benchmarks that compare a tier with the disk.

Owns :func:`run_fio` (one fio job, io_uring engine, O_DIRECT, read back from its JSON)
and :func:`ensure_fio` (fio on the PATH, installed from the distribution when missing
and allowed). Used by ``benchmarks/fs_tier.py`` and ``benchmarks/vllm_tiers.py``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class FioRun:
    """What one fio job moved, how long it ran and the CPU share it used."""

    io_bytes: int
    runtime_s: float
    cpu_share: float  # user + system CPU over the run's wall time

    @property
    def gbps(self) -> float:
        return self.io_bytes / self.runtime_s / 1e9


def run_fio(
    path: str | Path, *, write: bool, block: int, size: int, depth: int, end_fsync: bool
) -> FioRun | None:
    """fio's figure for ``size`` bytes of sequential ``block``-sized O_DIRECT ops at ``depth``.

    None when fio is not installed or the job fails.
    """
    if shutil.which("fio") is None:
        return None
    rw = "write" if write else "read"
    cmd = [
        "fio",
        "--name=ceiling",
        f"--filename={path}",
        f"--rw={rw}",
        f"--bs={block}",
        f"--size={size}",
        "--direct=1",
        "--ioengine=io_uring",
        f"--iodepth={depth}",
        *(["--end_fsync=1"] if end_fsync else []),
        "--output-format=json",
    ]
    out = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if out.returncode != 0:
        return None
    job = json.loads(out.stdout)["jobs"][0]
    return FioRun(
        io_bytes=int(job[rw]["io_bytes"]),
        runtime_s=job["job_runtime"] / 1000,
        cpu_share=(job["usr_cpu"] + job["sys_cpu"]) / 100,
    )


def ensure_fio() -> bool:
    """fio on the PATH, installed from the distribution when missing and allowed (root)."""
    if shutil.which("fio") is not None:
        return True
    if os.geteuid() == 0 and shutil.which("apt-get") is not None:
        print("# fio is missing: apt-get install -y fio", flush=True)
        subprocess.run(
            ["apt-get", "install", "-y", "-q", "fio"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            check=False,
        )
    found = shutil.which("fio") is not None
    if not found:
        print("# fio is not available: ceilings from the Python raw loops only", flush=True)
    return found
