"""``tiering.copy.caches.evict_block``: lines leave the caches, bytes stay in memory."""

from __future__ import annotations

import numpy as np
import pytest

from tiering.copy import bulk, caches

native_only = pytest.mark.skipif(not bulk.native_available(), reason="the extension is not built")


@pytest.mark.parametrize(
    ("start", "length"),
    [
        (0, caches.EVICT_MIN_BYTES),  # the shortest block evicted, line-aligned
        (1, caches.EVICT_MIN_BYTES + 62),  # ends mid-line, starts mid-line
        (4095, 3 * caches.EVICT_MIN_BYTES + 1),
        (64, caches.EVICT_RELEASE_GIL_BYTES + 65),  # long enough to release the GIL
        (7, caches.EVICT_MIN_BYTES - 1),  # too short: left alone
    ],
)
def test_eviction_writes_dirty_lines_back_and_changes_no_byte(start: int, length: int) -> None:
    rng = np.random.default_rng(start + length)
    buffer = np.zeros(length + 8192, np.uint8)
    buffer[:] = rng.integers(0, 256, buffer.size, dtype=np.uint8)  # dirty lines in the caches
    before = buffer.copy()
    caches.evict_block(memoryview(buffer)[start : start + length])
    assert np.array_equal(buffer, before)
    buffer[start : start + length] ^= 0xFF  # still an ordinary, writable buffer
    assert np.array_equal(buffer[start : start + length], before[start : start + length] ^ 0xFF)


def test_read_only_blocks_are_evicted_too() -> None:
    payload = bytes(range(256)) * 1024
    caches.evict_block(memoryview(payload))
    assert payload == bytes(range(256)) * 1024


def test_a_non_contiguous_block_is_refused_with_its_bytes_unchanged() -> None:
    buffer = np.arange(1 << 18, dtype=np.uint8)
    before = buffer.copy()
    with pytest.raises(BufferError):
        caches.evict_block(memoryview(buffer)[::2])
    assert np.array_equal(buffer, before)


def test_only_blocks_of_the_minimum_size_reach_the_extension(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    calls: list[tuple[int, int]] = []

    class Recorder:
        def evict_lines(self, block: memoryview, release_gil_from_bytes: int) -> None:
            calls.append((block.nbytes, release_gil_from_bytes))

    monkeypatch.setattr(caches, "_native", Recorder())
    buffer = np.ones(1 << 20, np.uint8)
    caches.evict_block(memoryview(buffer)[: caches.EVICT_MIN_BYTES - 1])
    caches.evict_block(memoryview(buffer)[: caches.EVICT_MIN_BYTES])
    assert calls == [(caches.EVICT_MIN_BYTES, caches.EVICT_RELEASE_GIL_BYTES)]
    monkeypatch.setattr(caches, "_native", None)  # not built: nothing to call, nothing fails
    caches.evict_block(memoryview(buffer))
    assert int(buffer.sum()) == 1 << 20


@native_only
def test_eviction_uses_the_copies_line_flush() -> None:
    from tiering.copy import _bulkcopy

    assert caches.EVICTION == _bulkcopy.SOURCE_FLUSH
    assert caches.EVICTION in ("clflushopt", "clflush", "none")


@native_only
def test_the_extension_refuses_what_is_not_a_buffer() -> None:
    from tiering.copy import _bulkcopy

    with pytest.raises(TypeError):
        _bulkcopy.evict_lines(12345, 0)
