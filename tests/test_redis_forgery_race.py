"""A corruptor thread forging values while engines load: no wrong block is ever served.

The issue's replay: with a thread rewriting blocks in Redis with well-formed
values (valid header, valid checksum of other bytes), engines served
thousands of forged blocks. Here every successful load is compared with the
bytes that were stored; the property holds whatever the interleaving, so
nothing depends on timing (the workload is bounded by job counts).
"""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import os
import random
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np
import numpy.typing as npt
import pytest

from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.support.redis_tier import run_job
from tiering.core.keys import OffloadKey, make_offload_key
from tiering.registry import create_secondary_tier
from tiering.runtime import AsyncTierManager
from tiering.tier.auth import BlockAuthenticator
from tiers.redis.layout import BlockLayout

pytestmark = pytest.mark.redis

BLOCK_BYTES = 4096
KEYS = 32
ROUNDS = 60
FINGERPRINT = "forgery-race/bf16/16"
WAIT_S = 20.0

Rows = npt.NDArray[np.uint8]


@contextmanager
def engine(config: dict[str, Any]) -> Iterator[tuple[AsyncTierManager, Rows]]:
    rows = np.zeros((2 * KEYS, BLOCK_BYTES), dtype=np.uint8)
    manager = create_secondary_tier(
        {"job_timeout_s": 10, **config}, rows.data, position=0, layout_fingerprint=FINGERPRINT
    )
    try:
        yield manager, rows
    finally:
        manager.shutdown()


class Corruptor:
    """Rewrites random blocks with well-formed forged values until stopped."""

    def __init__(
        self,
        server: RedisServer,
        keys: list[OffloadKey],
        names: list[bytes],
        layout: BlockLayout,
    ) -> None:
        self._server = server
        self._keys = keys
        self._names = names
        self._layout = layout
        self._stop = threading.Event()
        self._first = threading.Event()
        self.forged = 0
        self._thread = threading.Thread(target=self._run, name="corruptor", daemon=True)

    def __enter__(self) -> Corruptor:
        self._thread.start()
        assert self._first.wait(WAIT_S), "the corruptor never forged a value"
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(WAIT_S)
        assert not self._thread.is_alive(), "the corruptor did not stop"

    def _run(self) -> None:
        rng = random.Random(7)
        with self._server.client() as raw:
            while not self._stop.is_set():
                index = rng.randrange(len(self._names))
                key = self._keys[index]
                payload = rng.randbytes(BLOCK_BYTES)
                raw.set(self._names[index], self._layout.encode(key, memoryview(payload)))
                self.forged += 1
                self._first.set()


def _campaign(
    server: RedisServer,
    writer: AsyncTierManager,
    writer_rows: Rows,
    reader: AsyncTierManager,
    reader_rows: Rows,
    forger_layout: BlockLayout,
) -> tuple[int, int, int]:
    """Store, forge continuously, load; returns (good loads, missed loads, forged values)."""
    rng = random.Random(11)
    keys = [make_offload_key(os.urandom(16), 0) for _ in range(KEYS)]
    for row in range(KEYS):
        writer_rows[row] = np.frombuffer(os.urandom(BLOCK_BYTES), dtype=np.uint8)
    expected = {key: bytes(writer_rows[row]) for row, key in enumerate(keys)}
    assert run_job(writer, keys, list(range(KEYS)), load=False).success
    layout: BlockLayout = writer.tier._require_layout()  # type: ignore[attr-defined]
    names = [layout.redis_key(key) for key in keys]
    good = missed = 0
    with Corruptor(server, keys, names, forger_layout) as corruptor:
        for _ in range(ROUNDS):
            chosen = rng.sample(range(KEYS), 4)
            batch = [keys[i] for i in chosen]
            result = run_job(reader, batch, list(range(KEYS, KEYS + 4)), load=True)
            for slot, key in enumerate(batch):
                if key in result.successful_keys:
                    assert bytes(reader_rows[KEYS + slot]) == expected[key], "a forged block served"
                    good += 1
                else:
                    missed += 1
            # The writer stores what went missing again (the engine's normal refill).
            gone = [i for i in chosen if keys[i] not in result.successful_keys]
            if gone:
                run_job(writer, [keys[i] for i in gone], gone, load=False)
    return good, missed, corruptor.forged


def test_own_blocks_are_never_served_forged_with_default_settings(
    redis_server: RedisServer,
) -> None:
    namespace = "race-" + os.urandom(4).hex()
    config = {"type": "redis", "url": redis_server.url, "namespace": namespace}
    with engine(config) as (manager, rows):
        forger = BlockLayout(namespace, FINGERPRINT, BLOCK_BYTES)
        good, missed, forged = _campaign(redis_server, manager, rows, manager, rows, forger)
    assert good + missed == 4 * ROUNDS and forged > 0


def test_with_an_auth_key_no_engine_serves_a_forged_block(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("KVT_RACE_AUTH_KEY", "race-test-secret-" + "m3Qv" * 8)
    namespace = "race-auth-" + os.urandom(4).hex()
    config = {
        "type": "redis",
        "url": redis_server.url,
        "namespace": namespace,
        "auth_key_env": "KVT_RACE_AUTH_KEY",
    }
    with engine(config) as (writer, writer_rows), engine(config) as (reader, reader_rows):
        # The forger knows the layout and the key names, not the auth key.
        forger = BlockLayout(
            namespace, FINGERPRINT, BLOCK_BYTES, BlockAuthenticator(b"not-the-key!" * 3, "forger")
        )
        good, missed, forged = _campaign(
            redis_server, writer, writer_rows, reader, reader_rows, forger
        )
    assert good + missed == 4 * ROUNDS and forged > 0
