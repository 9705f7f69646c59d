"""The tier conformance kit against the Redis tier on a real server (standalone and cluster)."""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import os

import pytest

from tests.support.redis_server import (
    RedisClusterServers,
    RedisServer,
    redis_cluster,  # noqa: F401
    shared_redis_server,  # noqa: F401
)
from tiering.testing.conformance import conformance_tests
from tiers.redis import RedisTier

pytestmark = pytest.mark.redis


def standalone_tier(shared_redis_server: RedisServer) -> RedisTier:
    # One server for every check: each tier has a namespace of its own.
    return RedisTier(url=shared_redis_server.url, namespace="kit-" + os.urandom(4).hex())


def cluster_tier(redis_cluster: RedisClusterServers) -> RedisTier:
    return RedisTier(url=redis_cluster.url, cluster=True, namespace="kit-" + os.urandom(4).hex())


# ``persistence`` (listing blocks at open) is not run: a shared tier resolves presence with
# contains_many instead (test_redis_facade.py covers blocks surviving across engines).
globals().update(
    conformance_tests(standalone_tier, prefix="test_standalone_", skip=("persistence",))
)
globals().update(conformance_tests(cluster_tier, prefix="test_cluster_", skip=("persistence",)))
