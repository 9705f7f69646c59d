"""Authenticated blocks on the fs tier (``auth_key_file`` / ``auth_key_env``).

A writer without the key - another engine on a shared root, anyone who can write
the files - can rewrite slab bytes and journal records with valid xxh3 checksums;
with a key, such a block is a miss (CorruptBlock), counted, logged once, and
deleted from the index (a DEL record), so it is not found again after a restart.
"""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import xxhash

from tests.runtime_support import fill, load, one_result, primary, store
from tests.runtime_support import key as rkey
from tiering.core.errors import ConfigError, CorruptBlock
from tiering.core.keys import OffloadKey
from tiering.registry import tier_options
from tiering.runtime import AsyncTierManager
from tiering.tier.auth import BlockAuthenticator
from tiers.fs import FileSystemTier
from tiers.fs.files import RootDir
from tiers.fs.index import CHECKSUM, SLOT, TAG
from tiers.fs.journal_file import write_snapshot
from tiers.fs.layout import read_header
from tiers.fs.records import stored_tag, tag_mac

from .fs_support import (
    BLOCK,
    block_data,
    key,
    opened,
    overwrite,
    read_key,
    slot_location,
    write_keys,
)

pytestmark = pytest.mark.timeout(120)

KEY_ENV = "KV_TIERING_TEST_FS_KEY"


@pytest.fixture
def auth(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv(KEY_ENV, "k" * 32)
    return {"auth_key_env": KEY_ENV}


#: Forged tags of either MAC: the record type names it; neither helps a forger.
MACS = ("blake3", "hmac-sha256")


def _forge(
    root: Path,
    victims: dict[OffloadKey, tuple[int, bytes]],
    keep: dict[OffloadKey, tuple[int, int, bytes | None]],
) -> None:
    """What a writer without the key can do: new bytes in the slots and a journal whose
    records checksum correctly (the cache id is in header.json), with no tag or a made-up one."""
    directory = RootDir.open(root)
    try:
        header = read_header(directory)
        assert header is not None
        entries = [(bytes(k), entry) for k, entry in keep.items()]
        for k, (slot, payload) in victims.items():
            tag = None if slot % 2 else stored_tag(MACS[slot % 4 // 2], os.urandom(16))
            entries.append((bytes(k), (slot, xxhash.xxh3_128_intdigest(payload), tag)))
        write_snapshot(directory, header, entries)
    finally:
        directory.close()


async def test_blocks_round_trip_and_survive_a_restart_with_the_key(
    tmp_path: Path, auth: dict[str, str]
) -> None:
    keys = [key(i) for i in range(6)]
    async with opened(tmp_path, **auth) as tier:
        await write_keys(tier, keys)
        assert all(tier._state().index.get(k)[TAG] for k in keys)  # type: ignore[index]
        assert await read_key(tier, keys[0]) == block_data(keys[0])
    async with opened(tmp_path, **auth) as tier:
        for k in keys:
            assert await read_key(tier, k) == block_data(k)
        assert tier.stats.auth_failures == 0


async def test_forged_blocks_are_misses_counted_logged_once_and_deleted(
    tmp_path: Path, auth: dict[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    honest, forged = [key(i) for i in range(4)], [key(10 + i) for i in range(4)]
    async with opened(tmp_path, **auth) as tier:
        await write_keys(tier, honest + forged)
        index = tier._state().index
        keep = {k: e for k in honest if (e := index.get(k))}
        victims = {}
        for k in forged:
            path, offset = slot_location(tier, k)
            payload = os.urandom(BLOCK)
            victims[k] = (index.get(k)[SLOT], payload)  # type: ignore[index]
            overwrite(path, offset, payload)
    _forge(tmp_path, victims, keep)
    async with opened(tmp_path, **auth) as tier:
        with caplog.at_level(logging.WARNING):
            for k in forged:
                with pytest.raises(CorruptBlock, match="authentication"):
                    await read_key(tier, k)
        assert tier.stats.auth_failures == len(forged)
        lines = [r for r in caplog.records if "authentication" in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.ERROR
        assert "k" * 32 not in caplog.text  # the key never appears
        present = set(await tier.list_keys())
        assert present == set(honest)
        for k in honest:
            assert await read_key(tier, k) == block_data(k)
    async with opened(tmp_path, **auth) as tier:  # the deletions were journaled
        assert set(await tier.list_keys()) == set(honest)


async def test_a_block_moved_to_another_key_fails_its_tag(
    tmp_path: Path, auth: dict[str, str]
) -> None:
    """A valid (bytes, tag) pair replayed under another offload key is refused."""
    a, b = key(1), key(2)
    async with opened(tmp_path, **auth) as tier:
        await write_keys(tier, [a, b])
        index = tier._state().index
        ea, eb = index.get(a), index.get(b)
        assert ea is not None and eb is not None
    directory = RootDir.open(tmp_path)
    try:
        header = read_header(directory)
        assert header is not None
        write_snapshot(directory, header, [(bytes(b), ea)])
    finally:
        directory.close()
    async with opened(tmp_path, **auth) as tier:
        with pytest.raises(CorruptBlock, match="authentication tag mismatch"):
            await read_key(tier, b)


async def test_blocks_stored_without_a_key_or_with_another_key_are_misses(
    tmp_path: Path, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    async with opened(tmp_path) as tier:
        await write_keys(tier, [key(1)])
    async with opened(tmp_path, **auth) as tier:
        with pytest.raises(CorruptBlock, match="without an authentication tag"):
            await read_key(tier, key(1))
        await write_keys(tier, [key(2)])
    monkeypatch.setenv(KEY_ENV, "z" * 32)
    async with opened(tmp_path, **auth) as tier:
        with pytest.raises(CorruptBlock, match="tag mismatch"):
            await read_key(tier, key(2))
        assert tier.stats.auth_failures == 1


async def test_a_tier_without_a_key_still_reads_tagged_blocks(
    tmp_path: Path, auth: dict[str, str]
) -> None:
    async with opened(tmp_path, **auth) as tier:
        await write_keys(tier, [key(1)])
    async with opened(tmp_path) as tier:
        assert await read_key(tier, key(1)) == block_data(key(1))


def test_key_options_are_checked_at_construction_and_never_echo_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert {"auth_key_file", "auth_key_env"} <= set(tier_options(FileSystemTier)[0])
    with pytest.raises(ConfigError, match="fs tier: auth_key_env names 'NOT_SET_ANYWHERE'"):
        FileSystemTier(
            root_dir=tmp_path / "cache", capacity_bytes="1MiB", auth_key_env="NOT_SET_ANYWHERE"
        )
    monkeypatch.setenv(KEY_ENV, "short-secret")
    with pytest.raises(ConfigError, match="at least 16") as info:
        FileSystemTier(root_dir=tmp_path / "cache", capacity_bytes="1MiB", auth_key_env=KEY_ENV)
    assert "short-secret" not in str(info.value)
    key_file = tmp_path / "key"
    key_file.write_text("s" * 32)
    key_file.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        FileSystemTier(
            root_dir=tmp_path / "cache", capacity_bytes="1MiB", auth_key_file=str(key_file)
        )
    key_file.chmod(0o600)
    tier = FileSystemTier(
        root_dir=tmp_path / "cache", capacity_bytes="1MiB", auth_key_file=str(key_file)
    )
    assert "s" * 32 not in repr(tier.config)


def test_tags_are_computed_and_checked_on_the_tier_thread_not_the_scheduler(
    tmp_path: Path, auth: dict[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    threads: list[threading.Thread] = []
    real_tag = BlockAuthenticator.tag

    def tag(self: BlockAuthenticator, *args: Any) -> bytes:
        threads.append(threading.current_thread())
        return real_tag(self, *args)

    monkeypatch.setattr(BlockAuthenticator, "tag", tag)
    rows = primary(8, BLOCK)
    data = {i: fill(rows, i) for i in range(4)}
    tier = FileSystemTier(root_dir=tmp_path, capacity_bytes=16 * BLOCK, **auth)  # type: ignore[arg-type]
    with AsyncTierManager(tier, memoryview(rows.data), "fs", layout_fingerprint="fp") as m:
        m.submit_store(store(1, [rkey(i) for i in range(4)], list(range(4))))
        assert one_result(m).success
        rows[:] = 0
        m.submit_load(load(2, [rkey(i) for i in range(4)], list(range(4, 8))))
        assert one_result(m).success
        for i in range(4):
            assert rows[4 + i].tobytes() == data[i]
    assert len(threads) == 8  # four tags on store, four checks on load
    assert threading.main_thread() not in threads


async def test_blocks_tagged_with_hmac_by_an_earlier_release_still_read(
    tmp_path: Path, auth: dict[str, str]
) -> None:
    """Releases before keyed BLAKE3 wrote HMAC-SHA256 tags (record type 3, what
    ``auth_mac: "hmac-sha256"`` writes today): a tier writing the default MAC reads them,
    writes its own, and after a restart reads both, each checked with the MAC it was stored
    with."""
    old, new = [key(i) for i in range(4)], [key(20 + i) for i in range(3)]
    async with opened(tmp_path, **auth, auth_mac="hmac-sha256") as tier:
        await write_keys(tier, old)
    async with opened(tmp_path, **auth) as tier:
        for k in old:
            assert await read_key(tier, k) == block_data(k)
        await write_keys(tier, new)
        index = tier._state().index
        macs = {k: tag_mac(index.get(k)[TAG])[0] for k in old + new}  # type: ignore[index, arg-type]
        assert macs == {**dict.fromkeys(old, "hmac-sha256"), **dict.fromkeys(new, "ghash-aes")}
    async with opened(tmp_path, **auth) as tier:
        for k in old + new:
            assert await read_key(tier, k) == block_data(k)
        assert tier.stats.auth_failures == 0


async def test_blocks_tagged_with_blake3_by_the_previous_release_still_read(
    tmp_path: Path, auth: dict[str, str]
) -> None:
    """The previous release's default was keyed BLAKE3 (record type 4, what ``auth_mac:
    "blake3"`` writes today): a root it filled serves every block under ``ghash-aes``, the
    new blocks get ``ghash-aes`` tags, and a restart reads both."""
    old, new = [key(i) for i in range(4)], [key(20 + i) for i in range(3)]
    async with opened(tmp_path, **auth, auth_mac="blake3") as tier:
        await write_keys(tier, old)
    for _ in range(2):  # before and after a restart
        async with opened(tmp_path, **auth, auth_mac="ghash-aes") as tier:
            for k in old:
                assert await read_key(tier, k) == block_data(k)
            await write_keys(tier, new)
            index = tier._state().index
            macs = {k: tag_mac(index.get(k)[TAG])[0] for k in old + new}  # type: ignore[index, arg-type]
            assert macs == {**dict.fromkeys(old, "blake3"), **dict.fromkeys(new, "ghash-aes")}
            assert tier.stats.auth_failures == 0


async def test_a_tag_checked_with_the_other_mac_fails(tmp_path: Path, auth: dict[str, str]) -> None:
    """The record type binds a tag to its MAC: relabelling HMAC tags as BLAKE3 ones (or the
    reverse) makes every block a miss."""
    keys = [key(i) for i in range(2)]
    async with opened(tmp_path, **auth) as tier:
        await write_keys(tier, keys)
        index = tier._state().index
        relabelled = {}
        for k in keys:
            entry = index.get(k)
            assert entry is not None and entry[TAG] is not None
            tag = stored_tag("hmac-sha256", entry[TAG][1:])
            relabelled[k] = (entry[SLOT], entry[CHECKSUM], tag)
    directory = RootDir.open(tmp_path)
    try:
        header = read_header(directory)
        assert header is not None
        write_snapshot(directory, header, [(bytes(k), v) for k, v in relabelled.items()])
    finally:
        directory.close()
    async with opened(tmp_path, **auth) as tier:
        for k in keys:
            with pytest.raises(CorruptBlock, match=r"tag mismatch \(hmac-sha256\)"):
                await read_key(tier, k)


def test_auth_mac_is_checked(tmp_path: Path, auth: dict[str, str]) -> None:
    with pytest.raises(
        ConfigError, match="auth_mac must be one of 'ghash-aes', 'blake3', 'hmac-sha256'"
    ):
        FileSystemTier(root_dir=tmp_path, auth_mac="md5", **auth)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="auth_mac needs a key"):
        FileSystemTier(root_dir=tmp_path, auth_mac="blake3")
