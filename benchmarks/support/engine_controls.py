"""Control rows of ``benchmarks/engine_step.py``: the scheduler beside a process doing no tiering.

Owns the neighbour processes (``spin``, ``copy``, ``scatter``, ``hash``, ``disk``:
another process busy on the other CPU, each counting the bytes it moved) and
:func:`bench_neighbour`, which runs the scheduler's steps alone and beside one of
them in alternating rounds (the neighbour stopped with SIGSTOP between): the
machine's own floor under the tier rows.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.support.engine_report import TierRow
from benchmarks.support.rigs import pin_process
from benchmarks.support.scheduler import Phase, ToyScheduler, run_steps

#: Control rows: another process busy on the other CPU, doing no tiering at all.
#: What any tier that keeps a CPU busy costs the scheduler on this machine (the
#: floor under the tier rows): ``spin`` keeps a core busy with a pure-Python loop
#: (the core's scheduling and frequency, no memory traffic), ``copy`` copies 64 MiB
#: over and over with numpy (memory bandwidth and the shared cache, as a tier
#: moving bytes at full speed does), ``scatter`` copies 16 regions of 256 KiB at
#: random places of a 64 MiB pool into a 256 MiB one per call, through the
#: library's own bulk copy (the access pattern of a tier's blocks), ``hash`` takes
#: the xxh3-128 of random 256 KiB regions of a 256 MiB pool and evicts each from
#: the caches once hashed (what the tiers do with every block's checksum,
#: :mod:`tiering.copy.caches`), ``disk`` has 8
#: threads read and write random 256 KiB blocks of a 1 GiB file in the scratch
#: directory with O_DIRECT (the disk traffic of the fs tier, without the tier). Each
#: counts the bytes it moved and prints the count when stopped with SIGTERM; each
#: gets the scratch directory as its first argument.
_NEIGHBOUR_COUNTS = (
    "import signal, sys\n"
    "moved = 0\n"
    "def report(*_):\n"
    "    print(moved, flush=True)\n"
    "    sys.exit(0)\n"
    "signal.signal(signal.SIGTERM, report)\n"
)
NEIGHBOURS = {
    "spin": _NEIGHBOUR_COUNTS + "x = 0\nwhile True:\n    x += 1\n",
    "copy": _NEIGHBOUR_COUNTS
    + (
        "import numpy as np\n"
        "a = np.ones(64 << 20, np.uint8)\n"
        "b = np.empty_like(a)\n"
        "while True:\n"
        "    np.copyto(b, a)\n"
        "    moved += a.nbytes\n"
    ),
    "scatter": _NEIGHBOUR_COUNTS
    + (
        "import numpy as np\n"
        "from tiering.copy.bulk import copy_regions\n"
        "from tiering.primary.mappings import private_anonymous\n"
        "region = 256 << 10\n"
        "pools = [np.frombuffer(private_anonymous(n << 20), np.uint8) for n in (64, 256)]\n"
        "for pool in pools:\n"
        "    pool[:] = 1\n"
        "src, dst = (int(pool.ctypes.data) for pool in pools)\n"
        "rng = np.random.default_rng(0)\n"
        "while True:\n"
        "    copy_regions(src + rng.integers(0, 256, 16) * region,\n"
        "                 dst + rng.integers(0, 1024, 16) * region, region)\n"
        "    moved += 16 * region\n"
    ),
    "hash": _NEIGHBOUR_COUNTS
    + (
        "import random, numpy as np, xxhash\n"
        "from tiering.copy.caches import evict_block\n"
        "region = 256 << 10\n"
        "pool = memoryview(np.ones(256 << 20, np.uint8))\n"
        "rng = random.Random(0)\n"
        "while True:\n"
        "    at = rng.randrange(1024) * region\n"
        "    block = pool[at:at + region]\n"
        "    xxhash.xxh3_128_intdigest(block)\n"
        "    evict_block(block)\n"
        "    moved += region\n"
    ),
    "disk": _NEIGHBOUR_COUNTS
    + (
        "import mmap, os, random, threading, time\n"
        "path, size, block = os.path.join(sys.argv[1], 'disk-control'), 1 << 30, 256 << 10\n"
        "try:\n"
        "    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)\n"
        "except OSError as exc:\n"
        "    sys.exit(f'O_DIRECT unavailable in {sys.argv[1]}: {exc}')\n"
        "os.unlink(path)\n"
        "os.ftruncate(fd, size)\n"
        "counted = threading.Lock()\n"
        "def work(seed):\n"
        "    global moved\n"
        "    buffer, rng = mmap.mmap(-1, block), random.Random(seed)\n"
        "    buffer.write(bytes([seed]) * block)\n"
        "    for n in iter(int, 1):\n"
        "        offset = rng.randrange(size // block) * block\n"
        "        (os.preadv if n % 2 else os.pwritev)(fd, [buffer], offset)\n"
        "        with counted:\n"
        "            moved += block\n"
        "for seed in range(8):\n"
        "    threading.Thread(target=work, args=(seed,), daemon=True).start()\n"
        "while True:\n"
        "    time.sleep(1)\n"
    ),
}
NEIGHBOUR_WORK = {
    "spin": "a pure-Python loop",
    "copy": "numpy copying 64 MiB in a loop",
    "scatter": "the native bulk copy of 16 random 256 KiB regions in a loop",
    "hash": "xxh3-128 of random 256 KiB regions, each evicted from the caches once hashed",
    "disk": "8 threads reading and writing random 256 KiB blocks of a file with O_DIRECT",
}


def bench_neighbour(
    kind: str, args: argparse.Namespace, scratch: Path, pinned: bool = False
) -> TierRow:
    """Steps alone and beside another process running ``NEIGHBOURS[kind]``, in rounds.

    The process is stopped (SIGSTOP) during the alone rounds and continued
    during the others, so both see the same machine minutes apart at most.
    """
    row = TierRow(
        f"control: a {kind} process" + (" (pinned)" if pinned else ""),
        "another process on the other CPU: " + NEIGHBOUR_WORK[kind],
        placement="control",
    )
    cpus = args.cpus
    os.sched_setaffinity(0, {cpus[0]} if pinned else cpus)
    neighbour = subprocess.Popen(
        [sys.executable, "-c", NEIGHBOURS[kind], str(scratch)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    busy_s = 0.0
    try:
        if pinned:
            pin_process(neighbour.pid, frozenset(cpus[1:]))
        time.sleep(0.5)  # started, its arrays allocated
        if neighbour.poll() is not None:
            _, err = neighbour.communicate()
            row.skipped = err.strip().splitlines()[-1] if err.strip() else "it exited at once"
            return row
        os.kill(neighbour.pid, signal.SIGSTOP)
        scheduler = ToyScheduler(args.running)
        run_steps(scheduler, args.warm_s, None, Phase())
        slice_s, forward_s = args.seconds / args.rounds / 2, args.forward_ms / 1e3
        for _ in range(args.rounds):
            run_steps(scheduler, slice_s, None, row.alone, forward_s)
            started = time.perf_counter()
            os.kill(neighbour.pid, signal.SIGCONT)
            run_steps(scheduler, slice_s, None, row.busy, forward_s)
            os.kill(neighbour.pid, signal.SIGSTOP)
            busy_s += time.perf_counter() - started
        os.kill(neighbour.pid, signal.SIGTERM)
        os.kill(neighbour.pid, signal.SIGCONT)
        out, _ = neighbour.communicate(timeout=30)
        moved = int(out.split()[-1]) if out.split() else 0
        if moved:
            row.description += f", {moved / busy_s / 1e9:.1f} GB/s moved"
    finally:
        neighbour.kill()
        neighbour.wait()
    return row
