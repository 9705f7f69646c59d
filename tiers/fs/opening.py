"""Opening a root directory: lock it, check its header, replay the journal, open the slabs.

Blocking code, run in a worker thread by :meth:`FileSystemTier.open`. Its
result, :class:`Prepared`, hands every descriptor it opened to the tier (or
closes them all if opening fails or is cancelled). A header that does not
describe this layout, or is missing or damaged in front of existing files,
resets the cache under ``on_layout_mismatch="reset"`` and raises ConfigError
under ``"error"``; a planted link or odd file raises UnsafeFileError.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import fcntl
import logging
import os
from dataclasses import dataclass, replace

from tiering.core.errors import ConfigError
from tiers.fs.config import FsTierConfig
from tiers.fs.errors import RootInUseError
from tiers.fs.files import RootDir, UnsafeFileError
from tiers.fs.journal import compaction_limit
from tiers.fs.journal_file import (
    open_for_append,
    recover,
    write_snapshot,
    write_snapshot_for_append,
)
from tiers.fs.layout import (
    HEADER_NAME,
    JOURNAL_NAME,
    LOCK_NAME,
    Geometry,
    Header,
    parse_slab_name,
    read_header,
    write_header,
)
from tiers.fs.records import HEADER_BYTES, EntryValue, ReplayResult
from tiers.fs.slabs import SlabFiles

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class Prepared:
    """What opening the root directory produced (in a worker thread)."""

    root: RootDir
    lock_fd: int
    header: Header
    geometry: Geometry
    slabs: SlabFiles
    entries: dict[bytes, EntryValue]
    journal_fd: int
    journal_size: int
    dropped: int
    notes: list[str]
    #: Records were lost to damage (not just a torn tail), so a recovered entry may be
    #: stale (its DEL, and the record of its slot's reuse, were lost): read them all once.
    verify_recovered: bool = False
    #: The roots the header named before this open (``root_set`` of the header found;
    #: the root alone for a tier of one root), when they differ from this tier's.
    previous_root_set: tuple[str, ...] | None = None

    def close(self) -> None:
        self.slabs.close()
        for fd in (self.journal_fd, self.lock_fd):
            with contextlib.suppress(OSError):
                os.close(fd)
        self.root.close()


def prepare_root(
    cfg: FsTierConfig,
    geometry: Geometry,
    fingerprint: str,
    root_set: tuple[str, ...] = (),
    *,
    forget_blocks: bool = False,
    must_exist: bool = False,
) -> Prepared:
    """Open ``cfg.root_dir`` for a tier whose roots are ``root_set`` (empty: this one alone).

    A header naming another set of roots is rewritten to name this one (its
    blocks stay). ``forget_blocks`` opens the root empty: a root coming back
    into service after its blocks were reported removed. ``must_exist``
    refuses (ConfigError) a root without a cache of this layout instead of
    creating one: a bare directory may be the mount point of a missing drive.
    """
    root = RootDir.open(cfg.root_dir)
    notes: list[str] = []
    lock_fd = -1
    slabs: SlabFiles | None = None
    try:
        if must_exist:  # before the lock file is created: a bare directory stays bare
            _check_cache_is_there(root, geometry, fingerprint)
        lock_fd = _lock_root(root)
        header = _checked_header(cfg, root, geometry, fingerprint, notes, root_set)
        previous = _record_root_set(root, header, root_set)
        header = replace(header, root_set=root_set)
        geometry = replace(geometry, slots_per_slab=header.slots_per_slab)
        result, problems, appendable = recover(root, header)
        if forget_blocks:
            result.entries.clear()
        for problem in problems:
            notes.append(f"journal: {problem}")
            logger.warning("fs tier: %s: journal: %s", cfg.root_dir, problem)
        slabs = SlabFiles(root, geometry, cfg.direct_io, cfg.preallocate)
        slabs.open_existing()
        backed, per_slab, lost = slabs.backed_slots, geometry.slots_per_slab, slabs.recreated
        entries = {
            k: v
            for k, v in result.entries.items()
            if v[0] < backed and v[0] // per_slab not in lost
        }
        dropped = len(result.entries) - len(entries)
        if dropped:
            notes.append(
                f"{dropped} blocks beyond the capacity or in missing slab files were dropped"
            )
        # A root that forgets its blocks must not keep a journal that names them.
        appendable = appendable and not forget_blocks
        if appendable and not problems and not dropped and _compact(result, len(entries)):
            # Intact to its end and no larger than the running tier lets a journal grow:
            # appended to as it is (rewriting it costs 0.7 s per million blocks at start).
            journal_fd = open_for_append(root)
            size = os.fstat(journal_fd).st_size
        else:
            journal_fd, size = _rewrite_journal(root, header, entries, appendable, notes)
    except BaseException:
        if slabs is not None:
            slabs.close()
        if lock_fd >= 0:
            os.close(lock_fd)
        root.close()
        raise
    return Prepared(
        root,
        lock_fd,
        header,
        geometry,
        slabs,
        entries,
        journal_fd,
        size,
        dropped,
        notes,
        verify_recovered=bool(entries) and (result.damaged_bytes > 0 or not result.tail_torn),
        previous_root_set=previous,
    )


def _check_cache_is_there(root: RootDir, geometry: Geometry, fingerprint: str) -> None:
    header = read_header(root)
    reason = "no header" if header is None else header.mismatch(geometry.block_bytes, fingerprint)
    if reason is not None:
        raise ConfigError(f"fs tier: root_dir {str(root.path)!r} holds no cache of ours: {reason}")


def _record_root_set(
    root: RootDir, header: Header, root_set: tuple[str, ...]
) -> tuple[str, ...] | None:
    """Write ``root_set`` into the header if it names another set; the set it named, or None."""
    if header.root_set == root_set:
        return None
    write_header(root, replace(header, root_set=root_set))
    return header.root_set or (str(root.path),)


def _compact(result: ReplayResult, live: int) -> bool:
    """Whether a replayed journal is within the size at which the running tier compacts it."""
    return HEADER_BYTES + result.valid_bytes <= compaction_limit(live)


def _rewrite_journal(
    root: RootDir,
    header: Header,
    entries: dict[bytes, EntryValue],
    appendable: bool,
    notes: list[str],
) -> tuple[int, int]:
    """Compact the journal to ``entries``; returns its descriptor (for appending) and size.

    On a full disk an intact journal is kept as it is and appended to (replay
    skips a torn tail or damage before new records, and drops entries beyond
    the slab files again at each open); otherwise a clear OSError.
    """
    try:
        return write_snapshot_for_append(root, header, (list(entries), list(entries.values())))
    except OSError as exc:
        if exc.errno not in (errno.ENOSPC, errno.EDQUOT) or not appendable:
            raise OSError(
                exc.errno,
                f"fs tier: cannot write the journal {root.describe(JOURNAL_NAME)!r}: "
                f"{exc.strerror or exc}; free space on its filesystem and restart",
            ) from None
        fd = open_for_append(root)
        note = "journal: not compacted at open (no space left); appending to it as it is"
        notes.append(note)
        logger.warning("fs tier: %s: %s", root.path, note)
        return fd, os.fstat(fd).st_size


def close_prepared_when_done(job: asyncio.Future[Prepared]) -> None:
    if not job.cancelled() and job.exception() is None:
        job.result().close()


def _lock_root(root: RootDir) -> int:
    fd = root.open_file(LOCK_NAME, os.O_RDWR, create=True)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
        os.close(fd)
        raise RootInUseError(
            f"fs tier: root_dir {str(root.path)!r} is in use by another fs tier (pid {holder}); "
            "give each engine its own root_dir"
        ) from None
    with contextlib.suppress(OSError):  # who holds it is only informative (and a full disk)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _checked_header(
    cfg: FsTierConfig,
    root: RootDir,
    geometry: Geometry,
    fingerprint: str,
    notes: list[str],
    root_set: tuple[str, ...],
) -> Header:
    """The root's header if it describes this layout; otherwise reset (or refuse).

    With ``on_layout_mismatch="error"`` a missing or damaged header in front
    of existing slab or journal files raises ConfigError naming the file:
    "error" never discards a cache.
    """
    header_path = root.describe(HEADER_NAME)
    what = "a cache for another layout"
    try:
        header = read_header(root)
        reason = None if header is None else header.mismatch(geometry.block_bytes, fingerprint)
    except UnsafeFileError:
        raise  # a planted link or odd file is refused, not reset away (ConfigError is a ValueError)
    except ValueError as exc:
        header, reason = None, f"{header_path!r} is damaged ({exc})"
        what = "a cache without a readable header"
    if header is not None and reason is None:
        return header
    leftovers = _owned_files(root)
    if reason is None and leftovers:
        reason = f"{header_path!r} is missing but slab or journal files are there"
        what = "a cache without a readable header"
    if reason is not None:
        if cfg.on_layout_mismatch == "error":
            raise ConfigError(
                f"fs tier: root_dir {str(root.path)!r} holds {what}: {reason}. "
                "Use another root_dir, or on_layout_mismatch='reset' to discard it"
            )
        notes.append(f"reset: {reason}")
        logger.warning("fs tier: %s: %s; resetting the cache", root.path, reason)
    for name in leftovers:  # the header goes first, so an interrupted reset resets again
        root.unlink(name)
    header = Header.new(geometry, fingerprint, root_set)
    try:
        write_header(root, header)
        write_snapshot(root, header, [])
    except OSError as exc:
        raise OSError(
            exc.errno,
            f"fs tier: cannot create a cache under root_dir {str(root.path)!r}: "
            f"{exc.strerror or exc}; free space on its filesystem and restart",
        ) from None
    return header


def _owned_files(root: RootDir) -> list[str]:
    """Names of this tier's files under ``root``, header first (never anything else)."""
    names = [HEADER_NAME, JOURNAL_NAME, f".{JOURNAL_NAME}.tmp", f".{HEADER_NAME}.tmp"]
    present = set(root.names())
    out = [n for n in names if n in present]
    out += sorted(n for n in present if parse_slab_name(n) is not None)
    return out
