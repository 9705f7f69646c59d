"""TLS settings pass through to redis-py: a real TLS-only redis-server requiring client certs."""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import pytest

from tests.support.redis_server import RedisServer, tls_files, tls_redis_server  # noqa: F401
from tests.support.redis_tier import context, new_blocks, new_keys, opened_tier, read_back, views
from tiers.redis import RedisTier, RedisTierCommandError

pytestmark = pytest.mark.redis


def tls_settings(server: RedisServer) -> dict[str, str]:
    assert server.tls is not None
    return {
        "ssl_ca_certs": str(server.tls.ca_cert),
        "ssl_certfile": str(server.tls.client_cert),
        "ssl_keyfile": str(server.tls.client_key),
    }


async def test_mutual_tls_round_trip(tls_redis_server: RedisServer) -> None:
    assert tls_redis_server.url.startswith("rediss://")
    async with opened_tier(tls_redis_server.url, **tls_settings(tls_redis_server)) as tier:
        keys, blocks = new_keys(5), new_blocks(5)
        await tier.write_many(keys, views(blocks))
        assert await read_back(tier, keys[4]) == blocks[4]


async def test_tls_over_a_redis_url_with_ssl_true(tls_redis_server: RedisServer) -> None:
    url = tls_redis_server.url.replace("rediss://", "redis://")
    async with opened_tier(url, ssl=True, **tls_settings(tls_redis_server)) as tier:
        (key,), (block,) = new_keys(1), new_blocks(1)
        await tier.write(key, memoryview(block))
        assert await read_back(tier, key) == block


@pytest.mark.parametrize("left_out", ["ssl_ca_certs", "ssl_certfile"])
async def test_tls_misconfiguration_fails_open_even_when_degrading(
    tls_redis_server: RedisServer, left_out: str
) -> None:
    settings = tls_settings(tls_redis_server)
    del settings[left_out]
    if left_out == "ssl_certfile":
        del settings["ssl_keyfile"]
    tier = RedisTier(url=tls_redis_server.url, on_start_unreachable="degrade", **settings)
    with pytest.raises(RedisTierCommandError, match="TLS handshake failed"):
        await tier.open(context())
    await tier.aclose()
