"""The journal file on disk: replayed at open, replaced whole by a snapshot.

:func:`recover` reads the journal a previous run left (whatever its
damage: see :mod:`tiers.fs.records`); :func:`write_snapshot` and
:func:`write_snapshot_for_append` replace it atomically with PUT records of
the visible entries, at open and at each compaction. All of it blocks: run
it in a worker thread. The journal at run time (appends, group commit,
compaction) is :mod:`tiers.fs.journal`.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence

from tiering.runtime.gil_breaks import GilBreaks, clear_in_turns
from tiers.fs.files import RootDir
from tiers.fs.layout import JOURNAL_NAME, Header
from tiers.fs.records import (
    HEADER_BYTES,
    EntryValue,
    ReplayResult,
    decode_header,
    encode_header,
    encode_put,
    encode_put_tagged,
    replay,
)

#: Entries per PUT record in a snapshot: a damaged record loses at most this many blocks
#: (each record costs 21 bytes of framing, about 2% of 16 entries of 70 bytes).
SNAPSHOT_RECORD_ENTRIES = 16


def recover(root: RootDir, header: Header) -> tuple[ReplayResult, list[str], bool]:
    """Replay ``root``'s journal.

    Returns the result, what was wrong with the file (if anything) and
    whether the file has an intact header of this cache (so records may be
    appended to it as it is).

    A damaged record costs only its own entries (replay resynchronises on
    the next valid record); a damaged journal header is reported and the
    records after it are still read (their checksums are seeded with this
    cache's id, so records of another cache never validate). A missing
    journal yields no entries. Blocking: call it in a worker thread.
    """
    fd = _open_existing(root)
    if fd is None:
        return ReplayResult({}, 0, 0), [], False
    try:
        data = _read_all(fd)
    finally:
        os.close(fd)
    problems: list[str] = []
    problem = decode_header(data, bytes.fromhex(header.cache_id))
    if problem is not None:
        problems.append(problem)
    body = memoryview(data)[min(HEADER_BYTES, len(data)) :]
    result = replay(body, header.journal_seed)
    damaged = [r for r in result.skipped if r[0] < result.valid_bytes]
    if damaged:
        problems.append(
            f"skipped {len(damaged)} damaged region(s) of {result.damaged_bytes} bytes "
            f"(first at offset {HEADER_BYTES + damaged[0][0]}); the records around them were kept"
        )
    if result.tail_bytes:
        problems.append(f"dropped a damaged or torn tail of {result.tail_bytes} bytes")
    return result, problems, problem is None


def _open_existing(root: RootDir) -> int | None:
    try:
        return root.open_file(JOURNAL_NAME, os.O_RDONLY)
    except FileNotFoundError:
        return None


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    return b"".join(chunks)


#: One snapshot entry: ``(key, (slot, checksum, stored tag))`` (tag None without a MAC key).
SnapshotEntry = tuple[bytes, EntryValue]
#: The index as a compaction copies it on the loop thread: its keys and its entries, two
#: lists of references (no object created per block, so the copy starts no collection);
#: every per-entry step is :func:`encode_snapshot`'s, in a worker thread.
Snapshot = tuple[list[bytes], list[EntryValue]]


def _no_pause() -> None:
    pass


def encode_snapshot(
    header: Header,
    keys: Sequence[bytes],
    values: Sequence[EntryValue],
    pause: Callable[[], None] = _no_pause,
) -> bytes:
    """A whole journal holding ``values[i]`` for each ``keys[i]``, in small records so one
    bad record costs little.

    ``pause()`` runs after each record: a :class:`~tiering.runtime.gil_breaks.GilBreaks`
    keeps a worker thread encoding a large index from holding the GIL for long.
    """
    if len(keys) != len(values):
        raise ValueError(f"{len(keys)} keys but {len(values)} entries")
    seed = header.journal_seed
    parts = [encode_header(bytes.fromhex(header.cache_id))]
    chunk = SNAPSHOT_RECORD_ENTRIES
    start = 0
    while start < len(keys):
        run = values[start : start + chunk]
        if all(entry[2] is None for entry in run):  # no MAC key: the usual case
            entries = zip(keys[start : start + chunk], run, strict=True)
            parts.append(encode_put([(k, s, c) for k, (s, c, _) in entries], seed))
            start += len(run)
        else:
            # Runs of untagged entries, or of tags by one MAC (a key may have been added or
            # removed since, or the MAC changed).
            kind = _tag_kind(values[start][2])
            stop = start + 1
            while stop < len(keys) and stop - start < chunk and _tag_kind(values[stop][2]) == kind:
                stop += 1
            tagged = zip(keys[start:stop], values[start:stop], strict=True)
            if kind is not None:
                parts.append(
                    encode_put_tagged([(k, s, c, t) for k, (s, c, t) in tagged if t], seed)
                )
            else:
                parts.append(encode_put([(k, s, c) for k, (s, c, _) in tagged], seed))
            start = stop
        pause()
    return b"".join(parts)


def _tag_kind(tag: bytes | None) -> int | None:
    return None if tag is None else tag[0]


def write_snapshot(root: RootDir, header: Header, entries: Sequence[SnapshotEntry]) -> int:
    """Atomically replace the journal with PUT records of ``entries``; returns its size.

    Blocking: call it in a worker thread.
    """
    keys, values = [key for key, _ in entries], [value for _, value in entries]
    payload = encode_snapshot(header, keys, values, GilBreaks())
    root.replace_atomically(JOURNAL_NAME, payload)
    return len(payload)


def write_snapshot_for_append(root: RootDir, header: Header, snapshot: Snapshot) -> tuple[int, int]:
    """The journal replaced by ``snapshot``; a descriptor of the new file and its size.

    Consumes ``snapshot``: its lists are emptied once encoded, in turns (freeing a million
    references at once would hold the GIL for about 10 ms). The descriptor is that of the
    file written, even if the name is removed or replaced right after the rename.
    Blocking: call it in a worker thread.
    """
    breaks = GilBreaks()
    payload = encode_snapshot(header, *snapshot, breaks)
    keys, values = snapshot
    clear_in_turns(keys, breaks)
    clear_in_turns(values, breaks)
    fd = root.replace_atomically(JOURNAL_NAME, payload, keep_open=True)
    assert fd is not None
    return fd, len(payload)


def open_for_append(root: RootDir) -> int:
    return root.open_file(JOURNAL_NAME, os.O_WRONLY)
