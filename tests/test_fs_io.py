"""I/O backends (io_uring and threads) and the read-priority dispatcher, on real files."""

from __future__ import annotations

import asyncio
import errno
import mmap
import os
import threading
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.fs_support import BACKENDS
from tiers.fs.io import IoBackend, IoOp, OpKind, Priority, ThreadBackend, UringBackend
from tiers.fs.io.aligned import BouncePool, is_aligned
from tiers.fs.io.ops import Dispatcher


def make_backend(name: str) -> IoBackend:
    loop = asyncio.get_running_loop()
    if name == "uring":
        return UringBackend(loop, queue_depth=8)
    return ThreadBackend(loop, n_read_threads=2, n_write_threads=1)


def aligned(nbytes: int) -> memoryview:
    return memoryview(mmap.mmap(-1, nbytes))


@pytest.mark.parametrize("backend_name", BACKENDS)
@pytest.mark.parametrize("direct", [True, False])
async def test_vectored_writes_and_reads_round_trip(
    tmp_path: Path, backend_name: str, direct: bool
) -> None:
    path = tmp_path / "data"
    path.write_bytes(bytes(1 << 20))
    fd = os.open(path, os.O_RDWR | (os.O_DIRECT if direct else 0))
    backend = make_backend(backend_name)
    try:
        src = [aligned(8192) for _ in range(6)]
        for i, buf in enumerate(src):
            buf[:] = bytes([i + 1]) * 8192
        writes = [IoOp(OpKind.WRITE, fd, 0, src[:3]), IoOp(OpKind.WRITE, fd, 65536, src[3:])]
        await backend.run([*writes, IoOp(OpKind.FSYNC, fd)])
        assert all(op.ok for op in writes)
        dst = [aligned(8192) for _ in range(6)]
        reads = [IoOp(OpKind.READ, fd, 0, dst[:3]), IoOp(OpKind.READ, fd, 65536, dst[3:])]
        await backend.run(reads)
        assert all(op.ok and op.done == 3 * 8192 for op in reads)
        assert [bytes(b) for b in dst] == [bytes(b) for b in src]
    finally:
        await backend.aclose()
        await backend.aclose()  # idempotent
        os.close(fd)


@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_short_read_at_end_of_file_and_errors(tmp_path: Path, backend_name: str) -> None:
    path = tmp_path / "data"
    path.write_bytes(b"x" * 10000)
    fd = os.open(path, os.O_RDWR)
    backend = make_backend(backend_name)
    try:
        short = IoOp(OpKind.READ, fd, 8192, [memoryview(bytearray(4096))])
        bad_fd = IoOp(OpKind.READ, 987654, 0, [memoryview(bytearray(4096))])
        await backend.run([short, bad_fd])
        assert short.error is None and short.done == 10000 - 8192 and not short.ok
        assert isinstance(bad_fd.error, OSError) and bad_fd.error.errno == errno.EBADF
    finally:
        await backend.aclose()
        os.close(fd)


@pytest.mark.parametrize("backend_name", BACKENDS)
async def test_cancelled_run_withdraws_queued_ops_and_waits_for_started_ones(
    tmp_path: Path, backend_name: str
) -> None:
    path = tmp_path / "data"
    path.write_bytes(bytes(64 << 20))
    fd = os.open(path, os.O_RDONLY)
    backend = make_backend(backend_name)
    try:
        ops = [IoOp(OpKind.READ, fd, i << 20, [aligned(1 << 20)]) for i in range(64)]
        task = asyncio.create_task(backend.run(ops))
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Nothing is left running: every op either finished or was withdrawn.
        assert all(op.ok or isinstance(op.error, asyncio.CancelledError) for op in ops)
        assert any(isinstance(op.error, asyncio.CancelledError) for op in ops)
        assert ops[0].batch is not None and ops[0].batch.pending == 0
    finally:
        await backend.aclose()
        os.close(fd)


async def test_uring_op_that_cannot_enter_the_ring_fails_instead_of_hanging(
    tmp_path: Path,
) -> None:
    if "uring" not in BACKENDS:
        pytest.skip("io_uring is not available on this machine")
    path = tmp_path / "data"
    path.write_bytes(bytes(65536))
    fd = os.open(path, os.O_RDWR)
    backend = make_backend("uring")
    assert isinstance(backend, UringBackend)
    real_prepare = backend._prepare
    refused: list[IoOp] = []

    def refuse_first(op: IoOp) -> None:
        if not refused:
            refused.append(op)
            raise RuntimeError("io_uring submission queue is full")
        real_prepare(op)

    backend._prepare = refuse_first  # type: ignore[method-assign]
    try:
        ops = [IoOp(OpKind.READ, fd, i * 4096, [memoryview(bytearray(4096))]) for i in range(4)]
        async with asyncio.timeout(10):
            await backend.run(ops)
        assert refused == [ops[0]]
        assert isinstance(ops[0].error, OSError) and "queue is full" in str(ops[0].error)
        assert all(op.ok for op in ops[1:])
    finally:
        await backend.aclose()
        os.close(fd)


async def test_thread_backend_joins_its_threads(tmp_path: Path) -> None:
    def io_threads() -> list[str]:
        return [t.name for t in threading.enumerate() if t.name.startswith("fs-tier-")]

    assert io_threads() == []
    backend = make_backend("threads")
    assert sorted(io_threads()) == ["fs-tier-read-0", "fs-tier-read-1", "fs-tier-write-0"]
    await backend.aclose()
    assert io_threads() == []
    with pytest.raises(RuntimeError, match="closed"):
        await backend.run([IoOp(OpKind.FSYNC, 0)])


def test_short_transfer_remainder() -> None:
    bufs = [memoryview(bytearray(b"a" * 4)), memoryview(bytearray(b"b" * 4))]
    op = IoOp(OpKind.WRITE, 0, 0, bufs)
    op.done = 6
    assert [bytes(b) for b in op.remaining()] == [b"bb"]
    op.done = 4
    assert [bytes(b) for b in op.remaining()] == [b"bbbb"]


def test_dispatcher_prefers_reads_without_starving_writes() -> None:
    dispatcher = Dispatcher(read_burst=3)
    reads = [IoOp(OpKind.READ, 0) for _ in range(10)]
    writes = [IoOp(OpKind.WRITE, 0) for _ in range(3)]
    urgent = IoOp(OpKind.FSYNC, 0)
    for op in writes + reads:
        dispatcher.push(op)
    dispatcher.push(urgent)
    order = [dispatcher.pop() for _ in range(14)]
    assert order[0] is urgent
    kinds = "".join("r" if op is not None and op.kind is OpKind.READ else "w" for op in order[1:])
    assert kinds == "rrrwrrrwrrrwr"
    assert dispatcher.pop() is None and len(dispatcher) == 0


def test_dispatcher_thread_preferences_and_write_cap() -> None:
    dispatcher = Dispatcher()
    read, write = IoOp(OpKind.READ, 0), IoOp(OpKind.WRITE, 0)
    dispatcher.push(read)
    dispatcher.push(write)
    assert dispatcher.pop(prefer=Priority.WRITE) is write
    dispatcher.push(write)
    assert dispatcher.pop(writes_allowed=False) is read
    assert dispatcher.pop(writes_allowed=False) is None
    assert dispatcher.pop(prefer=Priority.READ) is write


@given(st.lists(st.booleans(), max_size=30), st.data())
def test_withdrawn_ops_never_run(kinds: list[bool], data: st.DataObject) -> None:
    dispatcher = Dispatcher()
    ops = [IoOp(OpKind.READ if k else OpKind.WRITE, 0) for k in kinds]
    for op in ops:
        dispatcher.push(op)
    started = [dispatcher.pop() for _ in range(data.draw(st.integers(0, len(ops))))]
    withdrawn = dispatcher.withdraw(ops)
    assert {id(op) for op in withdrawn}.isdisjoint(id(op) for op in started)
    assert len(withdrawn) + len(started) == len(ops)
    assert len(dispatcher) == 0 and dispatcher.pop() is None


def test_alignment_checks_and_bounce_pool() -> None:
    buf = aligned(8192)
    assert is_aligned(buf) and is_aligned(buf.toreadonly())
    assert not is_aligned(buf[512:4608])
    assert not is_aligned(buf[:1000])
    pool = BouncePool(8192, keep=1)
    a, b = pool.take(), pool.take()
    assert is_aligned(a) and is_aligned(b) and a.nbytes == 8192
    pool.give(a)
    pool.give(b)
    assert pool.take() is a  # kept for reuse
    with pytest.raises(ValueError):
        BouncePool(1000, keep=1)
