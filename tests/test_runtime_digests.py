"""``StoredDigests``: the runtime's checksums of the blocks this process stored."""

from __future__ import annotations

import pytest
import xxhash
from hypothesis import given
from hypothesis import strategies as st

from tiering.core.keys import make_offload_key
from tiering.runtime import digests as digests_module
from tiering.runtime.digests import StoredDigests, block_checksum


def _key(i: int) -> bytes:
    return make_offload_key(i.to_bytes(16, "little"), 0)


def test_record_replaces_and_forget_drops() -> None:
    digests = StoredDigests()
    key = _key(1)
    digests.record([key], [memoryview(b"a" * 64)])
    assert digests.get(key) == block_checksum(memoryview(b"a" * 64))
    digests.record([key], [memoryview(b"b" * 64)])
    assert digests.get(key) == block_checksum(memoryview(b"b" * 64)) and len(digests) == 1
    digests.forget(key)
    assert digests.get(key) is None


def test_a_block_is_evicted_from_the_caches_once_hashed(monkeypatch: pytest.MonkeyPatch) -> None:
    evicted: list[bytes] = []
    monkeypatch.setattr(digests_module, "evict_block", lambda block: evicted.append(bytes(block)))
    block = memoryview(bytes(range(256)) * 256)
    assert block_checksum(block) == xxhash.xxh3_64_intdigest(block)
    assert evicted == [bytes(block)]


@given(stores=st.lists(st.integers(0, 30), max_size=200), bound=st.integers(1, 10))
def test_a_bounded_memory_keeps_the_most_recent_stores(stores: list[int], bound: int) -> None:
    digests = StoredDigests(bound)
    for i in stores:
        digests.record([_key(i)], [memoryview(bytes([i]) * 8)])
    recent: list[int] = []
    for i in reversed(stores):
        if i not in recent:
            recent.append(i)
    kept = recent[:bound]
    assert len(digests) == len(kept)
    for i in kept:
        assert digests.get(_key(i)) == block_checksum(memoryview(bytes([i]) * 8))
    for i in recent[bound:]:
        assert digests.get(_key(i)) is None


def test_bound_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        StoredDigests(0)
