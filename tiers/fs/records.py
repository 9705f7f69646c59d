"""The index journal's binary format: a header and PUT/DEL records (pure code).

File layout::

    header (64 bytes): magic "KVTFSJNL" | version u32 | reserved u32 | cache_id 16B
                       | reserved 24B | xxh3_64(previous 56 bytes) u64
    record:            body_len u32 | body | xxh3_64(body_len + body, seed) u64
    PUT body:          0x01 | slot u64 | block checksum 16B (xxh3_128) | key
    DEL body:          0x02 | key

All integers are little endian. The record checksum is seeded with the
cache id, so a record from another cache (or a stale one from a previous
generation of this file) never validates. Replay stops at the first record
that is short or fails its checksum: a torn tail from a crash is dropped, and
nothing after a damaged record is trusted.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

import xxhash

JOURNAL_MAGIC = b"KVTFSJNL"
JOURNAL_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sII16s24s")
_U64 = struct.Struct("<Q")
_LEN = struct.Struct("<I")
_PUT = struct.Struct("<BQ16s")
PUT_TYPE = 1
DEL_TYPE = 2
#: Keys longer than this are refused (a prefix hash plus a group index is ~36 bytes).
MAX_KEY_BYTES = 4096
_MAX_BODY = _PUT.size + MAX_KEY_BYTES
CHECKSUM_BYTES = 16


def encode_header(cache_id: bytes) -> bytes:
    if len(cache_id) != 16:
        raise ValueError(f"cache_id must be 16 bytes, got {len(cache_id)}")
    head = _HEADER.pack(JOURNAL_MAGIC, JOURNAL_VERSION, 0, cache_id, bytes(24))
    return head + _U64.pack(xxhash.xxh3_64_intdigest(head))


def decode_header(data: bytes, cache_id: bytes) -> str | None:
    """Why ``data`` is not a journal header of cache ``cache_id`` (None when it is)."""
    if len(data) < HEADER_BYTES:
        return f"journal header is short ({len(data)} bytes)"
    head = data[: _HEADER.size]
    (stored,) = _U64.unpack_from(data, _HEADER.size)
    if xxhash.xxh3_64_intdigest(head) != stored:
        return "journal header checksum mismatch"
    magic, version, _, journal_cache_id, _ = _HEADER.unpack(head)
    if magic != JOURNAL_MAGIC or version != JOURNAL_VERSION:
        return f"not a v{JOURNAL_VERSION} journal (magic {magic!r}, version {version})"
    if journal_cache_id != cache_id:
        return "journal belongs to another cache"
    return None


def checksum_bytes(digest: int) -> bytes:
    return digest.to_bytes(CHECKSUM_BYTES, "little")


def encode_put(key: bytes, slot: int, checksum: int, seed: int) -> bytes:
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    body = _PUT.pack(PUT_TYPE, slot, checksum_bytes(checksum)) + key
    return _frame(body, seed)


def encode_del(key: bytes, seed: int) -> bytes:
    if len(key) > MAX_KEY_BYTES:
        raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
    return _frame(bytes((DEL_TYPE,)) + key, seed)


def _frame(body: bytes, seed: int) -> bytes:
    prefix = _LEN.pack(len(body))
    return prefix + body + _U64.pack(xxhash.xxh3_64_intdigest(prefix + body, seed))


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded record: a PUT (slot and checksum set) or a DEL (slot None)."""

    key: bytes
    slot: int | None
    checksum: int


def iter_records(data: bytes | memoryview, seed: int) -> Iterator[tuple[Record, int]]:
    """Decode records from ``data`` (the bytes after the header); yields ``(record, end)``.

    Stops silently at the first short, malformed or mismatching record.
    """
    view = memoryview(data)
    pos = 0
    size = len(view)
    while pos + _LEN.size <= size:
        (body_len,) = _LEN.unpack_from(view, pos)
        end = pos + _LEN.size + body_len + _U64.size
        if body_len < 2 or body_len > _MAX_BODY or end > size:
            return
        framed = view[pos : pos + _LEN.size + body_len]
        (stored,) = _U64.unpack_from(view, end - _U64.size)
        if xxhash.xxh3_64_intdigest(framed, seed) != stored:
            return
        kind = view[pos + _LEN.size]
        if kind == PUT_TYPE and body_len > _PUT.size:
            _, slot, digest = _PUT.unpack_from(view, pos + _LEN.size)
            key = bytes(view[pos + _LEN.size + _PUT.size : end - _U64.size])
            yield Record(key, slot, int.from_bytes(digest, "little")), end
        elif kind == DEL_TYPE:
            yield Record(bytes(view[pos + _LEN.size + 1 : end - _U64.size]), None, 0), end
        else:
            return
        pos = end


@dataclass(slots=True)
class ReplayResult:
    """The index a journal describes: ``entries`` in recency order (oldest first)."""

    entries: dict[bytes, tuple[int, int]]
    valid_bytes: int
    records: int


def replay(data: bytes | memoryview, seed: int) -> ReplayResult:
    """Apply the records of ``data`` (after the header) in order.

    A PUT replaces the key's previous slot and evicts any other key claiming
    the same slot (the later record wins: that slot was reused). A DEL drops
    the key. ``valid_bytes`` is where the valid prefix ends.
    """
    entries: dict[bytes, tuple[int, int]] = {}
    owner: dict[int, bytes] = {}
    valid = 0
    count = 0
    for record, end in iter_records(data, seed):
        count += 1
        valid = end
        previous = entries.pop(record.key, None)
        if previous is not None:
            owner.pop(previous[0], None)
        if record.slot is None:
            continue
        other = owner.get(record.slot)
        if other is not None:
            del entries[other]
        entries[record.key] = (record.slot, record.checksum)
        owner[record.slot] = record.key
    return ReplayResult(entries, valid, count)
