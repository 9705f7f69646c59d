"""The io_uring ring driven through raw syscalls (tiers.fs.io.kernel_ring), on real files."""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import time
from pathlib import Path

import pytest

from tests.fs_support import BACKENDS
from tiers.fs.io.kernel_ring import Completion, KernelRing, RingFull, ring_unsupported_reason

pytestmark = pytest.mark.skipif("uring" not in BACKENDS, reason="io_uring is not usable here")


def wait_for(ring: KernelRing, count: int) -> list[Completion]:
    got: list[Completion] = []
    deadline = time.monotonic() + 10
    while len(got) < count:
        got += ring.completions()
        assert time.monotonic() < deadline, f"only {len(got)} of {count} completions"
    return got


def address(region: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(region))


def test_single_and_vectored_io_round_trip(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "data", os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    source, target = mmap.mmap(-1, 16384), mmap.mmap(-1, 16384)
    ring = KernelRing(8)
    try:
        source[:] = os.urandom(16384)
        base = address(source)
        assert ring.prepare_rw(True, fd, 0, [(base, 4096)], 1) is None
        iov = ring.prepare_rw(True, fd, 4096, [(base + 4096, 4096), (base + 8192, 8192)], 2)
        assert iov is not None
        ring.prepare_fdatasync(fd, 3)
        assert ring.submit() == 3 and ring.pending == 0
        assert sorted(wait_for(ring, 3)) == [(1, 4096), (2, 12288), (3, 0)]
        out = address(target)
        keep = ring.prepare_rw(False, fd, 0, [(out, 8192), (out + 8192, 8192)], 4)
        ring.submit()
        assert wait_for(ring, 1) == [(4, 16384)]
        del keep, iov
        assert target[:] == source[:]
        assert ring.completions() == []
    finally:
        ring.close()
        ring.close()  # idempotent
        os.close(fd)


def test_errors_come_back_as_negative_errno() -> None:
    ring = KernelRing(4)
    try:
        buf = mmap.mmap(-1, 4096)
        ring.prepare_rw(False, 987654, 0, [(address(buf), 4096)], 7)
        ring.submit()
        assert wait_for(ring, 1) == [(7, -errno.EBADF)]
    finally:
        ring.close()


def test_full_submission_queue_raises_ring_full() -> None:
    ring = KernelRing(4)
    try:
        for user_data in range(ring.sq_entries):
            ring.prepare_fdatasync(0, user_data)
        assert ring.free_entries() == 0
        with pytest.raises(RingFull):
            ring.prepare_fdatasync(0, 99)
        ring.submit()
        assert len(wait_for(ring, ring.sq_entries)) == ring.sq_entries
        assert ring.free_entries() == ring.sq_entries
    finally:
        ring.close()


def test_other_architectures_are_refused_with_a_reason(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(platform, "machine", lambda: "aarch64")
    reason = ring_unsupported_reason()
    assert reason is not None and "x86-64 memory ordering" in reason
    with pytest.raises(OSError) as caught:
        KernelRing(4)
    assert caught.value.errno == errno.ENOSYS
