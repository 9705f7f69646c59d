"""HostBuffer: geometry, zero-copy views, shared memory across processes, O_DIRECT alignment."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from tiering.core.errors import ConfigError
from tiering.primary.host_buffer import SHM_DIR, HostBuffer, make_shared_name, remove_stale_shared

BLOCK = 4096


@pytest.fixture
def shm_name() -> Iterator[str]:
    name = make_shared_name("kvtier_test")
    yield name
    Path(SHM_DIR, name).unlink(missing_ok=True)


def test_anonymous_buffer_geometry_and_zero_fill() -> None:
    with HostBuffer.create(3, 2 * BLOCK) as buf:
        view = buf.view
        assert (view.format, view.ndim, view.shape) == ("B", 2, (3, 2 * BLOCK))
        assert view.strides == (2 * BLOCK, 1)
        assert not view.readonly
        assert buf.name is None and buf.nbytes == 3 * 2 * BLOCK
        assert not buf.as_numpy().any()


def test_rows_numpy_and_view_share_the_same_bytes() -> None:
    with HostBuffer.create(4, BLOCK) as buf:
        row = buf.row(2)
        assert (row.ndim, row.nbytes) == (1, BLOCK)
        row[:5] = b"hello"
        array = buf.as_numpy()
        assert array.shape == (4, BLOCK) and array.dtype == np.uint8
        assert bytes(array[2, :5]) == b"hello"
        array[3, -3:] = [7, 8, 9]
        assert buf.view.tobytes()[-3:] == bytes([7, 8, 9])
        assert bytes(buf.row(3)[-3:]) == bytes([7, 8, 9])
        assert not array[[0, 1]].any()  # neighbours untouched
        with pytest.raises(IndexError, match="outside"):
            buf.row(4)
        with pytest.raises(IndexError):
            buf.row(-1)


def test_rows_are_page_aligned() -> None:
    with HostBuffer.create(5, 3 * BLOCK) as buf:
        base = buf.address()
        assert base % BLOCK == 0
        assert int(buf.as_numpy()[4].ctypes.data) - base == 4 * 3 * BLOCK


@pytest.mark.parametrize(
    ("num_blocks", "block_bytes", "match"),
    [
        (0, BLOCK, "num_blocks must be >= 1"),
        (-2, BLOCK, "num_blocks must be >= 1"),
        (1, 0, "block_bytes must be positive"),
        (1, 1000, "multiple of 4096"),
        (1, BLOCK + 512, "multiple of 4096"),
        (1.5, BLOCK, "num_blocks must be an int"),
        (True, BLOCK, "num_blocks must be an int"),
    ],
)
def test_bad_geometry_is_rejected(num_blocks: object, block_bytes: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        HostBuffer.create(num_blocks, block_bytes)  # type: ignore[arg-type]


def test_unaligned_blocks_allowed_when_not_required() -> None:
    with HostBuffer.create(3, 100, require_alignment=False) as buf:
        assert buf.view.strides[0] == 100
        buf.row(2)[:] = bytes(range(100))
        assert bytes(buf.as_numpy()[2]) == bytes(range(100))
    with pytest.raises(ConfigError, match="block_bytes must be positive"):
        HostBuffer.create(1, 0, require_alignment=False)


def test_close_is_idempotent_and_tolerates_outstanding_views() -> None:
    buf = HostBuffer.create(2, BLOCK)
    array = buf.as_numpy()
    row = buf.row(1)
    array[1, 0] = 42
    buf.close()
    buf.close()
    assert buf.closed
    # Views held elsewhere stay valid: the memory is unmapped when they go.
    assert array[1, 0] == 42 and row[0] == 42
    for use in (lambda: buf.view, lambda: buf.row(0), buf.as_numpy):
        with pytest.raises(ValueError, match="closed"):
            use()


def test_shared_buffer_create_attach_and_unlink(shm_name: str) -> None:
    path = Path(SHM_DIR, shm_name)
    with HostBuffer.create(3, BLOCK, shared_name=shm_name) as owner:
        assert path.stat().st_size == 3 * BLOCK
        assert owner.name == shm_name and owner.is_owner
        owner.row(1)[:4] = b"abcd"
        with HostBuffer.attach(shm_name, 3, BLOCK) as other:
            assert not other.is_owner
            assert bytes(other.row(1)[:4]) == b"abcd"
            other.row(2)[-1] = 9
        assert path.exists(), "an attached handle must not unlink the name"
        assert owner.row(2)[-1] == 9
    assert not path.exists(), "the owner's context exit unlinks the name"


def test_shared_buffer_misuse(shm_name: str) -> None:
    with HostBuffer.create(2, BLOCK, shared_name=shm_name):
        with pytest.raises(FileExistsError, match=shm_name):
            HostBuffer.create(2, BLOCK, shared_name=shm_name)
        with pytest.raises(ConfigError, match="expected 3 blocks"):
            HostBuffer.attach(shm_name, 3, BLOCK)
    with pytest.raises(FileNotFoundError, match=shm_name):
        HostBuffer.attach(shm_name, 2, BLOCK)
    for bad in ("", "a/b", "..", "x" * 300, "sp ace"):
        with pytest.raises(ConfigError, match="shared memory name"):
            HostBuffer.create(1, BLOCK, shared_name=bad)


def _child_swaps_rows(name: str, num_blocks: int, block_bytes: int) -> bytes:
    """Runs in a spawned process: read row 0, write its reverse into row 1."""
    with HostBuffer.attach(name, num_blocks, block_bytes) as buf:
        seen = bytes(buf.row(0))
        buf.row(1)[:] = seen[::-1]
        return seen


def test_second_process_attaches_by_name_and_sees_the_same_bytes(shm_name: str) -> None:
    pattern = np.random.default_rng(7).integers(0, 256, BLOCK, dtype=np.uint8).tobytes()
    with HostBuffer.create(2, BLOCK, shared_name=shm_name) as buf:
        buf.row(0)[:] = pattern
        context = multiprocessing.get_context("spawn")
        with context.Pool(1) as pool:
            seen = pool.apply(_child_swaps_rows, (shm_name, 2, BLOCK))
        assert seen == pattern
        assert bytes(buf.row(1)) == pattern[::-1]


def test_o_direct_write_and_read_through_rows(tmp_path: Path) -> None:
    path = tmp_path / "direct.bin"
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_DIRECT, 0o600)
    except OSError as exc:
        if exc.errno in (errno.EINVAL, errno.EOPNOTSUPP):
            pytest.skip(f"{tmp_path} refuses O_DIRECT: {exc}")
        raise
    try:
        with HostBuffer.create(4, 2 * BLOCK) as buf:
            data = np.random.default_rng(3).integers(0, 256, (2, 2 * BLOCK), dtype=np.uint8)
            buf.as_numpy()[:2] = data
            written = os.pwritev(fd, [buf.row(0), buf.row(1)], 0)
            assert written == 4 * BLOCK
            assert os.preadv(fd, [buf.row(3), buf.row(2)], 0) == 4 * BLOCK
            assert (buf.as_numpy()[3] == data[0]).all()
            assert (buf.as_numpy()[2] == data[1]).all()
    finally:
        os.close(fd)
    assert path.read_bytes() == data.tobytes()


def test_as_torch_is_zero_copy() -> None:
    torch = pytest.importorskip("torch")
    with HostBuffer.create(2, BLOCK) as buf:
        tensor = buf.as_torch()
        assert tensor.shape == (2, BLOCK) and tensor.dtype == torch.uint8
        tensor[1, 5] = 200
        assert buf.row(1)[5] == 200
        del tensor


def test_importing_the_primary_tier_does_not_import_torch() -> None:
    code = (
        "import sys, tiering, tiering.primary.host_buffer, tiering.primary; "
        "assert 'torch' not in sys.modules, 'torch imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- buffers left behind by dead processes ------------------------------------------------

_HOLDER = """
import sys
from tiering.primary.host_buffer import HostBuffer, make_shared_name
buffer = HostBuffer.create(2, 4096, shared_name=make_shared_name(sys.argv[1]))
print(buffer.name, flush=True)
sys.stdin.read()  # lives until the test closes our stdin
"""


def _dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        capture_output=True,
        text=True,
        check=True,
    )
    return int(proc.stdout)


def test_stale_buffers_of_dead_creators_are_removed_and_live_ones_never_touched() -> None:
    prefix = f"kvtiertest{os.getpid()}"
    holder = subprocess.Popen(
        [sys.executable, "-c", _HOLDER, prefix],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=Path(__file__).resolve().parent.parent,
    )
    created: list[str] = []
    try:
        assert holder.stdout is not None
        live_locked = holder.stdout.readline().strip()  # a live process's buffer, locked
        assert live_locked.startswith(f"{prefix}-{holder.pid}-")
        # A live process's name without the lock (e.g. made by an older version): kept.
        live_unlocked = f"{prefix}-{holder.pid}-{'1' * 16}"
        # A dead creator's buffers: one unlocked (removed), one whose lock a live process
        # still holds (an inherited descriptor, or a creator in another pid namespace): kept.
        dead = _dead_pid()
        dead_unlocked = f"{prefix}-{dead}-{'2' * 16}"
        dead_but_locked = f"{prefix}-{dead}-{'3' * 16}"
        other_prefix = f"other{os.getpid()}-{dead}-{'4' * 16}"
        for name in (live_unlocked, dead_unlocked, dead_but_locked, other_prefix):
            with open(os.path.join(SHM_DIR, name), "wb") as file:
                file.write(b"\0" * 4096)
            created.append(name)
        lock_fd = os.open(os.path.join(SHM_DIR, dead_but_locked), os.O_RDONLY)
        fcntl.flock(lock_fd, fcntl.LOCK_EX)
        try:
            assert remove_stale_shared(prefix) == [dead_unlocked]
        finally:
            os.close(lock_fd)
        left = set(os.listdir(SHM_DIR))
        assert {live_locked, live_unlocked, dead_but_locked, other_prefix} <= left
        assert dead_unlocked not in left
        # Creating a buffer sweeps too: the dead creator's last one goes now that it is free.
        with HostBuffer.create(1, 4096, shared_name=make_shared_name(prefix)) as mine:
            assert dead_but_locked not in os.listdir(SHM_DIR)
            assert live_locked in os.listdir(SHM_DIR) and mine.name in os.listdir(SHM_DIR)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        assert holder.wait(timeout=60) == 0
        for name in created:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(os.path.join(SHM_DIR, name))
    # The holder exited without unlinking its buffer: now it is stale.
    assert remove_stale_shared(prefix) == [live_locked]


def test_a_name_with_an_impossible_pid_does_not_break_creating_a_buffer() -> None:
    """Anyone may create files in /dev/shm: one named like ours with a pid beyond any
    process must not make every named buffer's creation fail (os.kill overflowed)."""
    prefix = f"kvtiertest{os.getpid()}"
    bogus = f"{prefix}-{'9' * 20}-{'0123456789abcdef'}"
    path = os.path.join(SHM_DIR, bogus)
    with open(path, "wb") as file:
        file.write(b"\0" * 16)
    try:
        with HostBuffer.create(1, 4096, shared_name=make_shared_name(prefix)):
            pass
        assert bogus not in os.listdir(SHM_DIR)  # ours, unlocked, no such process: swept
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@pytest.mark.parametrize("prefix", ["kv-tier", "", "a/b", "x" * 65])
def test_a_prefix_the_sweep_could_not_read_back_is_refused(prefix: str) -> None:
    with pytest.raises(ValueError, match="shared-memory prefix"):
        make_shared_name(prefix)
