"""The replay's temporary directory: made only when a tier needs one, removed at the end,
and removed by a later run when the process that made it died without cleaning up.

A run stopped by SIGKILL (or a crash, or a power cut) cannot remove its directory,
and a filesystem tier's slabs make it large. Each directory is named
``tiering-replay-<pid>-<random>`` and holds an ``owner`` file that its run keeps
locked (``flock``) for as long as it lives; the kernel drops the lock when the
process ends, however it ends. A run removes the directories whose ``owner``
lock it can take: nobody holds them. A lock proves more than a pid does: pids
are reused, and a process's start time reads differently through an emulator
(``qemu-user`` answers ``/proc/self/stat`` itself), which once made a run delete
the live directory of an emulated one.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from types import TracebackType

from tiering.primary.host_buffer import pid_running

logger = logging.getLogger(__name__)

PREFIX = "tiering-replay-"
OWNER_FILE = "owner"


def _owner_alive(directory: Path, pid: int) -> bool:
    """Whether a live process owns ``directory`` (holds its ``owner`` lock)."""
    try:
        fd = os.open(directory / OWNER_FILE, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        # No record: its owner is creating it (the record appears already locked), or
        # died before it could; only a pid that no longer runs tells the latter.
        return pid_running(pid)
    except OSError:
        return True  # unreadable: leave it alone
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True  # locked: its run is alive
    except OSError:
        return True
    finally:
        os.close(fd)  # also drops the lock taken just now
    return False


def remove_stale(parent: str | Path | None = None) -> list[Path]:
    """Remove the replay temp directories under ``parent`` (the system temp directory)
    whose owning process is gone; returns those removed.

    Only this user's own directories named ``tiering-replay-<pid>-...`` are
    considered; symlinks and anything else are left alone.
    """
    parent = Path(parent if parent is not None else tempfile.gettempdir())
    removed: list[Path] = []
    try:
        entries = list(os.scandir(parent))
    except OSError:
        return removed
    uid = os.getuid()
    for entry in entries:
        if not entry.name.startswith(PREFIX):
            continue
        pid_text, dash, _ = entry.name[len(PREFIX) :].partition("-")
        if not dash or not pid_text.isdigit():
            # An older version's directory ("tiering-replay-<random>", no pid): cannot tell
            # whether its run is alive, so it is left alone.
            continue
        try:
            info = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
            continue
        path = Path(entry.path)
        pid = int(pid_text)
        if pid == os.getpid() or _owner_alive(path, pid):
            continue
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            logger.info("removed %s, left behind by process %d (no longer running)", path, pid)
            removed.append(path)
    return removed


class ReplayTempDir:
    """A temporary directory made on first use (``path``) and removed on exit."""

    def __init__(self, parent: str | Path | None = None) -> None:
        self._parent = parent
        self._path: Path | None = None
        self._owner_fd = -1  # the locked ``owner`` file, held while the directory lives

    @property
    def created(self) -> bool:
        return self._path is not None

    @property
    def path(self) -> Path:
        if self._path is None:
            pid = os.getpid()
            path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-", dir=self._parent))
            self._path = path
            # Locked before it gets its name, so a sweep never finds it unlocked.
            pending = path / f".{OWNER_FILE}.new"
            fd = os.open(pending, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_EX)
            os.write(fd, f"{pid}\n".encode())
            os.rename(pending, path / OWNER_FILE)
            self._owner_fd = fd
        return self._path

    def cleanup(self) -> None:
        path, self._path = self._path, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)
        if self._owner_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self._owner_fd)
            self._owner_fd = -1

    def __enter__(self) -> ReplayTempDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cleanup()
