"""The replay's temporary directory: made only when a tier needs one, removed at the end,
and removed by a later run when the process that made it died without cleaning up.

A run stopped by SIGKILL (or a crash, or a power cut) cannot remove its directory,
and a filesystem tier's slabs make it large. Each directory is named
``tiering-replay-<pid>-<random>`` and records its owner's pid and start time
(``owner``); a run removes the directories whose owner is no longer running, or
whose pid now belongs to another process (pids are reused).
"""

from __future__ import annotations

import logging
import os
import shutil
import stat
import tempfile
from pathlib import Path
from types import TracebackType

logger = logging.getLogger(__name__)

PREFIX = "tiering-replay-"
OWNER_FILE = "owner"


def process_start_time(pid: int) -> str | None:
    """The start time of process ``pid`` (clock ticks since boot), or None if it is not running.

    With the pid it names one process for good: a reused pid has another start time.
    Where ``/proc`` does not exist, a running pid answers ``""`` (alive, start unknown).
    """
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as stat_file:
            fields = stat_file.read().rpartition(")")[2].split()
        return fields[19]  # field 22 of stat(5): starttime; fields after "comm" start at 3
    except FileNotFoundError:
        return None
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:
        return ""  # alive, another user's
    return ""


def _owner_alive(directory: Path, pid: int) -> bool:
    started = process_start_time(pid)
    if started is None:
        return False
    try:
        recorded = (directory / OWNER_FILE).read_text(encoding="ascii").split()
    except (OSError, UnicodeDecodeError):
        # Not written yet (its owner is creating it) or unreadable: the pid is alive, keep it.
        return True
    if not recorded or recorded[0] != str(pid):
        return True  # not a record of ours: leave it alone
    if len(recorded) < 2 or not started:
        return True  # alive, and no start time to tell a reused pid by
    return recorded[1] == started


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

    @property
    def created(self) -> bool:
        return self._path is not None

    @property
    def path(self) -> Path:
        if self._path is None:
            pid = os.getpid()
            path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{pid}-", dir=self._parent))
            self._path = path
            (path / OWNER_FILE).write_text(f"{pid} {process_start_time(pid) or ''}\n")
        return self._path

    def cleanup(self) -> None:
        path, self._path = self._path, None
        if path is not None:
            shutil.rmtree(path, ignore_errors=True)

    def __enter__(self) -> ReplayTempDir:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.cleanup()
