"""The Redis tier on a real 3-node Redis Cluster."""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.support.redis_server import RedisClusterServers, free_port, redis_cluster  # noqa: F401
from tests.support.redis_tier import (
    context,
    count_round_trips,
    new_blocks,
    new_keys,
    opened_tier,
    read_back,
    views,
)
from tiering.core.errors import BlockNotFound, CorruptBlock, PartialBatchError
from tiers.redis import HEADER_LEN, RedisTier, RedisTierUnavailable

pytestmark = pytest.mark.redis


async def test_cluster_round_trip_spreads_blocks_over_every_node(
    redis_cluster: RedisClusterServers,
) -> None:
    async with opened_tier(redis_cluster.url, cluster=True, namespace="spread") as tier:
        trips = count_round_trips(tier)
        keys, blocks = new_keys(60), new_blocks(60)
        await tier.write_many(keys, views(blocks))
        assert await tier.contains_many([*keys, *new_keys(1)]) == [True] * 60 + [False]
        out = new_blocks(60)
        await tier.read_many(keys, views(out))
        assert out == blocks
        # One pipeline per node per job (three jobs, three nodes), sent concurrently.
        assert len(trips) == 9, trips
        assert [sum(trips[i : i + 3]) for i in (0, 3, 6)] == [60, 61, 60], trips
        per_node = []
        for node in redis_cluster.nodes:
            with node.client() as raw:
                per_node.append(len(raw.keys("spread:*")))
        assert sum(per_node) == 60
        assert all(count > 0 for count in per_node), f"blocks per node: {per_node}"


async def test_cluster_engines_share_and_see_deletions(redis_cluster: RedisClusterServers) -> None:
    async with (
        opened_tier(redis_cluster.url, cluster=True, namespace="two-engines") as engine_a,
        opened_tier(redis_cluster.url, cluster=True, namespace="two-engines") as engine_b,
    ):
        keys, blocks = new_keys(10), new_blocks(10)
        await engine_a.write_many(keys, views(blocks))
        out = new_blocks(10)
        await engine_b.read_many(keys, views(out))
        assert out == blocks
        with redis_cluster.client() as raw:
            raw.delete(engine_a._require_layout().redis_key(keys[3]))
        assert await engine_b.contains_many(keys[2:5]) == [True, False, True]
        with pytest.raises(BlockNotFound):
            await read_back(engine_b, keys[3])


async def test_cluster_corrupt_value_is_a_miss(redis_cluster: RedisClusterServers) -> None:
    async with opened_tier(redis_cluster.url, cluster=True) as tier:
        keys, blocks = new_keys(3), new_blocks(3)
        await tier.write_many(keys, views(blocks))
        name = tier._require_layout().redis_key(keys[0])
        with redis_cluster.client() as raw:
            value = raw.get(name)
            assert value is not None
            raw.set(name, value[: HEADER_LEN + 10])
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(new_blocks(3)))
        assert set(caught.value.errors) == {keys[0]}
        assert isinstance(caught.value.errors[keys[0]], CorruptBlock)
        assert tier.stats.corrupt_blocks == 1


async def test_cluster_down_at_start_fails_clearly() -> None:
    tier = RedisTier(
        url=f"redis://127.0.0.1:{free_port()}/0",
        cluster=True,
        connect_timeout_s=0.5,
        op_timeout_s=0.5,
    )
    async with asyncio.timeout(20):
        with pytest.raises(RedisTierUnavailable, match="unreachable"):
            await tier.open(context())
    await tier.aclose()


def cluster_tier(cluster: RedisClusterServers, **settings: Any) -> Any:
    """A tier on ``cluster`` that gives up on a dead node quickly."""
    return opened_tier(
        cluster.url,
        cluster=True,
        connect_timeout_s=0.5,
        reconnect_interval_s=0.05,
        max_reconnect_interval_s=0.2,
        **settings,
    )


async def stored_on_nodes(
    tier: RedisTier, cluster: RedisClusterServers, keys: list[Any], blocks: list[bytearray]
) -> set[Any]:
    """Store ``blocks``; the keys the third node holds."""
    await tier.write_many(keys, views(blocks))
    with cluster.nodes[2].client() as raw:
        held = set(raw.keys("*"))
    return {k for k in keys if tier._require_layout().redis_key(k) in held}


async def test_cluster_node_restart_fails_its_keys_cleanly_then_recovers(tmp_path: Path) -> None:
    cluster = RedisClusterServers(tmp_path).start()
    try:
        async with asyncio.timeout(60):
            async with cluster_tier(cluster, op_timeout_s=1) as tier:
                keys, blocks = new_keys(30), new_blocks(30)
                on_victim = await stored_on_nodes(tier, cluster, keys, blocks)
                assert on_victim and len(on_victim) < 30

                cluster.nodes[2].kill()
                for _ in range(3):
                    out = new_blocks(30)
                    with pytest.raises(PartialBatchError) as caught:
                        await tier.read_many(keys, views(out))
                    assert set(caught.value.errors) == on_victim, "only the dead node's keys fail"
                    assert all(
                        isinstance(e, RedisTierUnavailable) for e in caught.value.errors.values()
                    )
                    assert set(caught.value.succeeded) == set(keys) - on_victim
                    for i, key in enumerate(keys):
                        if key in caught.value.succeeded:
                            assert out[i] == blocks[i]

                cluster.nodes[2].start()  # rejoins with its slots, without its data
                while True:
                    try:
                        await tier.write_many(keys, views(blocks))
                        break
                    except PartialBatchError:
                        await asyncio.sleep(0.1)
                out = new_blocks(30)
                await tier.read_many(keys, views(out))
                assert out == blocks
    finally:
        cluster.stop()


async def test_cluster_delete_after_a_load_spares_a_rewrite(
    redis_cluster: RedisClusterServers,
) -> None:
    async with (
        opened_tier(redis_cluster.url, cluster=True, namespace="cas") as tier,
        opened_tier(redis_cluster.url, cluster=True, namespace="cas") as other,
    ):
        keys, blocks, newer = new_keys(6), new_blocks(6), new_blocks(6)
        await tier.write_many(keys, views(blocks))
        out = new_blocks(6)
        await tier.read_many(keys, views(out))
        assert out == blocks
        await other.write_many(keys[:3], views(newer[:3]))
        for key in keys:
            await tier.delete(key)
        assert await other.contains_many(keys) == [True] * 3 + [False] * 3
        for key, block in zip(keys[:3], newer[:3], strict=True):
            assert await read_back(other, key) == block


async def test_a_dead_node_never_fails_the_healthy_nodes_keys_in_later_loads(
    tmp_path: Path,
) -> None:
    """redis-py's cluster pipeline retried a dead node by closing the whole client, every
    node's connections in the middle of their replies: from the second load on, keys of
    healthy nodes failed too (large blocks keep their replies in flight long enough)."""
    block = 1 << 20
    cluster = RedisClusterServers(tmp_path).start()
    try:
        async with asyncio.timeout(60):
            async with cluster_tier(cluster, block_bytes=block, op_timeout_s=2) as tier:
                keys, blocks = new_keys(48), new_blocks(48, block)
                on_victim = await stored_on_nodes(tier, cluster, keys, blocks)
                cluster.nodes[2].kill()
                for _ in range(4):
                    out = [bytearray(block) for _ in keys]
                    with pytest.raises(PartialBatchError) as caught:
                        await tier.read_many(keys, views(out))
                    assert set(caught.value.errors) == on_victim, "only the dead node's keys fail"
                    await asyncio.sleep(0.3)
    finally:
        cluster.stop()
