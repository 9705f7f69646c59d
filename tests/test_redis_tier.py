"""The Redis tier against a real redis-server: round trips, format checks, isolation, sharing."""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from tests.support.redis_server import RedisServer, redis_server, redis_server_factory  # noqa: F401
from tests.support.redis_tier import (
    BLOCK_BYTES,
    collect_removed,
    count_round_trips,
    new_blocks,
    new_keys,
    opened_tier,
    read_back,
    views,
)
from tiering.core.errors import BlockNotFound, CorruptBlock, PartialBatchError
from tiers.redis import HEADER_LEN

pytestmark = pytest.mark.redis


# -- round trips -------------------------------------------------------------------------------


async def test_round_trip_single_and_batched(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url) as tier:
        keys, blocks = new_keys(20), new_blocks(20)
        await tier.write(keys[0], memoryview(blocks[0]))
        await tier.write_many(keys[1:], views(blocks[1:]))
        assert await tier.contains(keys[0])
        assert await tier.contains_many([*keys, *new_keys(2)]) == [True] * 20 + [False, False]
        assert await read_back(tier, keys[0]) == blocks[0]
        out = new_blocks(19)
        await tier.read_many(keys[1:], views(out))
        assert out == blocks[1:]
        assert tier.stats.blocks_written == 20 and tier.stats.blocks_read == 20
        assert tier.stats.bytes_read == 20 * BLOCK_BYTES


async def test_stored_value_is_header_plus_block(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url, namespace="fmt") as tier:
        (key,), (block,) = new_keys(1), new_blocks(1)
        await tier.write(key, memoryview(block))
        with redis_server.client() as raw:
            names = raw.keys("fmt:*")
            assert names == [tier._require_layout().redis_key(key)]
            value = raw.get(names[0])
        assert value is not None and len(value) == HEADER_LEN + BLOCK_BYTES
        assert value[:4] == b"KVTB" and value[HEADER_LEN:] == block


async def test_overwrite_replaces_and_delete_removes(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url) as tier:
        (key,), (first, second) = new_keys(1), new_blocks(2)
        await tier.write(key, memoryview(first))
        await tier.write(key, memoryview(second))
        assert await read_back(tier, key) == second
        await tier.delete(key)
        await tier.delete(key)
        assert not await tier.contains(key)
        with pytest.raises(BlockNotFound):
            await read_back(tier, key)


async def test_a_job_is_one_round_trip(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url) as tier:
        trips = count_round_trips(tier)
        keys, blocks = new_keys(32), new_blocks(32)
        await tier.write_many(keys, views(blocks))
        await tier.contains_many(keys)
        await tier.read_many(keys, views(new_blocks(32)))
        assert trips == [32, 32, 32]


async def test_large_jobs_are_split_at_max_pipeline_bytes(redis_server: RedisServer) -> None:
    per_trip = 5
    limit = per_trip * (HEADER_LEN + BLOCK_BYTES)
    async with opened_tier(redis_server.url, max_pipeline_bytes=limit) as tier:
        trips = count_round_trips(tier)
        keys, blocks = new_keys(12), new_blocks(12)
        await tier.write_many(keys, views(blocks))
        out = new_blocks(12)
        await tier.read_many(keys, views(out))
        assert out == blocks
        assert trips == [5, 5, 2, 5, 5, 2]


async def test_partial_batch_names_what_failed(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url) as tier:
        keys, blocks = new_keys(4), new_blocks(4)
        await tier.write_many(keys[:3], views(blocks[:3]))
        out = new_blocks(4)
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(out))
        assert caught.value.succeeded == frozenset(keys[:3])
        assert isinstance(caught.value.errors[keys[3]], BlockNotFound)
        assert out[:3] == blocks[:3]


async def test_ttl_is_set_and_blocks_expire(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url, ttl_s=30) as tier:
        (key,), (block,) = new_keys(1), new_blocks(1)
        await tier.write(key, memoryview(block))
        name = tier._require_layout().redis_key(key)
        with redis_server.client() as raw:
            assert 0 < raw.pttl(name) <= 30_000
            raw.pexpire(name, 5_000)
            await read_back(tier, key)
            assert raw.pttl(name) > 25_000, "a read refreshes the TTL (GETEX PX)"
            raw.pexpire(name, 1)
        await asyncio.sleep(0.05)
        assert not await tier.contains(key)
        with pytest.raises(BlockNotFound):
            await read_back(tier, key)


async def test_touch_refreshes_lru_or_ttl(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url, ttl_s=30) as tier:
        keys, blocks = new_keys(2), new_blocks(2)
        await tier.write_many(keys, views(blocks))
        name = tier._require_layout().redis_key(keys[0])
        with redis_server.client() as raw:
            raw.pexpire(name, 2_000)
            await tier.touch([keys[0], *new_keys(1)])
            assert raw.pttl(name) > 25_000
    async with opened_tier(redis_server.url) as tier:
        keys, blocks = new_keys(1), new_blocks(1)
        await tier.write_many(keys, views(blocks))
        await tier.touch(keys)
        with redis_server.client() as raw:
            assert raw.object("idletime", tier._require_layout().redis_key(keys[0])) == 0


# -- corruption: a bad value is a counted miss, never served -----------------------------------


def _flip_payload_byte(value: bytes) -> bytes:
    return value[:HEADER_LEN] + bytes([value[HEADER_LEN] ^ 1]) + value[HEADER_LEN + 1 :]


def _flip_magic(value: bytes) -> bytes:
    return b"XXXX" + value[4:]


def _truncate(value: bytes) -> bytes:
    return value[:-1]


def _header_only(value: bytes) -> bytes:
    return value[:HEADER_LEN]


def _short(value: bytes) -> bytes:
    return b"hello"


CORRUPTIONS: dict[str, Callable[[bytes], bytes]] = {
    "checksum": _flip_payload_byte,
    "magic": _flip_magic,
    "truncated": _truncate,
    "header-only": _header_only,
    "short": _short,
}


@pytest.mark.parametrize("corruption", sorted(CORRUPTIONS))
async def test_corrupt_values_are_misses_counted_reported_and_dropped(
    redis_server: RedisServer, corruption: str
) -> None:
    async with opened_tier(redis_server.url) as tier:
        removed = collect_removed(tier)
        keys, blocks = new_keys(3), new_blocks(3)
        await tier.write_many(keys, views(blocks))
        name = tier._require_layout().redis_key(keys[1])
        with redis_server.client() as raw:
            good = raw.get(name)
            assert good is not None
            raw.set(name, CORRUPTIONS[corruption](good))
        out = [bytearray(b"\x00" * BLOCK_BYTES) for _ in range(3)]
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(out))
        assert set(caught.value.errors) == {keys[1]}
        assert isinstance(caught.value.errors[keys[1]], CorruptBlock)
        assert out[1] == b"\x00" * BLOCK_BYTES, "corrupt bytes must never reach the destination"
        assert out[0] == blocks[0] and out[2] == blocks[2]
        assert tier.stats.corrupt_blocks == 1
        assert removed == [keys[1]]
        with redis_server.client() as raw:
            assert raw.exists(name) == 0, "a corrupt value is deleted"


async def test_value_of_another_key_is_not_served(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url) as tier:
        keys, blocks = new_keys(2), new_blocks(2)
        await tier.write(keys[0], memoryview(blocks[0]))
        layout = tier._require_layout()
        with redis_server.client() as raw:
            raw.copy(layout.redis_key(keys[0]), layout.redis_key(keys[1]))
        assert await tier.contains(keys[1]), "same length: presence cannot tell"
        with pytest.raises(CorruptBlock, match="another key"):
            await read_back(tier, keys[1])
        assert await read_back(tier, keys[0]) == blocks[0]


async def test_non_string_value_at_the_key_is_corrupt(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url) as tier:
        (key,) = new_keys(1)
        with redis_server.client() as raw:
            raw.hset(tier._require_layout().redis_key(key), "f", "v")
        assert not await tier.contains(key)
        with pytest.raises(CorruptBlock, match="non-string"):
            await read_back(tier, key)
        assert tier.stats.corrupt_blocks == 1


async def test_value_written_under_another_fingerprint_is_not_served(
    redis_server: RedisServer,
) -> None:
    async with (
        opened_tier(redis_server.url, namespace="fp", fingerprint="model-a") as tier_a,
        opened_tier(redis_server.url, namespace="fp", fingerprint="model-b") as tier_b,
    ):
        (key,), (block,) = new_keys(1), new_blocks(1)
        await tier_a.write(key, memoryview(block))
        assert not await tier_b.contains(key), "fingerprints are isolated by key name"
        with redis_server.client() as raw:
            raw.copy(
                tier_a._require_layout().redis_key(key), tier_b._require_layout().redis_key(key)
            )
        with pytest.raises(CorruptBlock, match="fingerprint"):
            await read_back(tier_b, key)


# -- isolation ---------------------------------------------------------------------------------


async def test_namespaces_and_block_sizes_never_collide(redis_server: RedisServer) -> None:
    async with (
        opened_tier(redis_server.url, namespace="alpha") as alpha,
        opened_tier(redis_server.url, namespace="beta") as beta,
        opened_tier(redis_server.url, namespace="alpha", block_bytes=2 * BLOCK_BYTES) as wide,
    ):
        keys, blocks = new_keys(3), new_blocks(3)
        await alpha.write_many(keys, views(blocks))
        assert await beta.contains_many(keys) == [False] * 3
        assert await wide.contains_many(keys) == [False] * 3
        with pytest.raises(BlockNotFound):
            await read_back(beta, keys[0])
        other = new_blocks(1)[0]
        await beta.write(keys[0], memoryview(other))
        assert await read_back(alpha, keys[0]) == blocks[0]
        assert await read_back(beta, keys[0]) == other
        # The same namespace and fingerprint with another block size: its own keys, so
        # neither tier sees the other's blocks, nor drops them as corrupt.
        wide_block = bytearray(b"w" * 2 * BLOCK_BYTES)
        await wide.write(keys[1], memoryview(wide_block))
        wide_out = bytearray(2 * BLOCK_BYTES)
        await wide.read(keys[1], memoryview(wide_out))
        assert wide_out == wide_block
        assert await read_back(alpha, keys[1]) == blocks[1]
        assert await alpha.contains_many(keys) == [True] * 3
        assert alpha.stats.corrupt_blocks == 0 and wide.stats.corrupt_blocks == 0


# -- shared contents ---------------------------------------------------------------------------


async def test_two_engines_share_blocks(redis_server: RedisServer) -> None:
    async with (
        opened_tier(redis_server.url, namespace="shared") as engine_a,
        opened_tier(redis_server.url, namespace="shared") as engine_b,
    ):
        keys, blocks = new_keys(8), new_blocks(8)
        await engine_a.write_many(keys, views(blocks))
        assert await engine_b.contains_many(keys) == [True] * 8
        out = new_blocks(8)
        await engine_b.read_many(keys, views(out))
        assert out == blocks


async def test_keys_deleted_by_another_client_are_clean_misses(redis_server: RedisServer) -> None:
    async with opened_tier(redis_server.url) as tier:
        removed = collect_removed(tier)
        keys, blocks = new_keys(4), new_blocks(4)
        await tier.write_many(keys, views(blocks))
        layout = tier._require_layout()
        with redis_server.client() as raw:
            raw.delete(layout.redis_key(keys[0]), layout.redis_key(keys[2]))
        assert await tier.contains_many(keys) == [False, True, False, True]
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(new_blocks(4)))
        assert caught.value.succeeded == {keys[1], keys[3]}
        assert all(isinstance(e, BlockNotFound) for e in caught.value.errors.values())
        assert sorted(removed) == sorted([keys[0], keys[2]])
        assert tier.stats.vanished_blocks == 2 and tier.stats.corrupt_blocks == 0


async def test_server_eviction_under_maxmemory(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory(
        extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"]
    )
    block = 64 * 1024
    async with opened_tier(server.url, block_bytes=block) as tier:
        removed = collect_removed(tier)
        keys, blocks = new_keys(200), new_blocks(200, block)
        for lo in range(0, 200, 20):
            await tier.write_many(keys[lo : lo + 20], views(blocks[lo : lo + 20]))
        present = await tier.contains_many(keys)
        assert 0 < sum(present) < 200, "the server evicted some blocks and kept others"
        out = new_blocks(200, block)
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(out))
        assert all(isinstance(e, BlockNotFound) for e in caught.value.errors.values())
        for i, key in enumerate(keys):
            if key in caught.value.succeeded:
                assert out[i] == blocks[i]
        assert set(removed) == set(caught.value.errors)
        assert tier.stats.vanished_blocks == len(caught.value.errors)
