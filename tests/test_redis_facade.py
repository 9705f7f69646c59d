"""The Redis tier behind the runtime's facade, built from a vLLM-style config dict.

These drive the scheduler-facing contract (lookup / submit_* / get_finished)
from the test's thread, as the scheduler would, with two "engines" (two
facades, two primary buffers) sharing one real redis-server.
"""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from tests.support.redis_server import (
    RedisServer,
    free_port,
    redis_server,  # noqa: F401
    redis_server_factory,  # noqa: F401
)
from tests.support.redis_tier import count_round_trips, run_job
from tiering.core.errors import ConfigError
from tiering.core.keys import NO_CONTEXT, OffloadKey, make_offload_key
from tiering.registry import create_secondary_tier
from tiering.runtime import AsyncTierManager
from tiers.redis import RedisTier

pytestmark = pytest.mark.redis

BLOCK_BYTES = 8192
ROWS = 64
FINGERPRINT = "facade-test/bf16/16"
#: Bound on any wait in these tests (guards hangs; nothing is timed).
WAIT_S = 20.0

Rows = npt.NDArray[np.uint8]


@contextmanager
def engine(config: dict[str, Any]) -> Iterator[tuple[AsyncTierManager, Rows]]:
    """A facade over a Redis tier built from ``config``, with its own primary buffer."""
    rows = np.zeros((ROWS, BLOCK_BYTES), dtype=np.uint8)
    manager = create_secondary_tier(
        {"job_timeout_s": 10, **config}, rows.data, position=0, layout_fingerprint=FINGERPRINT
    )
    try:
        yield manager, rows
    finally:
        manager.shutdown()


def redis_config(url: str, namespace: str, **extra: Any) -> dict[str, Any]:
    return {"type": "redis", "url": url, "namespace": namespace, **extra}


def keys(count: int) -> list[OffloadKey]:
    return [make_offload_key(os.urandom(16), 0) for _ in range(count)]


def fill(rows: Rows, block_ids: list[int]) -> None:
    for row in block_ids:
        rows[row] = np.frombuffer(os.urandom(BLOCK_BYTES), dtype=np.uint8)


def resolved_lookup(manager: AsyncTierManager, key: OffloadKey) -> bool:
    """Poll ``lookup`` until it answers True or False (None means "being checked")."""
    deadline = time.monotonic() + WAIT_S
    while (answer := manager.lookup(key, NO_CONTEXT)) is None:
        assert time.monotonic() < deadline, "lookup never resolved"
        time.sleep(0.005)
    return answer


def eventually(condition: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not condition():
        assert time.monotonic() < deadline, f"never happened: {what}"
        time.sleep(0.02)


def test_config_dict_builds_the_redis_tier(redis_server: RedisServer) -> None:
    with engine(redis_config(redis_server.url, "cfg", max_connections=4, ttl_s=60)) as (mgr, _):
        assert isinstance(mgr.tier, RedisTier) and mgr.tier.shared
        assert mgr.tier.config.max_connections == 4 and mgr.tier.config.ttl_s == 60


@pytest.mark.parametrize(
    ("option", "value"), [("hostname", "x"), ("max_connections", 0), ("cluster", "yes")]
)
def test_bad_options_name_the_tier_and_the_key(
    redis_server: RedisServer, option: str, value: object
) -> None:
    rows = np.zeros((2, BLOCK_BYTES), dtype=np.uint8)
    config = {**redis_config(redis_server.url, "bad"), option: value}
    with pytest.raises(ConfigError, match=rf"secondary_tiers\[0\].*'redis'.*{option}"):
        create_secondary_tier(config, rows.data, position=0)


def test_lookup_resolves_unknown_keys_asynchronously(redis_server: RedisServer) -> None:
    config = redis_config(redis_server.url, "lookup")
    with engine(config) as (engine_a, rows_a), engine(config) as (engine_b, rows_b):
        stored, absent = keys(4), keys(1)[0]
        fill(rows_a, [0, 1, 2, 3])
        assert run_job(engine_a, stored, [0, 1, 2, 3], load=False).success
        assert engine_a.lookup(stored[0], NO_CONTEXT) is True, "the writer knows at once"

        assert engine_b.lookup(stored[0], NO_CONTEXT) is None, "unknown: checked in background"
        assert engine_b.lookup(absent, NO_CONTEXT) is None
        assert resolved_lookup(engine_b, stored[0]) is True
        assert resolved_lookup(engine_b, absent) is False
        assert all(resolved_lookup(engine_b, k) for k in stored)

        result = run_job(engine_b, stored, [10, 11, 12, 13], load=True)
        assert result.success, result.error
        assert np.array_equal(rows_b[10:14], rows_a[0:4])


def test_a_store_job_is_one_data_pipeline_and_skips_blocks_others_stored(
    redis_server: RedisServer,
) -> None:
    config = redis_config(redis_server.url, "one-trip")
    with engine(config) as (engine_a, rows_a), engine(config) as (engine_b, rows_b):
        block_keys = keys(48)
        fill(rows_a, list(range(48)))
        trips = count_round_trips(engine_a.tier)  # type: ignore[arg-type]
        assert run_job(engine_a, block_keys, list(range(48)), load=False).success
        # One STRLEN pipeline (presence of unknown keys), then one SET pipeline: never per block.
        assert trips == [48, 48], "one presence check and one SET pipeline for the job"

        fill(rows_b, list(range(48)))
        assert run_job(engine_b, block_keys, list(range(48)), load=False).success
        tier_b = engine_b.tier
        assert isinstance(tier_b, RedisTier)
        assert tier_b.stats.blocks_written == 0, "blocks another engine stored are not rewritten"
        assert run_job(engine_b, block_keys, list(range(48)), load=True).success
        assert np.array_equal(rows_b[:48], rows_a[:48])


def test_vanished_block_fails_the_load_and_becomes_absent(redis_server: RedisServer) -> None:
    config = redis_config(redis_server.url, "vanish")
    with engine(config) as (manager, rows):
        block_keys = keys(2)
        fill(rows, [0, 1])
        assert run_job(manager, block_keys, [0, 1], load=False).success
        tier = manager.tier
        assert isinstance(tier, RedisTier)
        with redis_server.client() as raw:
            raw.delete(tier._require_layout().redis_key(block_keys[1]))
        assert manager.lookup(block_keys[1], NO_CONTEXT) is True, "still believed present"
        result = run_job(manager, block_keys, [5, 6], load=True)
        assert not result.success and result.successful_keys == {block_keys[0]}
        assert manager.lookup(block_keys[1], NO_CONTEXT) is False, "a miss, not a retry loop"
        assert np.array_equal(rows[5], rows[0])


def test_corrupt_block_fails_the_load_never_serves_it(redis_server: RedisServer) -> None:
    config = redis_config(redis_server.url, "corrupt")
    with engine(config) as (manager, rows):
        (key,) = keys(1)
        fill(rows, [0])
        assert run_job(manager, [key], [0], load=False).success
        tier = manager.tier
        assert isinstance(tier, RedisTier)
        name = tier._require_layout().redis_key(key)
        with redis_server.client() as raw:
            value = raw.get(name)
            assert value is not None
            raw.set(name, value[:-1] + bytes([value[-1] ^ 0xFF]))
        result = run_job(manager, [key], [7], load=True)
        assert not result.success and "corrupt" in (result.error or "")
        assert not rows[7].any(), "the corrupt bytes never reached the primary buffer"
        assert manager.lookup(key, NO_CONTEXT) is False
        assert manager.stats().corrupt_reads == 1


def test_outage_at_start_degrades_then_recovers(
    redis_server_factory: Callable[..., RedisServer],
) -> None:
    port = free_port()
    config = redis_config(
        f"redis://127.0.0.1:{port}/0",
        "outage",
        on_start_unreachable="degrade",
        reconnect_interval_s=0.05,
        connect_timeout_s=0.5,
        op_timeout_s=0.5,
        shared_absent_ttl_s=0.1,
    )
    with engine(config) as (manager, rows):
        (key,) = keys(1)
        assert resolved_lookup(manager, key) is False, "an outage answers misses"
        fill(rows, [0])
        failed = run_job(manager, [key], [0], load=False)
        assert not failed.success and "unreachable" in (failed.error or "")

        redis_server_factory(port=port)
        eventually(lambda: run_job(manager, [key], [0], load=False).success, "a store succeeds")
        assert manager.lookup(key, NO_CONTEXT) is True
        assert run_job(manager, [key], [1], load=True).success
        assert np.array_equal(rows[1], rows[0])


def test_fail_at_start_raises_from_the_facade() -> None:
    rows = np.zeros((2, BLOCK_BYTES), dtype=np.uint8)
    config = redis_config(f"redis://127.0.0.1:{free_port()}/0", "nope", connect_timeout_s=0.5)
    with pytest.raises(ConnectionError, match="unreachable"):
        create_secondary_tier(config, rows.data, position=0)
