"""Key names and the stored value format of the Redis tier.

One Redis string per block::

    <namespace>:v1:<layout hash, 16 hex>:{<offload key, hex>}

holding a 40-byte header followed by the block's bytes. The header (little
endian) is::

    magic        4s  b"KVTB"
    version      u8  FORMAT_VERSION
    flags        u8  0 (reserved)
    header_len   u16 HEADER_LEN
    fingerprint  u64 the layout hash: xxh3_64 of the layout fingerprint and block size
    key_hash     u64 xxh3_64 of the offload key
    payload_len  u64 number of block bytes that follow
    checksum     u64 xxh3_64 of those bytes

The hash tag (``{...}``) covers only the block's identity, so Redis Cluster
spreads blocks over every node (a tag over the namespace would put a whole
deployment on one slot) and any future per-block companion key shares its
block's slot. The format version is part of the key, so a newer format never
overwrites, or gets deleted as corrupt by, an older reader.
"""

from __future__ import annotations

import re
import struct

import xxhash

from tiering.errors import CorruptBlock
from tiering.keys import OffloadKey

MAGIC = b"KVTB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sBBHQQQQ")
HEADER_LEN = _HEADER.size

#: Namespaces become part of every key: keep them printable, short, and free of
#: the ``{}`` that Redis Cluster reads as a hash tag.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9._/\-]{1,128}")


def layout_hash(layout_fingerprint: str, block_bytes: int) -> int:
    """The 64-bit hash of a layout that keys and headers carry.

    It covers the block size as well as the user's fingerprint, so tiers with
    different block sizes never share key names even under the same (or an
    empty) fingerprint: neither can find, nor delete as corrupt, the other's
    blocks.
    """
    return xxhash.xxh3_64_intdigest(b"%s\0%d" % (layout_fingerprint.encode(), block_bytes))


class BlockLayout:
    """Names the keys and encodes/verifies the values of one tier instance.

    Bound to a namespace, a layout fingerprint and a block size, so every
    check is against what this tier instance itself would have written.
    """

    def __init__(self, namespace: str, layout_fingerprint: str, block_bytes: int) -> None:
        if not NAMESPACE_PATTERN.fullmatch(namespace):
            raise ValueError(f"invalid namespace {namespace!r}")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self.value_len = HEADER_LEN + block_bytes
        self.fingerprint = layout_hash(layout_fingerprint, block_bytes)
        self.prefix = f"{namespace}:v{FORMAT_VERSION}:{self.fingerprint:016x}:".encode()

    def redis_key(self, key: OffloadKey) -> bytes:
        """The Redis key holding ``key``'s block."""
        return b"%s{%s}" % (self.prefix, key.hex().encode())

    def encode(self, key: OffloadKey, data: memoryview) -> bytes:
        """Header plus ``data`` as one new value."""
        value = bytearray(self.value_len)
        self.encode_into(key, data, value)
        return bytes(value)

    def encode_into(self, key: OffloadKey, data: memoryview, value: bytearray) -> memoryview:
        """Write header plus ``data`` into ``value`` (``value_len`` bytes); a view of it.

        The only copy of the block on the store path: redis-py sends the view
        as it is.
        """
        if data.nbytes != self.block_bytes:
            raise ValueError(f"block is {data.nbytes} bytes, this tier stores {self.block_bytes}")
        if len(value) != self.value_len:
            raise ValueError(f"value buffer is {len(value)} bytes, need {self.value_len}")
        _HEADER.pack_into(
            value,
            0,
            MAGIC,
            FORMAT_VERSION,
            0,
            HEADER_LEN,
            self.fingerprint,
            xxhash.xxh3_64_intdigest(key),
            self.block_bytes,
            xxhash.xxh3_64_intdigest(data),
        )
        view = memoryview(value)
        view[HEADER_LEN:] = data if data.format == "B" and data.ndim == 1 else data.cast("B")
        return view

    def decode_into(self, key: OffloadKey, value: bytes, into: memoryview) -> None:
        """Verify ``value`` as ``key``'s block and copy its bytes into ``into``.

        Raises :class:`CorruptBlock` naming the first check that failed; ``into``
        is untouched then.
        """
        if into.nbytes != self.block_bytes:
            raise ValueError(
                f"destination is {into.nbytes} bytes, this tier stores {self.block_bytes}"
            )
        if len(value) < HEADER_LEN:
            raise CorruptBlock(key, f"value of {len(value)} bytes is shorter than the header")
        magic, version, flags, header_len, fingerprint, key_hash, length, checksum = (
            _HEADER.unpack_from(value)
        )
        if magic != MAGIC:
            raise CorruptBlock(key, f"bad magic {magic!r}")
        if version != FORMAT_VERSION or header_len != HEADER_LEN:
            raise CorruptBlock(key, f"unsupported format version {version} (header {header_len})")
        if flags != 0:
            raise CorruptBlock(key, f"unknown flags {flags:#x}")
        if fingerprint != self.fingerprint:
            raise CorruptBlock(key, "written under another layout fingerprint")
        if key_hash != xxhash.xxh3_64_intdigest(key):
            raise CorruptBlock(key, "value belongs to another key")
        if length != self.block_bytes or len(value) != HEADER_LEN + length:
            raise CorruptBlock(
                key,
                f"length mismatch: header says {length}, value holds "
                f"{len(value) - HEADER_LEN}, blocks are {self.block_bytes}",
            )
        payload = memoryview(value)[HEADER_LEN:]
        if xxhash.xxh3_64_intdigest(payload) != checksum:
            raise CorruptBlock(key, "checksum mismatch")
        if into.format != "B" or into.ndim != 1:
            into = into.cast("B")
        into[:] = payload


class ValueBuffers:
    """Reusable ``bytearray`` s of one size for encoding stored values.

    A fresh allocation per stored block would be returned to the OS after
    each job and page-faulted back in for the next, costing about as much as
    the copy itself for large blocks. Keeps at most ``max_retained``.
    Owned by the tier's loop thread.
    """

    def __init__(self, size: int, max_retained: int) -> None:
        self.size = size
        self.max_retained = max(0, max_retained)
        self._free: list[bytearray] = []

    def take(self) -> bytearray:
        return self._free.pop() if self._free else bytearray(self.size)

    def give_back(self, buffers: list[bytearray]) -> None:
        room = self.max_retained - len(self._free)
        if room > 0:
            self._free.extend(buffers[:room])

    @property
    def retained(self) -> int:
        return len(self._free)
