"""Keys of offloaded blocks and per-request context (the seed contract's basics)."""

from __future__ import annotations

import operator
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, NewType

#: Identity of one offloaded block: the block's prefix hash followed by the KV
#: cache group index (4 bytes, big endian). Opaque bytes to every tier.
OffloadKey = NewType("OffloadKey", bytes)

_GROUP_IDX_BYTES = 4


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-cache group index into an :data:`OffloadKey`.

    Raises ``TypeError`` for a hash that is not bytes-like or a group index
    that is not an integer, and ``ValueError`` for an empty hash or a group
    index outside ``[0, 2**32)``.
    """
    if not isinstance(block_hash, (bytes, bytearray, memoryview)):
        raise TypeError(f"block_hash must be bytes, not {type(block_hash).__name__}")
    if len(block_hash) == 0:
        raise ValueError("block_hash must not be empty")
    try:
        if isinstance(group_idx, bool):  # an int subclass, but never a group index
            raise TypeError
        group_idx = operator.index(group_idx)
    except TypeError:
        raise TypeError(f"group_idx must be an int, not {type(group_idx).__name__}") from None
    if not 0 <= group_idx < 2 ** (8 * _GROUP_IDX_BYTES):
        raise ValueError(f"group_idx must be in [0, 2**32), got {group_idx}")
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(_GROUP_IDX_BYTES, "big"))


def split_offload_key(key: OffloadKey) -> tuple[bytes, int]:
    """Inverse of :func:`make_offload_key`: ``(block_hash, group_idx)``."""
    if len(key) <= _GROUP_IDX_BYTES:
        raise ValueError(f"not an offload key (only {len(key)} bytes)")
    return key[:-_GROUP_IDX_BYTES], int.from_bytes(key[-_GROUP_IDX_BYTES:], "big")


@dataclass(frozen=True, slots=True)
class ReqContext:
    """Per-request context passed along with lookups, loads and stores.

    ``kv_transfer_params`` carries the request's ``kv_transfer_params`` from the
    engine unchanged; tiers may read it (for example a per-request namespace)
    but never mutate it.
    """

    req_id: str | None = None
    kv_transfer_params: Mapping[str, Any] | None = field(default=None)


#: The context used where a caller has none (benchmarks, replay, tests).
NO_CONTEXT = ReqContext()
