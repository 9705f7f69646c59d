"""kill -9 in the middle of writes: after restart every acknowledged block is back, none torn."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from tests.fs_support import BACKENDS, BLOCK, block_data, key, opened, read_key

REPO = Path(__file__).resolve().parents[1]


def run_and_kill(
    root: Path, capacity: int, durability: str, backend: str, acks: int
) -> tuple[set[int], set[int]]:
    """Start the writer, SIGKILL it after ``acks`` acknowledged batches; (acked, evicted)."""
    # stderr goes to a file, so it can never fill a pipe nobody reads
    with tempfile.TemporaryFile(mode="w+") as errors:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.fs_crash_writer",
                str(root),
                str(capacity),
                durability,
                backend,
            ],
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=errors,
            text=True,
            env={**os.environ, "PYTHONPATH": str(REPO)},
        )
        acked: set[int] = set()
        evicted: set[int] = set()
        batches = 0

        def note(line: str) -> None:
            nonlocal batches
            word, *numbers = line.split() or [""]
            if word == "ACK":
                acked.update(map(int, numbers))
                batches += 1
            elif word == "DEL":
                evicted.update(map(int, numbers))

        stdout = proc.stdout
        assert stdout is not None
        try:
            for line in stdout:
                note(line)
                if batches >= acks:
                    proc.send_signal(signal.SIGKILL)  # mid-stream: other batches are in flight
                    break
        finally:
            proc.kill()
            # Lines written before the kill: evictions (printed before their DEL record is
            # journaled) and acknowledgements not read yet. They are read through the same
            # buffered reader: it may already hold some of them (it reads ahead), so reading
            # the pipe's fd directly (as communicate() does) would lose those.
            for line in stdout:
                note(line)
            stdout.close()
            proc.wait(timeout=30)
            errors.seek(0)
            err = errors.read()
    assert batches >= acks, f"writer died early: {err}"
    assert proc.returncode == -signal.SIGKILL
    return acked, evicted


@pytest.mark.parametrize(
    ("capacity", "durability", "acks", "backend"),
    [
        (4096, "none", 40, BACKENDS[-1]),
        (64, "none", 60, BACKENDS[-1]),
        (64, "fsync", 25, BACKENDS[-1]),
        (64, "none", 40, "threads"),
    ],
    ids=["no-eviction", "eviction", "eviction-fsync", "eviction-threads"],
)
async def test_recovery_after_sigkill_mid_stream(
    tmp_path: Path, capacity: int, durability: str, acks: int, backend: str
) -> None:
    acked, evicted = run_and_kill(tmp_path, capacity, durability, backend, acks)
    async with opened(tmp_path, capacity_bytes=capacity * BLOCK) as tier:
        recovered = {int.from_bytes(k[:8], "big") for k in await tier.list_keys()}
        # Every acknowledged block that was not evicted is back...
        assert acked - evicted <= recovered, sorted(acked - evicted - recovered)[:10]
        assert len(recovered) <= capacity
        # ...and nothing listed is torn or wrong: every listed block reads back exactly.
        for i in recovered:
            assert await read_key(tier, key(i)) == block_data(key(i)), f"block {i} differs"
        assert tier.stats.corrupt_blocks == 0
        # The recovered cache keeps working.
        await tier.write(key(10**9), memoryview(block_data(key(10**9))))
    async with opened(tmp_path, capacity_bytes=capacity * BLOCK) as tier:
        assert await tier.contains(key(10**9))
