"""The directory tier: one checksummed file per block, metadata through aiofiles, data in threads.

The ``DirectoryTier`` of ``docs/writing-a-tier.md`` made complete: a
persistent tier anyone can point at a directory, and the example to copy for
a tier over blocking file I/O. Blocks of one KV layout live in
``<root_dir>/layout-<digest of the fingerprint>/``, one ``<key hex>.blk``
file each, written to a unique temporary name and renamed into place, so a
reader (or a restart) sees the old block or the new one, whole. Each file
starts with a header (magic, format version, the key, the block size, an
xxh3-64 checksum of the data): a truncated, damaged or misplaced file is a
``CorruptBlock`` miss, never a wrong hit, also for blocks found after a
restart. A ``tier.json`` manifest records the layout and block size; opening
a directory written with another block size is refused.

**Which I/O goes where.** Small, rare metadata I/O goes through ``aiofiles``
(``aiofiles.open`` for the manifest, ``aiofiles.os`` for ``makedirs``,
``listdir``, ``remove``, ``replace``): one thread hop per call is nothing next
to what the call does. Block data does not: ``aiofiles`` costs a thread hop
per call (open, write, flush, close: four hops a block; measured at about
0.2 GB/s at 64 KiB blocks, ``docs/machine-ceilings.md``), and a cancelled
``aiofiles`` read leaves its thread filling the buffer after the coroutine
ended, which the tier contract forbids (the buffer is a primary-tier row that
may already hold another block). Each block is therefore read or written in
**one** :meth:`~tiering.tier.AsyncTier.run_in_thread` call (open, I/O,
checksum, rename, close), at most ``max_threads`` at once, and a cancelled
operation returns only once its thread let go of the buffer.

One file per block is a simple format, not a fast one: creating and deleting
files costs 250-700 us of CPU each on the project's machines. For throughput
use the filesystem tier (``tiers/fs``: preallocated slab files, O_DIRECT,
io_uring).

Config (``secondary_tiers`` entry)::

    {"type": "directory", "root_dir": "/var/cache/kv-blocks", "capacity_blocks": 100000}
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from collections import OrderedDict
from collections.abc import Sequence
from contextlib import suppress
from pathlib import Path

import aiofiles
import aiofiles.os
import anyio
import xxhash

from tiering.core.errors import BlockNotFound, ConfigError, CorruptBlock
from tiering.core.keys import OffloadKey
from tiering.tier import AsyncTier, TierContext

_MANIFEST = "tier.json"
_FORMAT = "kv-tiering-directory"
_VERSION = 1
_BLOCK_SUFFIX = ".blk"
_TEMP_SUFFIX = ".tmp"
#: magic, format version, key length, block bytes, xxh3-64 of the block; then the key.
_HEADER = struct.Struct("<4sHHQQ")
_MAGIC = b"KVDT"
_MISSING = "missing"


class DirectoryTier(AsyncTier):
    """Blocks as files under ``root_dir``; persistent, optionally bounded (LRU).

    ``capacity_blocks`` bounds the tier (the least recently used block is
    deleted, and reported removed, to make room; ``None``: unbounded).
    ``fsync`` makes every block and the directory entry durable before the
    write returns (slower; without it a power loss may lose recent blocks,
    never serve damaged ones). The tier assumes it is the only writer of its
    directory (``shared = False``).
    """

    max_concurrency = 8
    verifies_reads = True

    def __init__(
        self,
        root_dir: str | os.PathLike[str],
        *,
        capacity_blocks: int | None = None,
        fsync: bool = False,
    ) -> None:
        if not isinstance(root_dir, str | os.PathLike) or not os.fspath(root_dir):
            raise ConfigError(f"root_dir must be a non-empty path, got {root_dir!r}")
        if capacity_blocks is not None and (
            isinstance(capacity_blocks, bool)
            or not isinstance(capacity_blocks, int)
            or capacity_blocks <= 0
        ):
            raise ConfigError(
                f"capacity_blocks must be a positive integer, got {capacity_blocks!r}"
            )
        if not isinstance(fsync, bool):
            raise ConfigError(f"fsync must be true or false, got {fsync!r}")
        self.root_dir = Path(root_dir)
        #: Most blocks held at once (None: unbounded). Reported in the runtime's stats.
        self.capacity_blocks = capacity_blocks
        self.fsync = fsync
        self._dir: Path | None = None
        # Every block on disk, least recently used first (the values are unused).
        self._index: OrderedDict[OffloadKey, None] = OrderedDict()
        # Keys whose file is being deleted: a write of the key waits, so the deletion
        # can never remove the new file.
        self._deleting: dict[OffloadKey, anyio.Event] = {}
        # Keys with a write in flight: eviction leaves their file to the write (which
        # replaces it) instead of deleting it, maybe just after the new one landed.
        self._writing: set[OffloadKey] = set()

    @property
    def directory(self) -> Path:
        """This layout's directory (after :meth:`open`)."""
        if self._dir is None:
            raise RuntimeError("DirectoryTier has not been opened")
        return self._dir

    async def open(self, context: TierContext) -> None:
        """Create or recover the layout's directory.

        Checks the manifest, deletes temporary files left by a crash, indexes
        the blocks present and trims them to ``capacity_blocks``. Raises
        :class:`~tiering.core.errors.ConfigError` for a directory written with
        another block size or not by this tier. Cancellation: leaves at most a
        manifest being written under a temporary name (deleted at next open).
        """
        await super().open(context)
        digest = hashlib.blake2b(context.layout_fingerprint.encode(), digest_size=8).hexdigest()
        self._dir = self.root_dir / f"layout-{digest}"
        await aiofiles.os.makedirs(self._dir, mode=0o700, exist_ok=True)
        await self._check_or_write_manifest(context)
        names = await aiofiles.os.listdir(self._dir)
        for name in names:
            if name.endswith(_TEMP_SUFFIX):  # a write or manifest cut short by a crash
                with suppress(FileNotFoundError):
                    await aiofiles.os.remove(self._dir / name)
            elif name.endswith(_BLOCK_SUFFIX):
                key = _key_from_name(name)
                if key is not None:
                    self._index[key] = None
        if self.capacity_blocks is not None and len(self._index) > self.capacity_blocks:
            # Nobody was told about these blocks yet (list_keys comes next): just delete.
            excess = len(self._index) - self.capacity_blocks
            await self._delete_files([self._index.popitem(last=False)[0] for _ in range(excess)])

    async def _check_or_write_manifest(self, context: TierContext) -> None:
        path = self.directory / _MANIFEST
        expected = {
            "format": _FORMAT,
            "version": _VERSION,
            "layout_fingerprint": context.layout_fingerprint,
            "block_bytes": context.block_bytes,
        }
        try:
            async with aiofiles.open(path, encoding="utf-8") as f:
                text = await f.read()
        except FileNotFoundError:
            temp = path.with_name(f"{_MANIFEST}.{secrets.token_hex(4)}{_TEMP_SUFFIX}")
            async with aiofiles.open(temp, "w", encoding="utf-8") as f:
                await f.write(json.dumps(expected, indent=2) + "\n")
                if self.fsync:
                    await f.flush()
                    await self.run_in_thread(os.fsync, f.fileno())
            await aiofiles.os.replace(temp, path)
            return
        try:
            found = json.loads(text)
        except ValueError as exc:
            raise ConfigError(f"{path} is not a directory tier manifest: {exc}") from None
        if not isinstance(found, dict) or found.get("format") != _FORMAT:
            raise ConfigError(f"{path} was not written by a directory tier")
        if found.get("version") != _VERSION:
            raise ConfigError(
                f"{path} has format version {found.get('version')!r}; this tier reads {_VERSION}"
            )
        if found.get("block_bytes") != context.block_bytes:
            raise ConfigError(
                f"{self.directory} holds blocks of {found.get('block_bytes')!r} bytes for layout "
                f"{context.layout_fingerprint!r}, not {context.block_bytes}: use another root_dir"
            )

    async def contains(self, key: OffloadKey) -> bool:
        """Whether the block is on disk (the index: no I/O). Cancellation: no effect."""
        return key in self._index

    async def read(self, key: OffloadKey, into: memoryview) -> None:
        """Read and verify the block's file into ``into`` (one thread hop).

        A file that is missing raises ``BlockNotFound``; one that fails
        verification is deleted and raises ``CorruptBlock``. Cancellation:
        returns once the thread stopped writing ``into``.
        """
        if key not in self._index:
            raise BlockNotFound(key)
        problem = await self.run_in_thread(_read_block_file, self._path(key), key, into)
        if problem is None:
            if key in self._index:  # a write of another key may have evicted it meanwhile
                self._index.move_to_end(key)
            return
        self._index.pop(key, None)
        if problem == _MISSING:
            raise BlockNotFound(key)
        await self._delete_files([key])
        raise CorruptBlock(key, problem)

    async def write(self, key: OffloadKey, data: memoryview) -> None:
        """Write the block to a temporary file and rename it into place (one thread hop).

        Deletes the least recently used blocks beyond ``capacity_blocks``.
        Cancellation: returns once the thread let go of ``data``; the block is
        then either the old one, absent, or the new one, whole.
        """
        while (deleting := self._deleting.get(key)) is not None:
            await deleting.wait()
        path = self._path(key)
        temp = path.with_name(f"{path.name}.{secrets.token_hex(4)}{_TEMP_SUFFIX}")
        renamed: list[bool] = []
        self._writing.add(key)
        try:
            await self.run_in_thread(_write_block_file, temp, path, key, data, self.fsync, renamed)
        finally:
            self._writing.discard(key)
            if renamed:  # on disk, even when this write was cancelled after the rename
                self._index[key] = None
                self._index.move_to_end(key)
        if self.capacity_blocks is not None and len(self._index) > self.capacity_blocks:
            excess = len(self._index) - self.capacity_blocks
            victims = [self._index.popitem(last=False)[0] for _ in range(excess)]
            self.report_removed(victims)
            await self._delete_files([k for k in victims if k not in self._writing])

    async def delete(self, key: OffloadKey) -> None:
        """Delete the block's file (no error if absent). Cancellation: gone or intact."""
        self._index.pop(key, None)
        await self._delete_files([key])

    async def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Mark blocks recently used (the eviction order; no I/O)."""
        for key in keys:
            if key in self._index:
                self._index.move_to_end(key)

    async def list_keys(self) -> list[OffloadKey]:
        """The blocks found by :meth:`open` (and written since)."""
        return list(self._index)

    async def _delete_files(self, keys: Sequence[OffloadKey]) -> None:
        """Remove the keys' files (through aiofiles); writes of those keys wait meanwhile."""
        for key in keys:
            done = self._deleting[key] = anyio.Event()
            try:
                with suppress(FileNotFoundError):
                    await aiofiles.os.remove(self._path(key))
            finally:
                del self._deleting[key]
                done.set()

    def _path(self, key: OffloadKey) -> Path:
        return self.directory / f"{key.hex()}{_BLOCK_SUFFIX}"


def _key_from_name(name: str) -> OffloadKey | None:
    try:
        return OffloadKey(bytes.fromhex(name[: -len(_BLOCK_SUFFIX)]))
    except ValueError:
        return None  # not one of ours: left alone


def _write_block_file(
    temp: Path, path: Path, key: bytes, data: memoryview, fsync: bool, renamed: list[bool]
) -> None:
    """Worker thread: header and data to ``temp``, renamed over ``path``; then marks ``renamed``."""
    block = memoryview(data).cast("B")
    header = _HEADER.pack(_MAGIC, _VERSION, len(key), block.nbytes, xxhash.xxh3_64_intdigest(block))
    try:
        fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            _write_all(fd, header + key)
            _write_all(fd, block)
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(temp, path)
    except BaseException:
        with suppress(FileNotFoundError):
            os.unlink(temp)
        raise
    renamed.append(True)
    if fsync:  # the rename itself
        dir_fd = os.open(path.parent, os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)


def _write_all(fd: int, buffer: bytes | memoryview) -> None:
    view = memoryview(buffer)
    while view:
        view = view[os.write(fd, view) :]


def _read_block_file(path: Path, key: bytes, into: memoryview) -> str | None:
    """Worker thread: read and verify ``path`` into ``into``; None, ``_MISSING`` or a reason."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return _MISSING
    try:
        head_bytes = _HEADER.size + len(key)
        head = os.pread(fd, head_bytes, 0)
        if len(head) < head_bytes:
            return f"truncated header ({len(head)} of {head_bytes} bytes)"
        magic, version, key_len, block_bytes, checksum = _HEADER.unpack_from(head)
        if magic != _MAGIC or version != _VERSION:
            return "not a directory tier block file"
        if key_len != len(key) or head[_HEADER.size :] != key:
            return "the file holds another key"
        target = memoryview(into).cast("B")
        if block_bytes != target.nbytes:
            return f"holds {block_bytes} bytes, expected {target.nbytes}"
        size = os.fstat(fd).st_size
        if size != head_bytes + block_bytes:
            return f"file is {size} bytes, expected {head_bytes + block_bytes}"
        got = os.preadv(fd, [target], head_bytes)
        if got != block_bytes:
            return f"short read ({got} of {block_bytes} bytes)"
        if xxhash.xxh3_64_intdigest(target) != checksum:
            return "checksum mismatch"
        return None
    finally:
        os.close(fd)
