"""The index journal's binary format: a header and PUT/DEL records (pure code).

File layout::

    header (64 bytes): magic "KVTFSJNL" | version u32 | reserved u32 | cache_id 16B
                       | reserved 24B | xxh3_64(previous 56 bytes) u64
    record:            body_len u32 | body | xxh3_64(body_len + body, seed) u64
    PUT body:          0x01 | count u32 | count x (slot u64 | checksum 16B | key_len u16 | key)
                       (the checksum as two u64: low half first)
    DEL body:          0x02 | count u32 | count x (key_len u16 | key)

A record carries a whole batch (one write job's blocks, one eviction), so it
is applied all or nothing. All integers are little endian; the block
checksum is the xxh3_128 of the block's bytes. The record checksum is seeded
with the cache id, so a record from another cache (or a stale one from a
previous generation of this file) never validates. Replay stops at the first
record that is short or fails its checksum: a torn tail from a crash is
dropped, and nothing after a damaged record is trusted.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import xxhash

JOURNAL_MAGIC = b"KVTFSJNL"
JOURNAL_VERSION = 1
HEADER_BYTES = 64
_HEADER = struct.Struct("<8sII16s24s")
_U64 = struct.Struct("<Q")
_LEN = struct.Struct("<I")
_KIND_COUNT = struct.Struct("<BI")
_PUT_ENTRY = struct.Struct("<QQQH")  # slot, checksum low and high 64 bits, key length
_KEY_LEN = struct.Struct("<H")
PUT_TYPE = 1
DEL_TYPE = 2
#: Keys longer than this are refused (a prefix hash plus a group index is ~36 bytes).
MAX_KEY_BYTES = 4096
#: A sanity bound on one record (a garbage length field must not look plausible).
_MAX_BODY = 64 * 1024 * 1024


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


def encode_put(entries: Iterable[tuple[bytes, int, int]], seed: int) -> bytes:
    """One PUT record for ``(key, slot, checksum)`` entries (applied all or nothing)."""
    pack = _PUT_ENTRY.pack
    low = (1 << 64) - 1
    parts = [b""]
    for key, slot, checksum in entries:
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
        parts.append(pack(slot, checksum & low, checksum >> 64, len(key)))
        parts.append(key)
    parts[0] = _KIND_COUNT.pack(PUT_TYPE, (len(parts) - 1) // 2)
    return _frame(b"".join(parts), seed)


def encode_del(keys: Iterable[bytes], seed: int) -> bytes:
    """One DEL record for ``keys``."""
    pack = _KEY_LEN.pack
    parts = [b""]
    for key in keys:
        if len(key) > MAX_KEY_BYTES:
            raise ValueError(f"key of {len(key)} bytes exceeds {MAX_KEY_BYTES}")
        parts.append(pack(len(key)))
        parts.append(key)
    parts[0] = _KIND_COUNT.pack(DEL_TYPE, (len(parts) - 1) // 2)
    return _frame(b"".join(parts), seed)


def _frame(body: bytes, seed: int) -> bytes:
    prefix = _LEN.pack(len(body))
    return prefix + body + _U64.pack(xxhash.xxh3_64_intdigest(prefix + body, seed))


@dataclass(frozen=True, slots=True)
class Record:
    """One decoded record: a PUT (slot and checksum set) or a DEL (slot None)."""

    key: bytes
    slot: int | None
    checksum: int


def iter_records(data: bytes | memoryview, seed: int) -> Iterator[tuple[list[Record], int]]:
    """Decode records from ``data`` (the bytes after the header); yields ``(entries, end)``.

    Stops silently at the first short, malformed or mismatching record.
    """
    view = memoryview(data)
    pos = 0
    size = len(view)
    while pos + _LEN.size <= size:
        (body_len,) = _LEN.unpack_from(view, pos)
        end = pos + _LEN.size + body_len + _U64.size
        if body_len < _KIND_COUNT.size or body_len > _MAX_BODY or end > size:
            return
        (stored,) = _U64.unpack_from(view, end - _U64.size)
        if xxhash.xxh3_64_intdigest(view[pos : end - _U64.size], seed) != stored:
            return
        entries = _decode_body(view[pos + _LEN.size : end - _U64.size])
        if entries is None:
            return
        yield entries, end
        pos = end


def _decode_body(body: memoryview) -> list[Record] | None:
    kind, count = _KIND_COUNT.unpack_from(body, 0)
    pos = _KIND_COUNT.size
    out: list[Record] = []
    try:
        if kind == PUT_TYPE:
            for _ in range(count):
                slot, low, high, key_len = _PUT_ENTRY.unpack_from(body, pos)
                pos += _PUT_ENTRY.size
                out.append(Record(bytes(body[pos : pos + key_len]), slot, low | high << 64))
                pos += key_len
        elif kind == DEL_TYPE:
            for _ in range(count):
                (key_len,) = _KEY_LEN.unpack_from(body, pos)
                pos += _KEY_LEN.size
                out.append(Record(bytes(body[pos : pos + key_len]), None, 0))
                pos += key_len
        else:
            return None
    except struct.error:
        return None
    if pos != len(body) or any(not r.key for r in out):
        return None
    return out


@dataclass(slots=True)
class ReplayResult:
    """The index a journal describes: ``entries`` in recency order (oldest first).

    ``records`` counts the records (batches) applied.
    """

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
    for records, end in iter_records(data, seed):
        count += 1
        valid = end
        for record in records:
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
