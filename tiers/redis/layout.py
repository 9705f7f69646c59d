"""Key names and the stored value formats of the Redis tier.

One Redis string per block::

    <namespace>:v1:<layout hash, 16 hex>:{<offload key, hex>}              no auth key
    <namespace>:v2:<layout hash, 16 hex>:<key id, 8 hex>:{<offload key>}   auth_mac hmac-sha256
    <namespace>:v3:<layout hash, 16 hex>:<key id, 8 hex>:{<offload key>}   auth_mac blake3
    <namespace>:v4:<layout hash, 16 hex>:<key id, 8 hex>:{<offload key>}   auth_mac ghash-aes

holding a header followed by the block's bytes. Format 1 (no auth key), 40
bytes, little endian::

    magic        4s  b"KVTB"
    version      u8  1
    flags        u8  0
    header_len   u16 40
    fingerprint  u64 the layout hash: xxh3_64 of the layout fingerprint and block size
    key_hash     u64 xxh3_64 of the offload key
    payload_len  u64 number of block bytes that follow
    checksum     u64 xxh3_64 of those bytes

Formats 2, 3 and 4 (authenticated, 48 bytes) have the same first seven fields
(version 2, 3 or 4, flags ``FLAG_AUTHENTICATED``, plus ``FLAG_BLAKE3`` for 3 or
``FLAG_GHASH_AES`` for 4, header_len 48) and then::

    tag          16s the MAC of (offload key, layout fingerprint, payload) by the auth key:
                     HMAC-SHA256 (format 2, what earlier releases wrote), keyed BLAKE3
                     (format 3) or ghash-aes (format 4, the default), 16 bytes

The tag replaces the checksum: it covers the payload's integrity as well as
who wrote it (see :mod:`tiering.tier.auth`). The key id is a public digest of the
auth key (the first 4 bytes of its tag over nothing): engines with different
keys, or a key rotated, use different key names and never fight over (or
delete as forged) each other's blocks. A tier reads the format its settings
write: format 1 without an auth key, 2 with ``auth_mac: "hmac-sha256"`` (so an
engine of this release and one of an earlier release share their blocks), 3
with ``"blake3"`` (the previous release's default: set it to share blocks with
engines of that release), 4 with ``"ghash-aes"``.

The hash tag (``{...}``) covers only the block's identity, so Redis Cluster
spreads blocks over every node (a tag over the namespace would put a whole
deployment on one slot) and any future per-block companion key shares its
block's slot. The format version is part of the key, so a newer format never
overwrites, or gets deleted as corrupt by, an older reader.
"""

from __future__ import annotations

import functools
import re
import struct
from collections.abc import Sequence

import xxhash

from tiering.copy.bulk import address_of, copy_regions
from tiering.core.keys import OffloadKey
from tiering.tier import auth as _auth
from tiering.tier.auth import (
    BLAKE3,
    GHASH_AES,
    TAG_BYTES,
    BlockAuthenticator,
    OffLoopWork,
    slices,
)
from tiers.redis.errors import RejectedValue

MAGIC = b"KVTB"
FORMAT_VERSION = 1
AUTH_FORMAT_VERSION = 2  # HMAC-SHA256 tags
BLAKE3_FORMAT_VERSION = 3  # keyed BLAKE3 tags
GHASH_AES_FORMAT_VERSION = 4  # ghash-aes tags
FLAG_AUTHENTICATED = 0x01
FLAG_BLAKE3 = 0x02
FLAG_GHASH_AES = 0x04
_HEADER = struct.Struct("<4sBBHQQQQ")
_AUTH_HEADER = struct.Struct(f"<4sBBHQQQ{TAG_BYTES}s")
#: The unauthenticated (format 1) header's length.
HEADER_LEN = _HEADER.size
AUTH_HEADER_LEN = _AUTH_HEADER.size
#: Every format starts with these fields.
_COMMON = struct.Struct("<4sBBHQQQ")

#: Payload copies of at least this many bytes go through the bulk copy, which
#: releases the GIL while it copies (the scheduler thread keeps running Python
#: during a large block's copy) and keeps the block out of the shared caches.
#: Smaller copies (a few microseconds) are cheaper than handing the GIL over and
#: back, and barely delay anyone.
GIL_FREE_COPY_BYTES = 64 << 10

#: Namespaces become part of every key: keep them printable, short, and free of
#: the ``{}`` that Redis Cluster reads as a hash tag.
NAMESPACE_PATTERN = re.compile(r"[A-Za-z0-9._/\-]{1,128}")


def layout_identity(layout_fingerprint: str, block_bytes: int) -> bytes:
    """The bytes that name a layout: the user's fingerprint and the block size."""
    return b"%s\0%d" % (layout_fingerprint.encode(), block_bytes)


def layout_hash(layout_fingerprint: str, block_bytes: int) -> int:
    """The 64-bit hash of a layout that keys and headers carry.

    It covers the block size as well as the user's fingerprint, so tiers with
    different block sizes never share key names even under the same (or an
    empty) fingerprint: neither can find, nor delete as corrupt, the other's
    blocks.
    """
    return xxhash.xxh3_64_intdigest(layout_identity(layout_fingerprint, block_bytes))


def key_id(authenticator: BlockAuthenticator) -> str:
    """A public 8-hex-digit name of an auth key (reveals nothing usable about it)."""
    return authenticator.tag(b"", b"kv-tiering redis key id", b"")[:4].hex()


class BlockLayout:
    """Names the keys and encodes/verifies the values of one tier instance.

    Bound to a namespace, a layout fingerprint, a block size and (optionally)
    an auth key, so every check is against what this tier instance itself
    would have written. With an authenticator, values are format 2 (HMAC-SHA256),
    3 (keyed BLAKE3) or 4 (ghash-aes) by its ``mac``, and tags are computed here, on the
    caller's thread: the tier's loop, or a hashing thread (:func:`encode_off_loop`
    for stores, :mod:`tiers.redis.loads` for loads); the layout is immutable once
    built, so either is safe.
    """

    def __init__(
        self,
        namespace: str,
        layout_fingerprint: str,
        block_bytes: int,
        authenticator: BlockAuthenticator | None = None,
    ) -> None:
        if not NAMESPACE_PATTERN.fullmatch(namespace):
            raise ValueError(f"invalid namespace {namespace!r}")
        if block_bytes <= 0:
            raise ValueError(f"block_bytes must be positive, got {block_bytes}")
        self.block_bytes = block_bytes
        self.authenticator = authenticator
        if authenticator is None:
            self.version, self.flags = FORMAT_VERSION, 0
        elif authenticator.mac == GHASH_AES:
            self.version = GHASH_AES_FORMAT_VERSION
            self.flags = FLAG_AUTHENTICATED | FLAG_GHASH_AES
        elif authenticator.mac == BLAKE3:
            self.version, self.flags = BLAKE3_FORMAT_VERSION, FLAG_AUTHENTICATED | FLAG_BLAKE3
        else:
            self.version, self.flags = AUTH_FORMAT_VERSION, FLAG_AUTHENTICATED
        self.header_len = HEADER_LEN if authenticator is None else AUTH_HEADER_LEN
        self.value_len = self.header_len + block_bytes
        self.fingerprint = layout_hash(layout_fingerprint, block_bytes)
        self._identity = layout_identity(layout_fingerprint, block_bytes)
        if authenticator is None:
            self.prefix = f"{namespace}:v{self.version}:{self.fingerprint:016x}:".encode()
        else:
            self.prefix = (
                f"{namespace}:v{self.version}:{self.fingerprint:016x}:{key_id(authenticator)}:"
            ).encode()

    @property
    def authenticated(self) -> bool:
        return self.authenticator is not None

    def redis_key(self, key: OffloadKey) -> bytes:
        """The Redis key holding ``key``'s block."""
        return b"%s{%s}" % (self.prefix, key.hex().encode())

    def encode(self, key: OffloadKey, data: memoryview) -> bytes:
        """Header plus ``data`` as one new value."""
        value = bytearray(self.value_len)
        self.encode_into(key, data, value)
        return bytes(value)

    def header(self, key: OffloadKey, data: memoryview) -> bytes:
        """The header of ``data`` stored as ``key``'s block (hashes, or tags, the payload).

        xxhash, OpenSSL's HMAC and AES-GCM, and BLAKE3 all release the GIL over a block
        payload.
        """
        if data.nbytes != self.block_bytes:
            raise ValueError(f"block is {data.nbytes} bytes, this tier stores {self.block_bytes}")
        if self.authenticator is None:
            return _HEADER.pack(
                MAGIC,
                FORMAT_VERSION,
                0,
                HEADER_LEN,
                self.fingerprint,
                xxhash.xxh3_64_intdigest(key),
                self.block_bytes,
                xxhash.xxh3_64_intdigest(data),
            )
        return _AUTH_HEADER.pack(
            MAGIC,
            self.version,
            self.flags,
            AUTH_HEADER_LEN,
            self.fingerprint,
            xxhash.xxh3_64_intdigest(key),
            self.block_bytes,
            self.authenticator.tag(key, self._identity, data),
        )

    def encode_into(self, key: OffloadKey, data: memoryview, value: bytearray) -> memoryview:
        """Write header plus ``data`` into ``value`` (``value_len`` bytes); a view of it."""
        if len(value) != self.value_len:
            raise ValueError(f"value buffer is {len(value)} bytes, need {self.value_len}")
        header = self.header(key, data)
        view = memoryview(value)
        view[: self.header_len] = header
        copy_bytes(view[self.header_len :], data)
        return view

    def decode_into(self, key: OffloadKey, value: bytes, into: memoryview) -> None:
        """Verify ``value`` as ``key``'s block and copy its bytes into ``into``.

        Raises :class:`RejectedValue` (a ``CorruptBlock``) naming the first
        check that failed and its reason class; ``into`` is untouched then.
        """
        if into.nbytes != self.block_bytes:
            raise ValueError(
                f"destination is {into.nbytes} bytes, this tier stores {self.block_bytes}"
            )
        copy_bytes(into, self.verified_payload(key, value))

    def verified_payload(self, key: OffloadKey, value: bytes) -> memoryview:
        """The block bytes of ``value`` once every check passed; raises :class:`RejectedValue`."""
        header_len = self.header_len
        if len(value) < header_len:
            raise RejectedValue(
                key, "malformed", f"value of {len(value)} bytes is shorter than the header"
            )
        magic, version, flags, stored_header_len, fingerprint, key_hash, length = (
            _COMMON.unpack_from(value)
        )
        if magic != MAGIC:
            raise RejectedValue(key, "malformed", f"bad magic {magic!r}")
        if version != self.version or stored_header_len != header_len:
            raise RejectedValue(
                key,
                "malformed",
                f"unsupported format version {version} (header {stored_header_len}); "
                f"this tier reads version {self.version}",
            )
        if flags != self.flags:
            raise RejectedValue(key, "malformed", f"unexpected flags {flags:#x}")
        if fingerprint != self.fingerprint:
            raise RejectedValue(key, "foreign", "written under another layout fingerprint")
        if key_hash != xxhash.xxh3_64_intdigest(key):
            raise RejectedValue(key, "foreign", "value belongs to another key")
        if length != self.block_bytes or len(value) != header_len + length:
            raise RejectedValue(
                key,
                "malformed",
                f"length mismatch: header says {length}, value holds "
                f"{len(value) - header_len}, blocks are {self.block_bytes}",
            )
        payload = memoryview(value)[header_len:]
        if self.authenticator is None:
            (checksum,) = _CHECKSUM.unpack_from(value, _COMMON.size)
            if xxhash.xxh3_64_intdigest(payload) != checksum:
                raise RejectedValue(key, "checksum", "checksum mismatch")
        else:
            tag = bytes(memoryview(value)[_COMMON.size : header_len])
            if not self.authenticator.verify(key, self._identity, payload, tag):
                raise RejectedValue(
                    key, "unauthenticated", "authentication tag mismatch (not written with our key)"
                )
        return payload


_CHECKSUM = struct.Struct("<Q")


async def encode_off_loop(
    layout: BlockLayout,
    work: OffLoopWork,
    keys: Sequence[OffloadKey],
    data: Sequence[memoryview],
    values: list[bytearray],
) -> list[memoryview]:
    """:meth:`BlockLayout.encode_into` of each block, on the hashing threads of ``work``.

    In slices of about ``OFFLOAD_SLICE_BYTES``, so the threads share a pipeline's
    blocks, the loop thread taking its share too (it has nothing else to do for
    this round trip until every value is ready). A block of the wrong size
    raises ``ValueError`` here, before any thread starts; an error of the
    encoding itself is raised once every slice is over. Cancellation: returns
    only once no thread reads ``data`` or writes ``values`` any more, then
    propagates.
    """
    for block in data:
        if block.nbytes != layout.block_bytes:
            raise ValueError(
                f"block is {block.nbytes} bytes, this tier stores {layout.block_bytes}"
            )
    out: list[memoryview | None] = [None] * len(keys)
    for lo, hi in slices([layout.value_len] * len(keys), _auth.OFFLOAD_SLICE_BYTES):
        work.submit(functools.partial(_encode_slice, layout, keys, data, values, out, lo, hi))
    await work.wait(help=True)  # the round trip cannot start before: the loop shares the work
    views = [view for view in out if view is not None]
    if len(views) != len(keys):
        raise work.failure or RuntimeError("a block was not encoded")
    return views


def _encode_slice(
    layout: BlockLayout,
    keys: Sequence[OffloadKey],
    data: Sequence[memoryview],
    values: list[bytearray],
    out: list[memoryview | None],
    lo: int,
    hi: int,
) -> None:
    for i in range(lo, hi):
        out[i] = layout.encode_into(keys[i], data[i], values[i])


def copy_bytes(dest: memoryview, source: memoryview) -> None:
    """Copy ``source`` into ``dest`` (same size, C-contiguous), without the GIL when large.

    Large copies go through the library's bulk copy: besides releasing the
    GIL, it writes with non-temporal stores and evicts the source's lines once
    read, so a block passing through this core does not push the scheduler's
    lines out of the cache they share (``docs/copy-engine.md``).
    """
    if dest.nbytes != source.nbytes:
        raise ValueError(f"copying {source.nbytes} bytes into a buffer of {dest.nbytes}")
    if dest.nbytes >= GIL_FREE_COPY_BYTES:
        copy_regions([address_of(source)], [address_of(dest)], dest.nbytes)
        return
    if dest.format != "B" or dest.ndim != 1:
        dest = dest.cast("B")
    if source.format != "B" or source.ndim != 1:
        source = source.cast("B")
    dest[:] = source


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
