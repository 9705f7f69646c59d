"""Forged values in a real redis-server are never served (issue 16.1).

A forger with write access to the server replaces a block with a well-formed
value of its own (valid header, valid checksum of another payload). Through
the runtime, every later load of that key is a miss and the value is deleted;
with an auth key the tier itself rejects anything not tagged with the key.
"""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import dataclasses
import hmac
import logging
import os
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from tests.support.redis_server import (
    RedisClusterServers,
    RedisServer,
    redis_cluster,  # noqa: F401
    redis_server,  # noqa: F401
)
from tests.support.redis_tier import (
    BLOCK_BYTES as TIER_BLOCK_BYTES,
)
from tests.support.redis_tier import (
    FINGERPRINT as TIER_FINGERPRINT,
)
from tests.support.redis_tier import (
    collect_removed,
    new_blocks,
    new_keys,
    opened_tier,
    read_back,
    run_job,
    views,
)
from tiering.core.errors import BlockNotFound, ConfigError, PartialBatchError
from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.registry import create_secondary_tier
from tiering.runtime import AsyncTierManager
from tiering.spec import TieringOffloadingSpec
from tiering.tier.auth import BlockAuthenticator
from tiers.redis import RedisTier
from tiers.redis.deletes import delete_rejected
from tiers.redis.errors import RejectedValue
from tiers.redis.layout import AUTH_HEADER_LEN, BlockLayout
from tiers.redis.rejections import RejectionLog

pytestmark = pytest.mark.redis

BLOCK_BYTES = 8192
ROWS = 8
FINGERPRINT = "forgery-test/bf16/16"
WAIT_S = 20.0
SECRET = "forgery-test-secret-" + "q7Zr" * 8
OTHER_SECRET = "another-deployment-" + "x9Kp" * 8

Rows = npt.NDArray[np.uint8]


@pytest.fixture
def auth_env(monkeypatch: pytest.MonkeyPatch) -> str:
    monkeypatch.setenv("KVT_TEST_AUTH_KEY", SECRET)
    monkeypatch.setenv("KVT_TEST_OTHER_KEY", OTHER_SECRET)
    return "KVT_TEST_AUTH_KEY"


@contextmanager
def engine(config: dict[str, Any]) -> Iterator[tuple[AsyncTierManager, Rows]]:
    rows = np.zeros((ROWS, BLOCK_BYTES), dtype=np.uint8)
    manager = create_secondary_tier(
        {"job_timeout_s": 10, **config}, rows.data, position=0, layout_fingerprint=FINGERPRINT
    )
    try:
        yield manager, rows
    finally:
        manager.shutdown()


def forged_value(namespace: str, key: OffloadKey, payload: bytes) -> bytes:
    """A well-formed unauthenticated value: valid header and xxh3 of ``payload``."""
    return BlockLayout(namespace, FINGERPRINT, BLOCK_BYTES).encode(key, memoryview(payload))


# -- through the runtime: store, forge, load x3 ------------------------------------------------


@pytest.mark.parametrize("verify", [True, None], ids=["verify-true", "verify-default"])
@pytest.mark.parametrize("forge_every_load", [False, True], ids=["forge-once", "forge-each-load"])
def test_forged_value_is_never_served_and_is_deleted(
    redis_server: RedisServer, verify: bool | None, forge_every_load: bool
) -> None:
    namespace = "forge-" + os.urandom(4).hex()
    config: dict[str, Any] = {"type": "redis", "url": redis_server.url, "namespace": namespace}
    if verify is not None:
        config["verify"] = verify
    with engine(config) as (manager, rows), redis_server.client() as raw:
        (key,) = [make_offload_key(os.urandom(16), 0)]
        rows[0] = np.frombuffer(os.urandom(BLOCK_BYTES), dtype=np.uint8)
        assert run_job(manager, [key], [0], load=False).success
        name = manager.tier._require_layout().redis_key(key)  # type: ignore[attr-defined]
        forged_payload = os.urandom(BLOCK_BYTES)
        raw.set(name, forged_value(namespace, key, forged_payload))
        for attempt in range(3):
            if forge_every_load and attempt:
                raw.set(name, forged_value(namespace, key, forged_payload))
            rows[1] = 0
            result = run_job(manager, [key], [1], load=True)
            assert not result.success, f"load {attempt + 1} served a forged value"
            assert key not in result.successful_keys
            assert raw.exists(name) == 0, f"the forged value survived load {attempt + 1}"
        assert manager.stats().corrupt_reads >= 1
        # Our own store replaces the checksum and the value: loads work again.
        rows[2] = np.frombuffer(os.urandom(BLOCK_BYTES), dtype=np.uint8)
        assert run_job(manager, [key], [2], load=False).success
        result = run_job(manager, [key], [3], load=True)
        assert result.success and bytes(rows[3]) == bytes(rows[2])


def test_without_a_key_the_runtime_verifies_redis_by_default(redis_server: RedisServer) -> None:
    with engine({"type": "redis", "url": redis_server.url, "namespace": "dflt"}) as (manager, _):
        assert not manager.tier.verifies_reads


def test_another_engines_blocks_are_served_on_the_tiers_own_checks(
    redis_server: RedisServer,
) -> None:
    config = {"type": "redis", "url": redis_server.url, "namespace": "share-" + os.urandom(4).hex()}
    with engine(config) as (writer, writer_rows), engine(config) as (reader, reader_rows):
        key = make_offload_key(os.urandom(16), 0)
        writer_rows[0] = np.frombuffer(os.urandom(BLOCK_BYTES), dtype=np.uint8)
        assert run_job(writer, [key], [0], load=False).success
        assert run_job(reader, [key], [0], load=True).success
        assert bytes(reader_rows[0]) == bytes(writer_rows[0])


def test_with_an_auth_key_a_forged_value_is_a_miss_through_the_runtime(
    redis_server: RedisServer, auth_env: str
) -> None:
    namespace = "forge-auth-" + os.urandom(4).hex()
    config = {
        "type": "redis",
        "url": redis_server.url,
        "namespace": namespace,
        "auth_key_env": auth_env,
    }
    with engine(config) as (manager, rows), redis_server.client() as raw:
        assert manager.tier.verifies_reads  # the tag is authoritative: no runtime checksum
        key = make_offload_key(os.urandom(16), 0)
        rows[0] = np.frombuffer(os.urandom(BLOCK_BYTES), dtype=np.uint8)
        assert run_job(manager, [key], [0], load=False).success
        layout: BlockLayout = manager.tier._require_layout()  # type: ignore[attr-defined]
        name = layout.redis_key(key)
        forger = BlockLayout(
            namespace, FINGERPRINT, BLOCK_BYTES, BlockAuthenticator(b"f" * 32, "forger")
        )
        for _ in range(3):
            raw.set(name, forger.encode(key, memoryview(os.urandom(BLOCK_BYTES))))
            result = run_job(manager, [key], [1], load=True)
            assert not result.success
            assert raw.exists(name) == 0
        stats = manager.tier.stats  # type: ignore[attr-defined]
        assert stats.rejected_unauthenticated == 3 and stats.rejected_deleted == 3


# -- the tier's own checks with an auth key ----------------------------------------------------


async def test_authenticated_tiers_with_one_key_share_blocks(
    redis_server: RedisServer, auth_env: str
) -> None:
    async with (
        opened_tier(redis_server.url, namespace="auth-share", auth_key_env=auth_env) as a,
        opened_tier(redis_server.url, namespace="auth-share", auth_key_env=auth_env) as b,
    ):
        keys, blocks = new_keys(5), new_blocks(5)
        await a.write_many(keys, views(blocks))
        out = new_blocks(5)
        await b.read_many(keys, views(out))
        assert out == blocks
        with redis_server.client() as raw:
            value = raw.get(a._require_layout().redis_key(keys[0]))
        assert value is not None and len(value) == AUTH_HEADER_LEN + TIER_BLOCK_BYTES
        assert value[4] == 4 and value[AUTH_HEADER_LEN:] == blocks[0]  # ghash-aes


async def test_keys_and_unauthenticated_tiers_do_not_see_each_others_blocks(
    redis_server: RedisServer, auth_env: str
) -> None:
    url = redis_server.url
    async with (
        opened_tier(url, namespace="auth-iso", auth_key_env=auth_env) as keyed,
        opened_tier(url, namespace="auth-iso", auth_key_env="KVT_TEST_OTHER_KEY") as other_key,
        opened_tier(url, namespace="auth-iso") as plain,
    ):
        keys, blocks = new_keys(3), new_blocks(3)
        await keyed.write(keys[0], memoryview(blocks[0]))
        await plain.write(keys[1], memoryview(blocks[1]))
        await other_key.write(keys[2], memoryview(blocks[2]))
        assert await keyed.contains_many(keys) == [True, False, False]
        assert await plain.contains_many(keys) == [False, True, False]
        assert await other_key.contains_many(keys) == [False, False, True]
        for tier in (plain, other_key):
            with pytest.raises(BlockNotFound):
                await read_back(tier, keys[0])
        with pytest.raises(BlockNotFound):
            await read_back(keyed, keys[1])
        assert keyed.stats.corrupt_blocks == 0, "nobody deletes another deployment's blocks"


def _replace(value: bytes, offset: int, data: bytes) -> bytes:
    return value[:offset] + data + value[offset + len(data) :]


@pytest.mark.parametrize(
    ("forgery", "kind"),
    [
        ("unkeyed-v1-under-v2-name", "malformed"),
        ("tag-of-another-key", "unauthenticated"),
        ("payload-changed", "unauthenticated"),
        ("copy-of-another-block", "foreign"),
        ("copy-with-patched-key-hash", "unauthenticated"),
        ("hash-value", "wrong_type"),
    ],
)
async def test_forgeries_are_rejected_counted_reported_and_deleted(
    redis_server: RedisServer, auth_env: str, forgery: str, kind: str
) -> None:
    namespace = "auth-forge-" + os.urandom(4).hex()
    async with opened_tier(redis_server.url, namespace=namespace, auth_key_env=auth_env) as tier:
        removed = collect_removed(tier)
        keys, blocks = new_keys(3), new_blocks(3)
        await tier.write_many(keys, views(blocks))
        layout = tier._require_layout()
        target = layout.redis_key(keys[1])
        with redis_server.client() as raw:
            good = raw.get(target)
            neighbour = raw.get(layout.redis_key(keys[0]))
            assert good is not None and neighbour is not None
            other = os.urandom(TIER_BLOCK_BYTES)
            if forgery == "unkeyed-v1-under-v2-name":
                plain = BlockLayout(namespace, TIER_FINGERPRINT, TIER_BLOCK_BYTES)
                raw.set(target, plain.encode(keys[1], memoryview(other)))
            elif forgery == "tag-of-another-key":
                forger = BlockLayout(
                    namespace,
                    TIER_FINGERPRINT,
                    TIER_BLOCK_BYTES,
                    BlockAuthenticator(b"z" * 32, "forger"),
                )
                raw.set(target, forger.encode(keys[1], memoryview(other)))
            elif forgery == "payload-changed":
                raw.set(target, good[:AUTH_HEADER_LEN] + other)
            elif forgery == "copy-of-another-block":
                raw.set(target, neighbour)
            elif forgery == "copy-with-patched-key-hash":
                raw.set(target, _replace(neighbour, 16, good[16:24]))
            else:
                raw.delete(target)
                raw.hset(target, "a", "b")
        out = [bytearray(TIER_BLOCK_BYTES) for _ in range(3)]
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(out))
        error = caught.value.errors[keys[1]]
        assert set(caught.value.errors) == {keys[1]}
        assert isinstance(error, RejectedValue) and error.kind == kind
        assert out[1] == bytes(TIER_BLOCK_BYTES), "forged bytes must never reach the row"
        assert out[0] == blocks[0] and out[2] == blocks[2]
        assert getattr(tier.stats, f"rejected_{kind}") == 1
        assert tier.stats.corrupt_blocks == 1 and tier.stats.rejected_deleted == 1
        assert removed == [keys[1]]
        with redis_server.client() as raw:
            assert raw.exists(target) == 0


async def test_a_value_rewritten_after_the_read_is_not_deleted(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url) as tier:
        (key,), (block,) = new_keys(1), new_blocks(1)
        await tier.write(key, memoryview(block))
        name = tier._require_layout().redis_key(key)
        with redis_server.client() as raw:
            good = raw.get(name)
            assert good is not None
            raw.set(name, good[:-1])
            with pytest.raises(RejectedValue) as caught:
                await read_back(tier, key)
            assert raw.exists(name) == 0
            # Same failure, but a valid block landed between the read and the delete.
            raw.set(name, good[:-1])
            rejected = RejectedValue(key, "malformed", "test")
            rejected.value_sha1 = caught.value.value_sha1
            raw.set(name, good)
            await delete_rejected(
                tier._round_trips, tier._require_layout(), [rejected], tier.stats, None
            )
            assert raw.get(name) == good
        assert await read_back(tier, key) == block
        assert tier.stats.rejected_deleted == 1


async def test_cluster_forged_value_is_deleted_on_its_node(
    redis_cluster: RedisClusterServers, auth_env: str
) -> None:
    async with opened_tier(redis_cluster.url, cluster=True, auth_key_env=auth_env) as tier:
        keys, blocks = new_keys(6), new_blocks(6)
        await tier.write_many(keys, views(blocks))
        names = [tier._require_layout().redis_key(k) for k in keys]
        with redis_cluster.client() as raw:
            for name in names[:3]:
                value = raw.get(name)
                assert value is not None
                raw.set(name, value[:AUTH_HEADER_LEN] + os.urandom(TIER_BLOCK_BYTES))
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(new_blocks(6)))
        assert set(caught.value.errors) == set(keys[:3])
        assert tier.stats.rejected_unauthenticated == 3 and tier.stats.rejected_deleted == 3
        with redis_cluster.client() as raw:
            assert [raw.exists(name) for name in names] == [0, 0, 0, 1, 1, 1]


# -- the key stays secret; options are checked when the tier is built --------------------------


async def test_the_key_never_appears_in_repr_logs_or_errors(
    redis_server: RedisServer, auth_env: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    async with opened_tier(redis_server.url, namespace="secret", auth_key_env=auth_env) as tier:
        (key,), (block,) = new_keys(1), new_blocks(1)
        await tier.write(key, memoryview(block))
        with redis_server.client() as raw:
            raw.set(tier._require_layout().redis_key(key), b"junk")
        with pytest.raises(RejectedValue) as caught:
            await read_back(tier, key)
        texts = [
            repr(tier.config),
            str(dataclasses.asdict(tier.config)),
            repr(tier.config.authenticator()),
            str(caught.value),
            caplog.text,
        ]
    assert "rejected a stored value" in caplog.text
    for text in texts:
        assert SECRET not in text and SECRET.encode().hex() not in text


def _tier_config(**extra: Any) -> dict[str, Any]:
    return {"type": "redis", "url": "redis://127.0.0.1:1/0", **extra}


def test_bad_auth_options_fail_construction_naming_the_option(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = np.zeros((2, BLOCK_BYTES), dtype=np.uint8)
    monkeypatch.delenv("KVT_TEST_UNSET_KEY", raising=False)
    monkeypatch.setenv("KVT_TEST_SHORT_KEY", "short")
    open_key = tmp_path / "open.key"
    open_key.write_text(SECRET)
    open_key.chmod(0o644)
    cases = [
        (_tier_config(auth_key_env="KVT_TEST_UNSET_KEY"), "auth_key_env"),
        (_tier_config(auth_key_env="KVT_TEST_SHORT_KEY"), "at least 16"),
        (_tier_config(auth_key_file=str(tmp_path / "missing.key")), "auth_key_file"),
        (_tier_config(auth_key_file=str(open_key)), "chmod 600"),
        (_tier_config(auth_key_file=str(open_key), auth_key_env="X"), "one of auth_key_file"),
        (_tier_config(auth_key_env=5), "auth_key_env"),
    ]
    for config, expected in cases:
        with pytest.raises(ConfigError, match=r"secondary_tiers\[0\]") as caught:
            create_secondary_tier(config, rows.data, position=0)
        assert expected in str(caught.value), str(caught.value)
        assert SECRET not in str(caught.value)


def test_a_key_file_works(tmp_path: Path) -> None:
    key_file = tmp_path / "redis.key"
    key_file.write_text(SECRET + "\n")
    key_file.chmod(0o600)
    tier = RedisTier(auth_key_file=str(key_file))
    assert tier.verifies_reads
    assert str(key_file) in repr(tier.config.authenticator())


# -- the rejection log -------------------------------------------------------------------------


def test_rejections_are_logged_once_per_reason_per_interval(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    log = RejectionLog(logging.getLogger("test.rejections"), "tier", 60.0, clock=lambda: now[0])
    key = make_offload_key(b"k" * 16, 0)
    with caplog.at_level(logging.WARNING, logger="test.rejections"):
        for _ in range(5):
            log.note(RejectedValue(key, "unauthenticated", "tag mismatch"))
        log.note(RejectedValue(key, "checksum", "checksum mismatch"))
        assert len(caplog.records) == 2
        now[0] = 61.0
        log.note(RejectedValue(key, "unauthenticated", "tag mismatch"))
    assert len(caplog.records) == 3
    assert "4 more since the last such line" in caplog.records[-1].getMessage()


@pytest.mark.parametrize(
    ("mac", "version", "flags"),
    [("ghash-aes", 4, 0x05), ("blake3", 3, 0x03), ("hmac-sha256", 2, 0x01)],
)
def test_header_layout_of_authenticated_values(mac: str, version: int, flags: int) -> None:
    """ghash-aes (the default) is format 4; keyed BLAKE3 format 3 and HMAC-SHA256 format
    2, byte for byte what earlier releases wrote under the same key names, so engines of
    this release with that ``auth_mac`` share blocks with them."""
    authenticator = BlockAuthenticator(SECRET.encode(), "test", mac)
    layout = BlockLayout("ns", FINGERPRINT, BLOCK_BYTES, authenticator)
    key = make_offload_key(b"k" * 16, 0)
    payload = os.urandom(BLOCK_BYTES)
    value = layout.encode(key, memoryview(payload))
    fields = struct.unpack_from("<4sBBH", value)
    assert fields == (b"KVTB", version, flags, AUTH_HEADER_LEN)
    identity = b"%s\0%d" % (FINGERPRINT.encode(), BLOCK_BYTES)
    assert value[AUTH_HEADER_LEN - 16 : AUTH_HEADER_LEN] == authenticator.tag(
        key, identity, payload
    )
    assert layout.redis_key(key).startswith(b"ns:v%d:" % version)
    assert SECRET.encode() not in layout.redis_key(key)
    if mac == "hmac-sha256":  # the earlier release's construction, spelled out
        prefix = struct.pack("<HI", len(key), len(identity))
        mac_ = hmac.new(SECRET.encode(), prefix + key + identity + payload, "sha256")
        assert value[AUTH_HEADER_LEN - 16 : AUTH_HEADER_LEN] == mac_.digest()[:16]
        key_id = hmac.new(
            SECRET.encode(), struct.pack("<HI", 0, 23) + b"kv-tiering redis key id", "sha256"
        )
        assert layout.redis_key(key).startswith(
            b"ns:v2:%016x:%s:" % (layout.fingerprint, key_id.hexdigest()[:8].encode())
        )


async def test_a_value_that_cannot_be_deleted_is_still_a_miss_and_logged_once(
    redis_server: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    user = "no-eval-" + os.urandom(4).hex()
    namespace = "acl-" + os.urandom(4).hex()
    with redis_server.client() as raw:
        raw.execute_command(
            "ACL", "SETUSER", user, "on", ">pw-" + user, f"~{namespace}:*", "+@all", "-eval"
        )
    url = redis_server.url.replace("redis://", f"redis://{user}:pw-{user}@")
    caplog.set_level(logging.WARNING, logger="tiers.redis.tier")
    async with opened_tier(url, namespace=namespace) as tier:
        keys, blocks = new_keys(3), new_blocks(3)
        await tier.write_many(keys, views(blocks))
        with redis_server.client() as raw:
            for key in keys:
                raw.set(tier._require_layout().redis_key(key), b"junk")
        for key in keys:
            with pytest.raises(RejectedValue):
                await read_back(tier, key)
        assert tier.stats.rejected_malformed == 3 and tier.stats.rejected_deleted == 0
    lines = [r.getMessage() for r in caplog.records if "could not delete" in r.getMessage()]
    assert len(lines) == 1, lines
    assert f"pw-{user}" not in caplog.text, "the password is masked"


async def test_a_delete_after_a_load_removes_only_the_value_that_load_served(
    redis_server: RedisServer,
) -> None:
    async with opened_tier(redis_server.url) as tier:
        (key,), (block, newer) = new_keys(1), new_blocks(2)
        await tier.write(key, memoryview(block))
        assert await read_back(tier, key) == block
        # Another engine rewrites the key after our load: the runtime's delete of
        # what it loaded (a checksum mismatch) must not remove the newer block.
        async with opened_tier(redis_server.url, namespace=tier.config.namespace) as other:
            await other.write(key, memoryview(newer))
        await tier.delete(key)
        assert await read_back(tier, key) == newer
        # The value it served this time is the one deleted.
        await tier.delete(key)
        assert not await tier.contains(key)
        # Without a recent load, delete is unconditional.
        await tier.write(key, memoryview(block))
        await tier.delete(key)
        assert not await tier.contains(key)


def test_a_forgery_after_the_presence_answer_aged_out_is_still_caught(
    redis_server: RedisServer,
) -> None:
    namespace = "forge-aged-" + os.urandom(4).hex()
    config = {
        "type": "redis",
        "url": redis_server.url,
        "namespace": namespace,
        "shared_present_ttl_s": 0.05,
        "shared_absent_ttl_s": 0.05,
    }
    with engine(config) as (manager, rows), redis_server.client() as raw:
        key = make_offload_key(os.urandom(16), 0)
        rows[0] = np.frombuffer(os.urandom(BLOCK_BYTES), dtype=np.uint8)
        assert run_job(manager, [key], [0], load=False).success
        # Wait until the runtime has forgotten that the key is present (it asks again).
        deadline = time.monotonic() + WAIT_S
        while manager.lookup(key, NO_CONTEXT) is not None:
            assert time.monotonic() < deadline, "the present answer never aged out"
            time.sleep(0.02)
        name = manager.tier._require_layout().redis_key(key)  # type: ignore[attr-defined]
        raw.set(name, forged_value(namespace, key, os.urandom(BLOCK_BYTES)))
        while (answer := manager.lookup(key, NO_CONTEXT)) is None:
            assert time.monotonic() < deadline, "lookup never resolved"
            time.sleep(0.005)
        assert answer, "the forged value is present in Redis"
        result = run_job(manager, [key], [1], load=True)
        assert not result.success, "a forged value was served after the presence answer aged"
        assert raw.exists(name) == 0


def test_auth_options_are_checked_when_the_spec_is_constructed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("KVT_TEST_UNSET_KEY", raising=False)
    extra = {
        "cpu_bytes_to_use": 1 << 20,
        "secondary_tiers": [
            {"type": "redis", "url": "redis://127.0.0.1:1/0", "auth_key_env": "KVT_TEST_UNSET_KEY"}
        ],
    }
    with pytest.raises(ConfigError, match=r"secondary_tiers\[0\].*auth_key_env"):
        TieringOffloadingSpec(extra, block_bytes=BLOCK_BYTES)


async def test_a_delete_after_our_own_rewrite_removes_the_new_value(
    redis_server: RedisServer,
) -> None:
    async with opened_tier(redis_server.url) as tier:
        (key,), (block, newer) = new_keys(1), new_blocks(2)
        await tier.write(key, memoryview(block))
        assert await read_back(tier, key) == block
        await tier.write(key, memoryview(newer))
        await tier.delete(key)
        assert not await tier.contains(key)
