"""The root directory, held open: every file under it is opened relative to its descriptor.

Nothing here follows a symbolic link or opens anything but a regular file
with one link: a symlink, FIFO, device or hard link planted as
``slab-000000.bin``, ``index.journal`` or ``header.json`` is refused with
:class:`UnsafeFileError` naming it, so block writes and truncation can never
be redirected to another file. Files are created ``0600``. A root directory
that another user (or group) can write to is refused up front
(:func:`check_root_permissions`): whoever can write there can plant files.

Holding the directory open also means renaming or replacing ``root_dir``
under a running tier does not redirect it, and a deleted directory is
noticed (``st_nlink == 0``, see :meth:`RootDir.deleted`).

All methods block (small syscalls); the tier calls them from worker threads
or, for single cheap syscalls, from its loop.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import stat
from pathlib import Path

from tiering.core.errors import ConfigError

#: Files are created readable and writable by their owner only.
FILE_MODE = 0o600


class UnsafeFileError(ConfigError):
    """A file or the directory under ``root_dir`` could be (or was) used to redirect the tier."""


def check_root_permissions(info: os.stat_result, root: Path) -> None:
    """Raise :class:`UnsafeFileError` if someone other than us (or root) can write ``root``."""
    mode = stat.S_IMODE(info.st_mode)
    me = os.geteuid()
    if info.st_uid not in (me, 0):
        raise UnsafeFileError(
            f"fs tier: root_dir {str(root)!r} belongs to another user (uid {info.st_uid}), "
            "who could plant or replace its files; use a directory you own "
            f"(e.g. `mkdir -m 700 DIR`), or run `chown {me} {root}`"
        )
    if mode & 0o022:
        who = " and ".join(
            name for bit, name in ((0o020, "its group"), (0o002, "other users")) if mode & bit
        )
        raise UnsafeFileError(
            f"fs tier: root_dir {str(root)!r} is writable by {who} (mode {mode:o}), who could "
            f"plant or replace its files; run `chmod go-w {root}` or use a directory of your own"
        )


class RootDir:
    """An open root directory (one descriptor, owned by the tier; closed by :meth:`close`)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path = path
        self.fd = fd

    @classmethod
    def open(cls, path: Path) -> RootDir:
        """Open ``path`` as a directory and check who can write to it. Blocking."""
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except OSError as exc:
            raise ConfigError(
                f"fs tier: root_dir {str(path)!r} cannot be opened: {exc.strerror or exc}"
            ) from None
        try:
            check_root_permissions(os.fstat(fd), path)
        except BaseException:
            os.close(fd)
            raise
        return cls(path, fd)

    def describe(self, name: str) -> str:
        return str(self.path / name)

    def open_file(self, name: str, flags: int, *, create: bool = False) -> int:
        """Open regular file ``name`` (``O_NOFOLLOW``; created ``0600`` when ``create``).

        Raises :class:`UnsafeFileError` for a symlink, a non-regular file or a
        file with other hard links; FileNotFoundError when absent and not
        ``create``; other OSErrors as they come.
        """
        base = flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK  # a FIFO must not block us
        if create:
            base |= os.O_CREAT
        try:
            fd = os.open(name, base, FILE_MODE, dir_fd=self.fd)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise UnsafeFileError(
                    f"fs tier: {self.describe(name)!r} is a symbolic link; refusing to follow it "
                    "(remove it: the tier creates its own files)"
                ) from None
            raise
        try:
            self._check_plain(fd, name)
            # O_NONBLOCK was only for the open: io_uring would fail reads with EAGAIN.
            fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_plain(self, fd: int, name: str) -> None:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFileError(
                f"fs tier: {self.describe(name)!r} is not a regular file; refusing to use it "
                "(remove it: the tier creates its own files)"
            )
        if info.st_nlink > 1:
            raise UnsafeFileError(
                f"fs tier: {self.describe(name)!r} has {info.st_nlink} hard links, so writing it "
                "would change another file; refusing to use it (remove it)"
            )

    def read_small(self, name: str, limit: int) -> bytes | None:
        """The bytes of file ``name`` (None if absent); raises ValueError past ``limit`` bytes."""
        try:
            fd = self.open_file(name, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size > limit:
                raise ValueError(f"{self.describe(name)!r} is {size} bytes, more than {limit}")
            chunks = []
            while chunk := os.read(fd, max(size, 65536)):
                chunks.append(chunk)
            return b"".join(chunks)
        finally:
            os.close(fd)

    def replace_atomically(
        self, name: str, payload: bytes, *, full_sync: bool = False, keep_open: bool = False
    ) -> int | None:
        """Replace ``name`` with ``payload``: temp file, fdatasync, rename, fsync the directory.

        With ``keep_open``, returns a descriptor of the new file (write-only), so
        no one can remove or swap it between the rename and an open.
        """
        tmp = f".{name}.tmp"
        self.unlink(tmp)  # whatever is there (even a planted symlink) is not ours to open
        fd = self.open_file(tmp, os.O_WRONLY | os.O_EXCL, create=True)
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
            if full_sync:
                os.fsync(fd)
            else:
                os.fdatasync(fd)
            os.replace(tmp, name, src_dir_fd=self.fd, dst_dir_fd=self.fd)
            self.fsync()
        except BaseException:
            self.unlink(tmp)  # a partial temp file would only hold space (a full disk)
            os.close(fd)
            raise
        if keep_open:
            return fd
        os.close(fd)
        return None

    def exists(self, name: str) -> bool:
        """Whether ``name`` exists (a symlink counts; it is never followed)."""
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def unlink(self, name: str) -> None:
        """Remove ``name`` if present (a symlink itself, never its target)."""
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def fsync(self) -> None:
        os.fsync(self.fd)

    def deleted(self) -> bool:
        """Whether the directory itself was removed (it cannot hold new files then)."""
        return os.fstat(self.fd).st_nlink == 0

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


def is_deleted(fd: int) -> bool:
    """Whether the file open as ``fd`` has been unlinked (its data dies with the last close)."""
    return os.fstat(fd).st_nlink == 0
