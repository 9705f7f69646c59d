"""Faults against a real redis-server: down at start, restarts, timeouts, OOM, credentials.

Every operation here runs under a generous ``asyncio.timeout`` that only
guards against hangs (the behaviour under test): no timing is asserted.
"""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from tests.support.redis_server import (
    RedisServer,
    free_port,
    redis_server,  # noqa: F401
    redis_server_factory,  # noqa: F401
)
from tests.support.redis_tier import (
    context,
    new_blocks,
    new_keys,
    opened_tier,
    read_back,
    views,
)
from tiering.core.errors import BlockNotFound, PartialBatchError
from tiers.redis import RedisTier, RedisTierCommandError, RedisTierTimeout, RedisTierUnavailable

pytestmark = pytest.mark.redis

#: Hang guard for one operation: far above any timeout configured in these tests.
HANG_GUARD_S = 20.0
#: Settings that make the fault paths quick.
FAST = {"op_timeout_s": 0.5, "connect_timeout_s": 0.5, "reconnect_interval_s": 0.05}


async def eventually(attempt: Callable[[], Awaitable[None]], what: str) -> None:
    """Retry ``attempt`` until it succeeds (the tier reconnects), failing after a bound."""
    async with asyncio.timeout(HANG_GUARD_S):
        while True:
            try:
                await attempt()
                return
            except (RedisTierUnavailable, RedisTierTimeout, PartialBatchError):
                await asyncio.sleep(0.05)
    raise AssertionError(f"never succeeded: {what}")


async def test_down_at_start_fails_open_with_a_clear_error() -> None:
    port = free_port()
    tier = RedisTier(url=f"redis://127.0.0.1:{port}/0", **FAST)
    async with asyncio.timeout(HANG_GUARD_S):
        with pytest.raises(RedisTierUnavailable) as caught:
            await tier.open(context())
    message = str(caught.value)
    assert f"127.0.0.1:{port}" in message and "on_start_unreachable='degrade'" in message
    await tier.aclose()


async def test_down_at_start_degrades_then_recovers(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    port = free_port()
    tier = RedisTier(
        url=f"redis://127.0.0.1:{port}/0", on_start_unreachable="degrade", namespace="dg", **FAST
    )
    keys, blocks = new_keys(3), new_blocks(3)
    async with asyncio.timeout(HANG_GUARD_S):
        await tier.open(context())
        try:
            assert await tier.contains_many(keys) == [False] * 3, "an outage reports misses"
            with pytest.raises(PartialBatchError) as caught:
                await tier.write_many(keys, views(blocks))
            assert all(isinstance(e, RedisTierUnavailable) for e in caught.value.errors.values())
            with pytest.raises(RedisTierUnavailable):
                await read_back(tier, keys[0])
            assert tier.stats.outages == 1

            redis_server_factory(port=port)
            await eventually(lambda: tier.write_many(keys, views(blocks)), "write after start")
            assert await tier.contains_many(keys) == [True] * 3
            assert await read_back(tier, keys[2]) == blocks[2]
            assert tier.stats.recoveries == 1
        finally:
            await tier.aclose()


async def test_wrong_credentials_fail_open_even_when_degrading(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory(extra_args=["--requirepass", "s3cret"])
    async with asyncio.timeout(HANG_GUARD_S):
        async with opened_tier(server.url, password="s3cret") as tier:
            (key,), (block,) = new_keys(1), new_blocks(1)
            await tier.write(key, memoryview(block))
            assert await read_back(tier, key) == block
        for password in ("wrong", None):
            tier = RedisTier(url=server.url, password=password, on_start_unreachable="degrade")
            with pytest.raises(RedisTierCommandError, match="credentials"):
                await tier.open(context())
            await tier.aclose()


async def test_restart_mid_run_fails_fast_then_reconnects(redis_server: RedisServer) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        async with opened_tier(redis_server.url, **FAST) as tier:
            keys, blocks = new_keys(4), new_blocks(4)
            await tier.write_many(keys, views(blocks))

            redis_server.kill()
            with pytest.raises(PartialBatchError) as caught:
                await tier.read_many(keys, views(new_blocks(4)))
            errors = list(caught.value.errors.values())
            assert len(errors) == 4 and all(isinstance(e, RedisTierUnavailable) for e in errors)
            assert redis_server.url.split("//")[1].split("/")[0] in str(errors[0])
            assert await tier.contains_many(keys) == [False] * 4
            assert tier.stats.outages == 1

            redis_server.start()
            await eventually(lambda: tier.write(keys[0], memoryview(blocks[0])), "write")
            assert await read_back(tier, keys[0]) == blocks[0]
            with pytest.raises(BlockNotFound):
                await read_back(tier, keys[1])  # the restarted server lost it
            assert tier.stats.recoveries == 1


async def test_pooled_connections_survive_a_quick_restart(redis_server: RedisServer) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        async with opened_tier(redis_server.url, **FAST) as tier:
            keys, blocks = new_keys(2), new_blocks(2)
            await tier.write(keys[0], memoryview(blocks[0]))
            redis_server.restart()
            # The pooled connection is dead; the client re-dials once, transparently.
            await tier.write(keys[1], memoryview(blocks[1]))
            assert await read_back(tier, keys[1]) == blocks[1]
            assert tier.stats.outages == 0


async def test_timeouts_fail_the_operation_then_the_tier_recovers(
    redis_server: RedisServer,
) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        # The gate stays shut for 2 s after the timeout: far longer than the few ms the test
        # needs to see it shut, however loaded the machine (50 ms once let a probe through).
        async with opened_tier(
            redis_server.url, op_timeout_s=0.1, connect_timeout_s=0.5, reconnect_interval_s=2.0
        ) as tier:
            (key,), (block,) = new_keys(1), new_blocks(1)
            # 0.1 s is short on a loaded machine: the setup write may time out too (and
            # shut the gate for 2 s); what is under test is the paused server below.
            await eventually(lambda: tier.write(key, memoryview(block)), "the first write")
            timeouts_before = tier.stats.timeouts
            with redis_server.client() as raw:
                raw.execute_command("CLIENT", "PAUSE", 800, "ALL")
            with pytest.raises(RedisTierTimeout, match="no answer in time"):
                await read_back(tier, key)
            assert tier.stats.timeouts == timeouts_before + 1
            with pytest.raises(RedisTierUnavailable, match="next connection attempt"):
                await read_back(tier, key)  # fails at once while the gate is closed
            assert await tier.contains(key) is False
            await eventually(lambda: read_back(tier, key), "read after the pause")
            assert await read_back(tier, key) == block


async def test_cancelled_operation_on_a_stalled_server_leaves_the_tier_usable(
    redis_server: RedisServer,
) -> None:
    async with asyncio.timeout(HANG_GUARD_S):
        async with opened_tier(redis_server.url, op_timeout_s=5) as tier:
            keys, blocks = new_keys(2), new_blocks(2)
            await tier.write(keys[0], memoryview(blocks[0]))
            with redis_server.client() as raw:
                raw.execute_command("CLIENT", "PAUSE", 400, "ALL")
            pending = asyncio.create_task(tier.write(keys[1], memoryview(blocks[1])))
            await asyncio.sleep(0.05)
            pending.cancel()
            with pytest.raises(asyncio.CancelledError):
                await pending
            # The cancelled connection was dropped, so no stale reply can reach the next user.
            assert await read_back(tier, keys[0]) == blocks[0]
            present = await tier.contains(keys[1])
            if present:
                assert await read_back(tier, keys[1]) == blocks[1]


async def test_out_of_memory_fails_writes_clearly_and_reads_keep_working(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    server = redis_server_factory(
        extra_args=["--maxmemory", "3mb", "--maxmemory-policy", "noeviction"]
    )
    block = 64 * 1024
    async with asyncio.timeout(HANG_GUARD_S):
        async with opened_tier(server.url, block_bytes=block) as tier:
            keys, blocks = new_keys(100), new_blocks(100, block)
            with pytest.raises(PartialBatchError) as caught:
                for lo in range(0, 100, 10):
                    await tier.write_many(keys[lo : lo + 10], views(blocks[lo : lo + 10]))
            errors = list(caught.value.errors.values())
            assert errors and all(isinstance(e, RedisTierCommandError) for e in errors)
            assert all(e.out_of_memory and "out of memory" in str(e) for e in errors)
            assert tier.stats.out_of_memory_rejections == len(errors)
            stored = keys[0]
            assert await read_back(tier, stored) == blocks[0], "reads still work"
            assert tier.stats.outages == 0, "OOM is a refusal, not an outage"
            with server.client() as raw:
                raw.flushall()
            await tier.write(keys[-1], memoryview(blocks[-1]))
            assert await read_back(tier, keys[-1]) == blocks[-1]
