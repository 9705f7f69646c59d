"""The on-disk format: journal records, replay with torn tails, header, geometry (pure code)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tiering.tier.auth import MAC_NAMES
from tiers.fs import records
from tiers.fs.layout import ALIGNMENT, Geometry, Header, parse_slab_name, slab_name
from tiers.fs.records import (
    HEADER_BYTES,
    PUT_MAC_TYPE,
    SYNC_MARKER,
    decode_header,
    encode_del,
    encode_header,
    encode_put,
    encode_put_tagged,
    iter_records,
    replay,
    stored_tag,
    tag_mac,
)

SEED = 0x1234_5678_9ABC_DEF0
keys = st.binary(min_size=1, max_size=40)
#: A record: ("put", [(key, slot, checksum)...]) or ("del", [key...]).
Batch = tuple[str, list[Any]]
records_strategy = st.lists(
    st.one_of(
        st.tuples(
            st.just("put"),
            st.lists(st.tuples(keys, st.integers(0, 15), st.integers(0, 2**128 - 1)), min_size=1),
        ),
        st.tuples(st.just("del"), st.lists(keys, min_size=1, max_size=4)),
    ),
    max_size=20,
)


def encode(batches: list[Batch]) -> list[bytes]:
    return [
        encode_put(entries, SEED) if kind == "put" else encode_del(entries, SEED)
        for kind, entries in batches
    ]


def model(batches: list[Batch]) -> dict[bytes, tuple[int, int, bytes | None]]:
    """What the index must be: later entries win, a reused slot drops its previous key."""
    state: dict[bytes, tuple[int, int]] = {}
    for kind, entries in batches:
        for entry in entries:
            k = entry[0] if kind == "put" else entry
            state.pop(k, None)
            if kind == "put":
                _, slot, digest = entry
                for other in [o for o, (s, _, _) in state.items() if s == slot]:
                    del state[other]
                state[k] = (slot, digest, None)
    return state


@given(records_strategy)
def test_replay_applies_records_in_order(batches: list[Batch]) -> None:
    result = replay(b"".join(encode(batches)), SEED)
    assert result.entries == model(batches)
    assert result.records == len(batches)


@given(records_strategy, st.data())
def test_a_torn_tail_replays_exactly_the_complete_records(
    batches: list[Batch],
    data: st.DataObject,
) -> None:
    records = encode(batches)
    blob = b"".join(records)
    cut = data.draw(st.integers(0, len(blob)))
    result = replay(blob[:cut], SEED)
    complete, end = 0, 0
    for record in records:
        if end + len(record) > cut:
            break
        end += len(record)
        complete += 1
    assert result.records == complete
    assert result.valid_bytes == end
    assert result.entries == model(batches[:complete])


@given(records_strategy, st.data())
def test_a_damaged_record_costs_only_itself(
    batches: list[Batch],
    data: st.DataObject,
) -> None:
    records = encode(batches)
    if not records:
        return
    victim = data.draw(st.integers(0, len(records) - 1))
    start = sum(len(r) for r in records[:victim])
    position = start + data.draw(st.integers(0, len(records[victim]) - 1))
    blob = bytearray(b"".join(records))
    blob[position] ^= 1 << data.draw(st.integers(0, 7))
    result = replay(bytes(blob), SEED)
    # Replay resynchronises on the next record: as if the damaged one had never been written.
    assert result.records == len(records) - 1
    assert result.entries == model(batches[:victim] + batches[victim + 1 :])
    assert result.skipped[0][0] == start


@given(records_strategy, st.data())
def test_garbage_between_records_is_skipped(batches: list[Batch], data: st.DataObject) -> None:
    records = encode(batches)
    where = data.draw(st.integers(0, len(records)))
    # Garbage that even contains sync markers and plausible lengths.
    garbage = data.draw(st.binary(max_size=64)) + SYNC_MARKER + data.draw(st.binary(max_size=16))
    blob = b"".join(records[:where]) + garbage + b"".join(records[where:])
    result = replay(blob, SEED)
    assert result.records == len(records)
    assert result.entries == model(batches)


@given(
    st.integers(1, 40),
    st.lists(st.tuples(st.integers(0, 2**64 - 1), st.integers(0, 2**128 - 1)), max_size=12),
    st.sampled_from([None, *MAC_NAMES]),
    st.data(),
)
def test_a_record_of_one_key_length_decodes_as_entry_by_entry(
    key_len: int, rows: list[tuple[int, int]], mac: str | None, data: st.DataObject
) -> None:
    """Records whose keys share a length (what the tier writes) take the one-call decoder;
    it must read exactly what the entry-by-entry decoder reads."""
    one_length = st.binary(min_size=key_len, max_size=key_len)
    keys_ = [data.draw(one_length) for _ in rows]
    if mac is None:
        blob = encode_put([(k, s, c) for k, (s, c) in zip(keys_, rows, strict=True)], SEED)
        kind, entry = records.PUT_TYPE, records._PUT_ENTRY
    else:
        tags = [stored_tag(mac, data.draw(st.binary(min_size=16, max_size=16))) for _ in rows]
        entries = [(k, s, c, t) for k, (s, c), t in zip(keys_, rows, tags, strict=True)]
        blob = encode_put_tagged(entries, SEED)
        kind, entry = records.MAC_RECORD_TYPES[mac], records._PUT_MAC_ENTRY
    body = memoryview(blob)[records._FRAME.size : -8]
    decoded = records._decode_body(body)
    tag_of = None if mac is None else bytes((kind,))
    assert decoded == records._decode_entries(body, len(rows), entry, tag_of)
    assert decoded is not None and [(k, s, c) for k, s, c, _ in decoded] == [
        (k, s, c) for k, (s, c) in zip(keys_, rows, strict=True)
    ]


@pytest.mark.parametrize("lengths", [(35, 34, 36), (36, 36, 35, 37), (2, 1)])
def test_keys_of_several_lengths_summing_like_one_length_still_decode(
    lengths: tuple[int, ...],
) -> None:
    """The body's size is that of ``count`` keys of the first key's length, but the keys differ:
    the first entry of another length is seen where it starts, and the record is read entry by
    entry."""
    entries = [(bytes([65 + i]) * n, i, 2**100 + i) for i, n in enumerate(lengths)]
    result = replay(encode_put(entries, SEED), SEED)
    assert result.entries == {k: (s, c, None) for k, s, c in entries}


def test_an_empty_put_record_is_a_valid_record() -> None:
    blob = encode_put([], SEED) + encode_put([(b"k", 1, 2)], SEED)
    assert [len(found) for found, _ in iter_records(blob, SEED)] == [0, 1]


@pytest.mark.parametrize("mac", MAC_NAMES)
def test_tagged_put_records_round_trip_with_the_mac_they_were_tagged_by(mac: str) -> None:
    tag = stored_tag(mac, bytes(range(16)))
    blob = encode_put_tagged([(b"k1", 3, 2**100 + 7, tag)], SEED) + encode_del([b"k2"], SEED)
    result = replay(blob, SEED)
    assert result.entries == {b"k1": (3, 2**100 + 7, tag)}
    assert tag_mac(result.entries[b"k1"][2] or b"") == (mac, bytes(range(16)))
    with pytest.raises(ValueError, match="tag"):
        encode_put_tagged([(b"k", 0, 0, b"short")], SEED)
    with pytest.raises(ValueError, match="one MAC"):
        other = stored_tag("blake3" if mac != "blake3" else "hmac-sha256", bytes(16))
        encode_put_tagged([(b"a", 0, 0, tag), (b"b", 1, 0, other)], SEED)


def test_every_mac_has_its_own_record_type() -> None:
    """A MAC the library offers that the journal cannot name would be unstorable."""
    from tiers.fs.records import MAC_OF_RECORD_TYPE, MAC_RECORD_TYPES

    assert set(MAC_RECORD_TYPES) == set(MAC_NAMES)
    assert len(MAC_OF_RECORD_TYPE) == len(MAC_RECORD_TYPES)
    with pytest.raises(ValueError, match="one MAC"):
        tag = stored_tag("ghash-aes", bytes(16))
        other = stored_tag("blake3", bytes(16))
        encode_put_tagged([(b"a", 0, 0, tag), (b"b", 1, 0, other)], SEED)


def test_a_journal_written_with_hmac_tags_reads_back_with_them() -> None:
    """Records of type 3 (what releases before keyed BLAKE3 wrote) are HMAC-SHA256 tags."""
    from tiers.fs.records import _PUT_MAC_ENTRY, _frame

    body = bytes((PUT_MAC_TYPE,)) + (1).to_bytes(4, "little")
    body += _PUT_MAC_ENTRY.pack(5, 9, 0, bytes(range(16)), 2) + b"kk"
    result = replay(_frame(body, SEED), SEED)
    assert tag_mac(result.entries[b"kk"][2] or b"") == ("hmac-sha256", bytes(range(16)))


def test_records_of_another_cache_never_validate() -> None:
    blob = encode_put([(b"key", 3, 99)], SEED) + encode_del([b"key"], SEED)
    assert list(iter_records(blob, SEED + 1)) == []
    assert [len(entries) for entries, _ in iter_records(blob, SEED)] == [1, 1]


def test_journal_header_checks_magic_checksum_and_cache() -> None:
    cache_id = os.urandom(16)
    header = encode_header(cache_id)
    assert len(header) == HEADER_BYTES
    assert decode_header(header, cache_id) is None
    assert decode_header(header, os.urandom(16)) == "journal belongs to another cache"
    damaged = bytearray(header)
    damaged[3] ^= 1
    assert decode_header(bytes(damaged), cache_id) == "journal header checksum mismatch"
    assert "short" in (decode_header(header[:10], cache_id) or "")


def test_oversized_keys_are_refused() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        encode_put([(bytes(5000), 0, 0)], SEED)
    with pytest.raises(ValueError, match="exceeds"):
        encode_del([bytes(5000)], SEED)


def test_header_round_trip_and_mismatch_reasons() -> None:
    geometry = Geometry.plan(block_bytes=65536, capacity_bytes=1 << 30, slab_bytes=1 << 28)
    header = Header.new(geometry, "llama/bf16")
    again = Header.from_json(header.to_json())
    assert again == header
    assert header.mismatch(65536, "llama/bf16") is None
    assert "block_bytes" in (header.mismatch(32768, "llama/bf16") or "")
    assert "fingerprint" in (header.mismatch(65536, "mistral/bf16") or "")
    with pytest.raises(ValueError):
        Header.from_json('{"format": "kv-tiering-fs"}')
    with pytest.raises(ValueError):
        Header.from_json("[1, 2]")


@given(
    block_bytes=st.integers(1, 3 << 20),
    capacity_bytes=st.integers(1, 1 << 34),
    slab_bytes=st.integers(1 << 22, 1 << 31),
)
def test_geometry_places_slots_inside_their_slab(
    block_bytes: int, capacity_bytes: int, slab_bytes: int
) -> None:
    g = Geometry.plan(block_bytes, capacity_bytes, slab_bytes)
    assert g.slot_bytes % ALIGNMENT == 0 and g.slot_bytes >= block_bytes
    assert g.capacity_slots * g.slot_bytes <= capacity_bytes
    total = sum(g.slab_size(i) for i in range(g.num_slabs))
    assert total == g.capacity_slots * g.slot_bytes
    for slot in {0, g.capacity_slots - 1, g.capacity_slots // 2}:
        if 0 <= slot < g.capacity_slots:
            assert g.offset_of(slot) + g.slot_bytes <= g.slab_size(g.slab_of(slot))
            assert g.offset_of(slot) % ALIGNMENT == 0


def test_slab_names_never_come_from_keys() -> None:
    assert slab_name(7) == "slab-000007.bin"
    assert parse_slab_name("slab-000007.bin") == 7
    for bad in ("slab-7.bin", "slab-../000.bin", "header.json", "slab-00000a.bin"):
        assert parse_slab_name(bad) is None


def test_a_torn_tail_is_told_apart_from_a_damaged_one() -> None:
    records = encode([("put", [(b"a", 1, 2)]), ("put", [(b"b", 2, 3)])])
    blob = b"".join(records)
    assert replay(blob, SEED).tail_torn
    assert replay(blob[:-3], SEED).tail_torn  # cut short
    assert replay(blob[:-3] + bytes(8192), SEED).tail_torn  # cut, then unwritten pages
    assert replay(blob + bytes(100), SEED).tail_torn
    flipped = bytearray(blob)
    flipped[-1] ^= 1  # the last record complete but failing its checksum
    assert not replay(bytes(flipped), SEED).tail_torn
    assert not replay(blob + b"garbage!", SEED).tail_torn


def test_a_snapshot_pauses_after_each_record_and_replays_to_its_entries() -> None:
    """A worker thread encoding a large index hands the GIL over between records."""
    from tiers.fs.journal_file import SNAPSHOT_RECORD_ENTRIES, encode_snapshot

    header = Header(4096, 4096, 64, "f", os.urandom(16).hex())
    tag = stored_tag("ghash-aes", bytes(range(16)))
    keys = [bytes([i]) * 36 for i in range(40)]
    values = [(i, 2**100 + i, tag if 10 <= i < 14 else None) for i in range(40)]
    pauses = []
    blob = encode_snapshot(header, keys, values, lambda: pauses.append(1))
    result = replay(memoryview(blob)[HEADER_BYTES:], header.journal_seed)
    assert result.entries == dict(zip(keys, values, strict=True))
    assert len(pauses) == result.records >= 40 // SNAPSHOT_RECORD_ENTRIES + 2
    with pytest.raises(ValueError, match="40 keys but 39 entries"):
        encode_snapshot(header, keys, values[:-1])


def test_a_compaction_snapshot_is_written_then_emptied(tmp_path: Path) -> None:
    """The worker thread frees the copy it encoded in turns (a million references at once
    would hold the GIL for about 10 ms), and the file replays to what the copy held."""
    from tiers.fs.files import RootDir
    from tiers.fs.journal_file import recover, write_snapshot_for_append

    header = Header(4096, 4096, 64, "f", os.urandom(16).hex())
    keys = [bytes([i]) * 36 for i in range(20)]
    values: list[tuple[int, int, bytes | None]] = [(i, 2**90 + i, None) for i in range(20)]
    expected = dict(zip(keys, values, strict=True))
    root = RootDir.open(tmp_path)
    try:
        fd, size = write_snapshot_for_append(root, header, (keys, values))
        os.close(fd)
        assert keys == [] and values == [] and size > HEADER_BYTES
        result, problems, appendable = recover(root, header)
    finally:
        root.close()
    assert result.entries == expected and not problems and appendable
