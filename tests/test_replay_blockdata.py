"""Deterministic block bytes: what the replay writes and verifies."""

from __future__ import annotations

import numpy as np
import pytest

from tiering.core.keys import split_offload_key
from tiering.replay.blockdata import BlockContents, block_key, word_rows


def test_contents_follow_from_the_id_and_differ_between_ids() -> None:
    contents = BlockContents(4096)
    row = np.zeros(512, dtype=np.uint64)
    contents.fill(7, row)
    assert contents.matches(7, row)
    assert np.array_equal(row, BlockContents(4096).expected(7))
    assert not contents.matches(8, row)
    # Every word differs from the other block's, so any torn or shifted copy is caught.
    assert np.all(contents.expected(7) != contents.expected(8))


def test_torn_shifted_and_zeroed_rows_fail_verification() -> None:
    contents = BlockContents(8192)
    good = contents.expected(1)
    torn = good.copy()
    torn[500:] = contents.expected(2)[500:]
    shifted = np.roll(good, 1)
    flipped = good.copy()
    flipped[3] ^= np.uint64(1 << 17)
    for bad in (torn, shifted, flipped, np.zeros_like(good)):
        assert not contents.matches(1, bad)


def test_word_rows_views_the_buffer_without_copying() -> None:
    buffer = bytearray(3 * 4096)
    rows = word_rows(memoryview(buffer), 4096)
    assert rows.shape == (3, 512)
    BlockContents(4096).fill(5, rows[2])
    assert bytes(buffer[:8192]) == bytes(8192)
    assert bytes(buffer[8192:]) == BlockContents(4096).expected(5).tobytes()
    with pytest.raises(ValueError, match="whole number"):
        word_rows(memoryview(bytearray(5000)), 4096)


def test_block_keys_carry_the_id() -> None:
    block_hash, group = split_offload_key(block_key(2**40 + 3))
    assert int.from_bytes(block_hash, "big") == 2**40 + 3
    assert group == 0
