"""Deterministic block contents: every block's bytes follow from its trace id.

A block is a fixed random pattern (seeded, one per block size) XORed with a 64-bit
word derived from the block's id. Different ids give different bytes at every
position, so a wrong block, a torn block (part of one, part of another) or a
zeroed row all fail :meth:`BlockContents.matches`. Filling or checking a 64 KiB
block costs a few microseconds of numpy work.
"""

from __future__ import annotations

import numpy as np
import numpy.typing as npt

from tiering.core.keys import OffloadKey, make_offload_key

_WORD = 8
_MASK64 = (1 << 64) - 1


def block_key(hash_id: int) -> OffloadKey:
    """The offload key of a trace block (its id as 8 big-endian bytes, KV group 0)."""
    return make_offload_key(hash_id.to_bytes(8, "big"), 0)


def _splitmix64(value: int) -> int:
    value = (value + 0x9E3779B97F4A7C15) & _MASK64
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class BlockContents:
    """Generates and checks the bytes of blocks of ``block_bytes`` bytes."""

    def __init__(self, block_bytes: int, seed: int = 0x6B76) -> None:
        if block_bytes <= 0 or block_bytes % _WORD:
            raise ValueError(f"block_bytes must be a positive multiple of 8, got {block_bytes}")
        self.block_bytes = block_bytes
        rng = np.random.Generator(np.random.PCG64(seed))
        self._pattern: npt.NDArray[np.uint64] = rng.integers(
            0, np.iinfo(np.uint64).max, size=block_bytes // _WORD, dtype=np.uint64, endpoint=True
        )

    def _salt(self, hash_id: int) -> np.uint64:
        # Never zero, so no block equals the bare pattern.
        return np.uint64(_splitmix64(hash_id) | 1)

    def expected(self, hash_id: int) -> npt.NDArray[np.uint64]:
        """A new array holding the block's bytes (as 64-bit words)."""
        return np.bitwise_xor(self._pattern, self._salt(hash_id))

    def fill(self, hash_id: int, row: npt.NDArray[np.uint64]) -> None:
        """Write the block's bytes into ``row`` (a ``block_bytes // 8`` word view)."""
        np.bitwise_xor(self._pattern, self._salt(hash_id), out=row)

    def matches(self, hash_id: int, row: npt.NDArray[np.uint64]) -> bool:
        """Whether ``row`` holds exactly the block's bytes."""
        return bool(np.array_equal(row, self.expected(hash_id)))


def word_rows(kv_view: memoryview, block_bytes: int) -> npt.NDArray[np.uint64]:
    """The primary tier's host buffer as a ``(num_blocks, block_bytes // 8)`` word array.

    No copy: writes to a row land in the buffer the tiers read from.
    """
    flat = np.frombuffer(kv_view, dtype=np.uint8)
    if flat.size % block_bytes:
        raise ValueError(
            f"the primary buffer ({flat.size} bytes) is not a whole number of "
            f"{block_bytes}-byte blocks"
        )
    return flat.view(np.uint64).reshape(flat.size // block_bytes, block_bytes // _WORD)
