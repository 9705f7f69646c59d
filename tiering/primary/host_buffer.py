"""The primary tier's host buffer: one page-aligned region of ``num_blocks x block_bytes``.

The region is either an anonymous mapping (private to this process: a fork
does not inherit it) or a named POSIX shared-memory object under
``/dev/shm``, which a GPU worker process attaches to by name to copy blocks
into and out of the same bytes. Both ask for huge pages; where the kernel's
settings refuse them the creation logs why, once per process (see
:mod:`tiering.primary.mappings`). Either way the mapping starts on a page boundary, so with
``block_bytes`` a multiple of 4096 every row is aligned for ``O_DIRECT``.

Views (``view``, ``row``, ``as_numpy``, ``as_torch``) never copy. They stay
valid until :meth:`HostBuffer.close`; the memory itself is unmapped when the
last view still held elsewhere is released.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import re
import secrets
import stat
from types import TracebackType
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt

from tiering.core.errors import ConfigError
from tiering.primary.mappings import (
    HUGE_PAGE_BYTES,
    advise_huge_pages,
    huge_pages_refused,
    private_anonymous,
)

if TYPE_CHECKING:
    import torch

#: Alignment that O_DIRECT needs on these filesystems (logical block and page size).
DIRECT_IO_ALIGNMENT = 4096

SHM_DIR = "/dev/shm"
logger = logging.getLogger("tiering.primary.host_buffer")
_SHM_NAME = re.compile(r"[A-Za-z0-9_.-]{1,200}")


#: Names :func:`make_shared_name` gives: prefix, creator's pid, random hex.
_MADE_NAME = re.compile(r"(?P<prefix>[A-Za-z0-9_.]+)-(?P<pid>[0-9]+)-[0-9a-f]{16}")
_PREFIX = re.compile(r"[A-Za-z0-9_.]{1,64}")


def make_shared_name(prefix: str = "kvtier") -> str:
    """A fresh, unguessable name for a shared buffer: ``<prefix>-<pid>-<random hex>``.

    ``prefix`` is letters, digits, ``_`` and ``.`` (a ``-`` would hide the pid from
    :func:`remove_stale_shared`, and the buffers of dead owners would stay for good).
    """
    if not isinstance(prefix, str) or not _PREFIX.fullmatch(prefix):
        raise ValueError(
            f"a shared-memory prefix is 1-64 letters, digits, '_' or '.', got {prefix!r}"
        )
    return f"{prefix}-{os.getpid()}-{secrets.token_hex(8)}"


def remove_stale_shared(prefix: str = "kvtier", shm_dir: str = SHM_DIR) -> list[str]:
    """Remove the shared buffers ``<prefix>-<pid>-<hex>`` whose creator is gone; their names.

    A process killed, or crashed, cannot unlink its buffer, and a crash-restart
    loop would fill ``/dev/shm`` until start-up fails. The creator keeps an
    ``flock`` on its buffer for as long as the buffer lives; the kernel drops it
    when the process ends, however it ends. A buffer is removed only when its
    creator's pid no longer runs *and* nobody holds that lock: a buffer of a
    live process is never touched (its pid might also have been reused, which
    only ever leaves a stale buffer for a later sweep). Only this user's
    regular files are considered. Processes still attached keep their mapping.
    """
    removed: list[str] = []
    try:
        entries = list(os.scandir(shm_dir))
    except OSError:
        return removed
    for entry in entries:
        match = _MADE_NAME.fullmatch(entry.name)
        if match is None or match["prefix"] != prefix:
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            continue  # before the pid: anyone may create a file of any name in /dev/shm
        pid = int(match["pid"])
        if pid == os.getpid() or pid_running(pid):
            continue
        if _locked(entry.path):
            continue
        with contextlib.suppress(FileNotFoundError):
            os.unlink(entry.path)
            removed.append(entry.name)
            logger.info(
                "removed shared memory %s (%d bytes), left behind by process %d (no longer "
                "running)",
                entry.path,
                info.st_size,
                pid,
            )
    return removed


def pid_running(pid: int) -> bool:
    """Whether a process with this pid exists (another user's counts)."""
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):  # none, or no pid at all
        return False
    except PermissionError:
        return True  # alive, another user's
    return True


def _locked(path: str) -> bool:
    """Whether a process holds the owner lock of ``path`` (unreadable counts as held)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the lock taken just now
    return False


def validate_geometry(num_blocks: int, block_bytes: int, require_alignment: bool) -> None:
    """Raise :class:`~tiering.core.errors.ConfigError` unless the buffer geometry is usable."""
    for label, value in (("num_blocks", num_blocks), ("block_bytes", block_bytes)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(f"{label} must be an int, got {value!r}")
    if num_blocks < 1:
        raise ConfigError(f"num_blocks must be >= 1, got {num_blocks}")
    if block_bytes < 1:
        raise ConfigError(f"block_bytes must be positive, got {block_bytes}")
    if require_alignment and block_bytes % DIRECT_IO_ALIGNMENT:
        raise ConfigError(
            f"block_bytes must be a positive multiple of {DIRECT_IO_ALIGNMENT} for O_DIRECT "
            f"alignment, got {block_bytes} (pass require_alignment=False to allow it)"
        )


def _validate_name(name: str) -> str:
    if not isinstance(name, str) or not _SHM_NAME.fullmatch(name) or name in (".", ".."):
        raise ConfigError(
            f"shared memory name must be 1-200 characters of [A-Za-z0-9_.-], got {name!r}"
        )
    return name


class BlockGeometry:
    """``num_blocks`` rows of ``block_bytes`` bytes: the shape the host buffer and the primary
    tier share (one home for their geometry properties). Subclasses set the two attributes."""

    _num_blocks: int
    _block_bytes: int

    @property
    def num_blocks(self) -> int:
        return self._num_blocks

    @property
    def block_bytes(self) -> int:
        return self._block_bytes


class HostBuffer(BlockGeometry):
    """``num_blocks`` rows of ``block_bytes`` bytes in one page-aligned mapping.

    Build one with :meth:`create` (anonymous or named shared memory) or
    :meth:`attach` (an existing named buffer, e.g. in a worker process). The
    creator of a named buffer owns the name: :meth:`unlink` (or leaving the
    ``with`` block) removes it; attached handles only :meth:`close`.
    """

    def __init__(
        self,
        mapping: mmap.mmap,
        num_blocks: int,
        block_bytes: int,
        *,
        name: str | None,
        owner: bool,
    ) -> None:
        """Wrap an existing mapping; prefer :meth:`create` and :meth:`attach`."""
        if len(mapping) != num_blocks * block_bytes:
            raise ValueError(
                f"mapping has {len(mapping)} bytes, expected {num_blocks} x {block_bytes}"
            )
        self._mmap: mmap.mmap | None = mapping
        self._num_blocks = num_blocks
        self._block_bytes = block_bytes
        self._name = name
        self._owner = owner
        self._lock_fd = -1  # a named buffer's creator: the descriptor holding its owner lock
        self._flat: memoryview | None = memoryview(mapping)
        self._view: memoryview | None = self._flat.cast("B", (num_blocks, block_bytes))

    # -- construction -------------------------------------------------------------------

    @classmethod
    def create(
        cls,
        num_blocks: int,
        block_bytes: int,
        *,
        shared_name: str | None = None,
        require_alignment: bool = True,
    ) -> HostBuffer:
        """Map a new zero-filled buffer.

        With ``shared_name`` the buffer is the POSIX shared-memory object
        ``/dev/shm/<shared_name>`` (which must not exist yet), fully reserved
        up front so running out of shared memory fails here, not later with a
        SIGBUS on first touch. Without it the mapping is private anonymous memory
        (huge pages where the kernel allows; a fork does not inherit it).
        ``require_alignment`` (the default) demands ``block_bytes`` be a
        multiple of 4096 so every row is usable with ``O_DIRECT``.

        Raises :class:`~tiering.core.errors.ConfigError` (a ``ValueError``) for bad
        geometry or name, ``FileExistsError`` if the name is taken and
        ``OSError`` if the memory cannot be reserved.
        """
        validate_geometry(num_blocks, block_bytes, require_alignment)
        size = num_blocks * block_bytes
        if shared_name is None:
            mapping = private_anonymous(size)
            _log_small_pages(shared=False, size=size)
            return cls(mapping, num_blocks, block_bytes, name=None, owner=True)
        path = os.path.join(SHM_DIR, _validate_name(shared_name))
        made = _MADE_NAME.fullmatch(shared_name)
        if made is not None:
            remove_stale_shared(made["prefix"])
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        except FileExistsError:
            raise FileExistsError(
                f"shared memory {shared_name!r} already exists ({path}); "
                "attach to it or pick another name"
            ) from None
        try:
            # The owner lock, held while this process lives: remove_stale_shared's proof.
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                raise OSError(
                    exc.errno,
                    f"cannot reserve {size} bytes of shared memory for {shared_name!r}: "
                    f"{exc.strerror}",
                ) from exc
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            raise
        advise_huge_pages(mapping)
        _log_small_pages(shared=True, size=size)
        buffer = cls(mapping, num_blocks, block_bytes, name=shared_name, owner=True)
        buffer._lock_fd = fd  # kept open: it holds the owner lock
        return buffer

    @classmethod
    def attach(cls, name: str, num_blocks: int, block_bytes: int) -> HostBuffer:
        """Map the existing shared buffer ``name`` (created by another process).

        The object's size must be exactly ``num_blocks * block_bytes``: a
        mismatch means the two sides disagree on the layout and raises
        :class:`~tiering.core.errors.ConfigError`. ``FileNotFoundError`` if absent.
        """
        validate_geometry(num_blocks, block_bytes, require_alignment=False)
        path = os.path.join(SHM_DIR, _validate_name(name))
        try:
            fd = os.open(path, os.O_RDWR)
        except FileNotFoundError:
            raise FileNotFoundError(f"no shared memory named {name!r} ({path})") from None
        try:
            size = os.fstat(fd).st_size
            expected = num_blocks * block_bytes
            if size != expected:
                raise ConfigError(
                    f"shared memory {name!r} has {size} bytes, expected "
                    f"{num_blocks} blocks x {block_bytes} bytes = {expected}"
                )
            mapping = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        advise_huge_pages(mapping)
        return cls(mapping, num_blocks, block_bytes, name=name, owner=False)

    # -- geometry and views -------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        return self._num_blocks * self._block_bytes

    @property
    def name(self) -> str | None:
        """The shared-memory name, or None for an anonymous buffer."""
        return self._name

    @property
    def is_owner(self) -> bool:
        """Whether this handle created the buffer (and so unlinks a shared name)."""
        return self._owner

    @property
    def closed(self) -> bool:
        return self._view is None

    @property
    def view(self) -> memoryview:
        """The whole buffer: format ``'B'``, shape ``(num_blocks, block_bytes)``."""
        if self._view is None:
            raise ValueError(f"{self!r} is closed")
        return self._view

    def row(self, block_id: int) -> memoryview:
        """Block ``block_id`` as a 1-D writable memoryview of ``block_bytes`` bytes.

        Raises ``IndexError`` outside ``[0, num_blocks)``.
        """
        flat = self._flat
        if flat is None:
            raise ValueError(f"{self!r} is closed")
        if not 0 <= block_id < self._num_blocks:
            raise IndexError(f"block id {block_id} outside [0, {self._num_blocks})")
        start = block_id * self._block_bytes
        return flat[start : start + self._block_bytes]

    def as_numpy(self) -> npt.NDArray[np.uint8]:
        """A zero-copy ``uint8`` array of shape ``(num_blocks, block_bytes)``."""
        return np.frombuffer(self._mapping(), dtype=np.uint8).reshape(
            self._num_blocks, self._block_bytes
        )

    def as_torch(self) -> torch.Tensor:
        """A zero-copy ``torch.uint8`` tensor of shape ``(num_blocks, block_bytes)``.

        Imports torch on first use only (``import tiering`` never does).
        """
        import torch

        flat = torch.frombuffer(self._mapping(), dtype=torch.uint8)
        return flat.view(self._num_blocks, self._block_bytes)

    def _mapping(self) -> mmap.mmap:
        if self._mmap is None:
            raise ValueError(f"{self!r} is closed")
        return self._mmap

    def address(self) -> int:
        """The mapping's start address (page-aligned), for alignment checks and pinning."""
        array: Any = self.as_numpy()
        return int(array.ctypes.data)

    # -- lifetime -------------------------------------------------------------------------

    def close(self) -> None:
        """Drop this handle's views and unmap the buffer. Idempotent.

        Views handed out earlier (rows, arrays, tensors) keep the memory
        mapped until they are released; this handle can no longer be used.
        A shared name stays until :meth:`unlink`.
        """
        view, flat, mapping = self._view, self._flat, self._mmap
        self._view = self._flat = self._mmap = None
        # A BufferError below means a caller still holds something exported from
        # that object; the memory is then unmapped when the last holder lets go.
        for own_view in (view, flat):
            if own_view is not None:
                with contextlib.suppress(BufferError):
                    own_view.release()
        if mapping is not None:
            with contextlib.suppress(BufferError):
                mapping.close()
        self._release_lock()

    def unlink(self) -> None:
        """Remove the shared-memory name (the creator's job). Idempotent; no-op when anonymous.

        Processes that already attached keep their mapping.
        """
        if self._name is None:
            return
        with contextlib.suppress(FileNotFoundError):
            os.unlink(os.path.join(SHM_DIR, self._name))
        self._release_lock()

    def _release_lock(self) -> None:
        fd, self._lock_fd = self._lock_fd, -1
        if fd >= 0:
            os.close(fd)

    def __enter__(self) -> HostBuffer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.close()
        if self._owner:
            self.unlink()

    def __repr__(self) -> str:
        kind = f"shared {self._name!r}" if self._name else "anonymous"
        state = ", closed" if self.closed else ""
        return f"HostBuffer({kind}, {self._num_blocks} x {self._block_bytes} bytes{state})"


_small_pages_logged: set[bool] = set()


def _log_small_pages(shared: bool, size: int) -> None:
    """Say once per process and kind why host buffers get no huge pages (an operator can fix it)."""
    if shared in _small_pages_logged or size < HUGE_PAGE_BYTES:
        return
    reason = huge_pages_refused(shared)
    if reason is not None:
        _small_pages_logged.add(shared)
        kind = "shared" if shared else "anonymous"
        logger.info("%s host buffers are in 4 KiB pages: %s", kind, reason)
