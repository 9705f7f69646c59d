"""Noticing the tier's files deleted under it, and repairing what can be repaired.

A slab or journal file unlinked while the tier runs stays usable through its
open descriptor, so writes keep succeeding - into an inode that disappears at
the next restart. :class:`DeletionWatch` looks for that (``st_nlink == 0`` on
the open descriptors, ``header.json`` gone, the directory itself removed) on a
timer on the tier's loop, and the tier asks :meth:`DeletionWatch.unsafe_fds`
before acknowledging each store, so no store into a deleted file is ever
acknowledged.

What it does about it, once per event (one ERROR log line):

* a deleted **slab**: its blocks are reported removed (and dropped from the
  index with DEL records) and an empty slab file is created in its place;
* a deleted **journal**: a fresh one is written from the in-memory index (no
  block is lost);
* a deleted **header**: it is written again;
* a deleted **root directory** (or a repair that fails): every block is
  reported removed and the tier refuses stores from then on (restart it to
  create the directory again).

Everything runs on the tier's loop thread; file creation goes to a worker
thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
from collections.abc import Callable, Sequence

from tiering.core.keys import OffloadKey
from tiers.fs.files import RootDir, is_deleted
from tiers.fs.index import SLOT, SlotIndex
from tiers.fs.journal import JournalWriter
from tiers.fs.layout import HEADER_NAME, JOURNAL_NAME, Header, slab_name, write_header
from tiers.fs.records import encode_del
from tiers.fs.slabs import SlabFiles

logger = logging.getLogger(__name__)

#: How often the files are checked (a few fstat calls each time).
CHECK_INTERVAL_S = 1.0


class FilesDeletedError(OSError):
    """A store was refused because the tier's files were deleted under it."""

    def __init__(self, what: str) -> None:
        super().__init__(errno.ENOENT, what)


class DeletionWatch:
    """Checks and repairs one open tier's files (owned by the tier, on its loop thread)."""

    def __init__(
        self,
        name: str,
        root: RootDir,
        header: Header,
        slabs: SlabFiles,
        journal: JournalWriter,
        index: SlotIndex,
        report_removed: Callable[[Sequence[OffloadKey]], None],
        on_noticed: Callable[[], None] = lambda: None,
    ) -> None:
        self._name = name
        self._root = root
        self._header = header
        self._slabs = slabs
        self._journal = journal
        self._index = index
        self._report_removed = report_removed
        self._on_noticed = on_noticed
        self._lock = asyncio.Lock()
        #: Why stores are refused (None while the files are fine).
        self.refusing: str | None = None
        self._root_deleted = False
        self.events = 0

    async def run(self) -> None:
        """Check every :data:`CHECK_INTERVAL_S` until cancelled (cancellation: stops at once)."""
        while True:
            await asyncio.sleep(CHECK_INTERVAL_S)
            await self.check()

    def unsafe_fds(self, fds: Sequence[int]) -> str | None:
        """Why a store that wrote through ``fds`` must not be acknowledged (None: it may)."""
        if self.refusing is not None:
            return self.refusing
        for fd in fds:
            if is_deleted(fd):
                return "its slab file was deleted while it was written"
        return None

    async def check(self) -> None:
        """Look for deleted files and repair them (see the module docstring).

        While stores are refused because a repair failed (e.g. a full disk), each
        check tries the repair again and accepts stores once it works. Cancellation:
        a file being created finishes in its thread; the next check goes on.
        """
        if self._root_deleted:
            return
        async with self._lock:
            try:
                gone = self._deleted()
            except OSError as exc:  # fstat of an open descriptor failing: nothing sane left
                gone = [f"the files ({exc})"]
            if not gone:
                return
            retrying = self.refusing is not None
            if not retrying:
                self.events += 1
                self._on_noticed()
            if self._root_gone():
                self._root_deleted = True
                self._refuse(f"root_dir {str(self._root.path)!r} was deleted")
                return
            if not retrying:
                logger.error(
                    "fs tier %s: %s deleted under the running tier; its blocks are reported "
                    "removed and the files are created again",
                    self._name,
                    ", ".join(gone),
                )
            try:
                await self._repair()
            except OSError as exc:
                if not retrying:
                    self._refuse(f"the deleted files cannot be created again ({exc})")
                return
            if retrying:
                self.refusing = None
                logger.warning("fs tier %s: files created again; stores accepted", self._name)

    def _deleted(self) -> list[str]:
        root = self._root
        gone = [root.describe(slab_name(i)) for i in self._slabs.deleted_slabs()]
        if self._journal.file_deleted():
            gone.append(root.describe(JOURNAL_NAME))
        if not root.exists(HEADER_NAME):
            gone.append(root.describe(HEADER_NAME))
        if root.deleted():
            gone.append(str(root.path))
        return gone

    def _root_gone(self) -> bool:
        try:
            return self._root.deleted()
        except OSError:
            return True

    async def _repair(self) -> None:
        slabs = self._slabs.deleted_slabs()
        if slabs:
            self._forget_slabs(set(slabs))
            await self._slabs.recreate(slabs)
        if not self._root.exists(HEADER_NAME):
            await asyncio.to_thread(write_header, self._root, self._header)
        # Always rewrite the journal: it then describes exactly the blocks that are left.
        if not await self._journal.rotate():
            raise OSError(errno.EIO, "the journal could not be written again")

    def _forget_slabs(self, slabs: set[int]) -> None:
        per_slab = self._slabs.geometry.slots_per_slab
        keys = [key for key, entry in self._index.items() if entry[SLOT] // per_slab in slabs]
        self._forget(keys)

    def _forget(self, keys: list[OffloadKey]) -> None:
        if not keys:
            return
        index, journal = self._index, self._journal
        seq = journal.next_seq
        for key in keys:
            index.remove(key, seq)
        with contextlib.suppress(RuntimeError):  # the journal is closing
            journal.append(encode_del(keys, journal.seed), retry=True)
        self._report_removed(keys)

    def _refuse(self, why: str) -> None:
        self.refusing = f"fs tier {self._name}: stores refused: {why}"
        until = (
            "until the tier is restarted"
            if self._root_deleted
            else "until the files can be created again (retried every check)"
        )
        logger.error(
            "fs tier %s: %s; every block is reported removed and stores are refused %s",
            self._name,
            why,
            until,
        )
        self._forget(self._index.keys())
