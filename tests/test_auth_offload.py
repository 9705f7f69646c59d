"""Tags computed and checked off the tier's loop thread (:class:`tiering.tier.auth.OffLoopWork`).

The same tags as inline, byte for byte (the stored formats do not change); a
cancelled read or write returns only once no hashing thread touches the
caller's buffers; a check that fails or never finishes is a miss, never a hit;
forged blocks stay misses. Threads are synchronised with events, never sleeps.
"""
# ruff: noqa: F811  (pytest fixtures are imported by name and then requested as parameters)

from __future__ import annotations

import asyncio
import functools
import os
import struct
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import blake3
import pytest

from tests.support.redis_server import RedisServer, redis_server  # noqa: F401
from tests.support.redis_tier import new_blocks, new_keys, opened_tier, views
from tiering.core.errors import BlockNotFound, CorruptBlock, PartialBatchError
from tiering.tier import auth
from tiering.tier.auth import BlockAuthenticator, OffLoopWork
from tiers.fs import reads as fs_reads
from tiers.fs import writes as fs_writes
from tiers.fs.index import TAG
from tiers.redis import layout as redis_layout
from tiers.redis import loads as redis_loads
from tiers.redis.errors import RejectedValue
from tiers.redis.layout import AUTH_HEADER_LEN, BlockLayout

from .fs_support import BLOCK, block_data, key, opened, read_key, write_keys

pytestmark = pytest.mark.timeout(120)

KEY_ENV = "KV_TIERING_TEST_OFFLOAD_KEY"
SECRET = b"offload-test-secret-" + b"k" * 16
MACS = auth.MAC_NAMES


@pytest.fixture
def auth_env(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    monkeypatch.setenv(KEY_ENV, SECRET.decode())
    return {"auth_key_env": KEY_ENV}


@pytest.fixture
def offload_all(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every batch, however small, goes to the hashing threads, on any machine."""
    monkeypatch.setattr(auth, "OFFLOAD_MIN_BYTES", 0)
    monkeypatch.setattr(auth, "OFFLOAD_MIN_CPUS", 1)


@pytest.fixture
def offload_none(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "OFFLOAD_MIN_BYTES", 1 << 62)


class Gate:
    """Holds a hashing thread inside a wrapped function until released (events only)."""

    def __init__(self) -> None:
        self.entered = threading.Event()
        self.release = threading.Event()
        self.finished = threading.Event()

    def wrap(self, real: Callable[..., Any]) -> Callable[..., Any]:
        def held(*args: Any) -> Any:
            self.entered.set()
            assert self.release.wait(60), "the test never released the hashing thread"
            try:
                return real(*args)
            finally:
                self.finished.set()

        return held


def no_help(monkeypatch: pytest.MonkeyPatch) -> None:
    """Waits leave every item to the hashing threads (a held item never blocks the loop)."""
    real_wait = OffLoopWork.wait

    async def wait(self: OffLoopWork, help: bool = False) -> None:
        await real_wait(self)

    monkeypatch.setattr(OffLoopWork, "wait", wait)


async def cancel_while_held(task: asyncio.Task[Any], gate: Gate) -> list[bool]:
    """Cancel ``task`` while a hashing thread is held in ``gate``; what the thread's state was
    when the task ended (True: finished; a task ending before it would record False)."""
    seen: list[bool] = []
    task.add_done_callback(lambda _: seen.append(gate.finished.is_set()))
    try:
        assert await asyncio.to_thread(gate.entered.wait, 60)
        task.cancel()
        for _ in range(20):  # the loop runs the cancellation through; the thread is still held
            await asyncio.sleep(0)
        assert not task.done(), "a cancelled call returned while a hashing thread held its buffer"
    finally:
        gate.release.set()
    with pytest.raises(asyncio.CancelledError):
        await task
    return seen


# -- the tag itself -------------------------------------------------------------------------


@pytest.mark.parametrize("key_len", [0, 20, 60])
def test_blake3_tag_is_the_keyed_hash_of_the_whole_stream(key_len: int) -> None:
    """The 16 KiB head taken in one piece changes nothing: the tag is BLAKE3 of the same bytes."""
    authenticator = BlockAuthenticator(SECRET, "test", "blake3")
    derived = blake3.blake3(SECRET, derive_key_context=auth._KDF_CONTEXT).digest(32)
    k = os.urandom(key_len)
    for fingerprint in (b"", b"fp", os.urandom(300)):
        head = 16384 - 6 - len(k) - len(fingerprint)
        for size in (0, 1, head - 1, head, head + 1, 16384, 65536, 65536 + 7, 1 << 21):
            payload = os.urandom(size)
            stream = struct.pack("<HI", len(k), len(fingerprint)) + k + fingerprint + payload
            expected = blake3.blake3(stream, key=derived).digest(16)
            assert authenticator.tag(k, fingerprint, memoryview(bytearray(payload))) == expected
            assert authenticator.verify(k, fingerprint, payload, expected, "blake3")


@pytest.mark.parametrize("mac", MACS)
async def test_tags_computed_on_the_hashing_threads_equal_the_inline_ones(mac: str) -> None:
    authenticator = BlockAuthenticator(SECRET, "test", mac)
    items = [(os.urandom(20), bytearray(os.urandom(size))) for size in (1, 4096, 65536, 1 << 20)]
    items *= 8
    got: list[bytes | None] = [None] * len(items)
    threads: set[int] = set()

    def tag(i: int) -> None:
        threads.add(threading.get_ident())
        k, payload = items[i]
        got[i] = authenticator.tag(k, b"fp", memoryview(payload))

    work = OffLoopWork()
    for i in range(len(items)):
        work.submit(functools.partial(tag, i))
    await work.wait()
    assert work.pending == 0 and work.failure is None
    assert got == [authenticator.tag(k, b"fp", memoryview(p)) for k, p in items]
    assert threading.get_ident() not in threads


async def test_a_cancelled_wait_returns_only_once_its_items_have_finished() -> None:
    gate = Gate()
    work = OffLoopWork()
    work.submit(gate.wrap(lambda: None))
    seen = await cancel_while_held(asyncio.ensure_future(work.wait()), gate)
    assert seen == [True]
    assert work.pending == 0


async def test_a_helping_wait_runs_what_no_thread_started_and_still_waits_for_the_rest() -> None:
    """``wait(help=True)``: with every hashing thread busy, the loop runs the items itself;
    cancelled, it still waits for the item a hashing thread holds."""
    busy = Gate()
    blocker = OffLoopWork()
    auth._HASH_THREADS._start()
    threads = len(auth._HASH_THREADS._threads)
    held = [Gate() for _ in range(threads)]
    for gate in held:
        blocker.submit(gate.wrap(lambda: None))
    try:
        for gate in held:
            assert await asyncio.to_thread(gate.entered.wait, 60)
        ran_on: list[int] = []
        work = OffLoopWork()
        for _ in range(5):
            work.submit(lambda: ran_on.append(threading.get_ident()))
        await work.wait(help=True)
        assert ran_on == [threading.get_ident()] * 5  # every hashing thread was busy
    finally:
        for gate in held:
            gate.release.set()
    await blocker.wait()
    # One item held on a hashing thread, the others helped with; then a cancellation.
    work = OffLoopWork()
    work.submit(busy.wrap(lambda: None))
    assert await asyncio.to_thread(busy.entered.wait, 60)
    for _ in range(3):
        work.submit(lambda: None)
    seen = await cancel_while_held(asyncio.ensure_future(work.wait(help=True)), busy)
    assert seen == [True] and work.pending == 0


async def test_an_item_that_raises_is_kept_and_the_others_still_run() -> None:
    ran: list[int] = []
    work = OffLoopWork()
    work.submit(lambda: ran.append(1))
    work.submit(lambda: (_ for _ in ()).throw(ValueError("boom")))
    work.submit(lambda: ran.append(3))
    await work.wait()
    assert sorted(ran) == [1, 3]
    assert isinstance(work.failure, ValueError)


# -- the fs tier ----------------------------------------------------------------------------


def _stored_tags(tier: Any, keys: list[Any]) -> list[bytes | None]:
    index = tier._state().index
    return [index.get(k)[TAG] for k in keys]


@pytest.mark.parametrize("mac", MACS)
async def test_fs_tags_off_the_loop_are_the_inline_tags_and_read_back(
    tmp_path: Path, auth_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, mac: str
) -> None:
    keys = [key(i) for i in range(24)]
    tags = {}
    monkeypatch.setattr(auth, "OFFLOAD_MIN_CPUS", 1)
    for mode, threshold in (("inline", 1 << 62), ("off-loop", 0)):
        monkeypatch.setattr(auth, "OFFLOAD_MIN_BYTES", threshold)
        async with opened(tmp_path / mode, **auth_env, auth_mac=mac) as tier:
            await write_keys(tier, keys)
            tags[mode] = _stored_tags(tier, keys)
        async with opened(tmp_path / mode, **auth_env, auth_mac=mac) as tier:  # replayed
            assert _stored_tags(tier, keys) == tags[mode]
            into = [bytearray(BLOCK) for _ in keys]
            await tier.read_many(keys, [memoryview(b) for b in into])
            assert [bytes(b) for b in into] == [block_data(k) for k in keys]
    assert tags["inline"] == tags["off-loop"]
    assert all(tag is not None for tag in tags["inline"])


async def test_fs_blocks_of_another_key_are_misses_off_the_loop(
    tmp_path: Path, auth_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, offload_all: None
) -> None:
    keys = [key(i) for i in range(8)]
    async with opened(tmp_path, **auth_env) as tier:
        await write_keys(tier, keys)
    monkeypatch.setenv(KEY_ENV, "another-key-" + "z" * 24)
    async with opened(tmp_path, **auth_env) as tier:
        into = [bytearray(BLOCK) for _ in keys]
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, [memoryview(b) for b in into])
        assert set(caught.value.errors) == set(keys)
        assert all(isinstance(e, CorruptBlock) for e in caught.value.errors.values())
        assert tier.stats.auth_failures == len(keys)
        with pytest.raises(BlockNotFound):  # deleted: a miss from now on
            await read_key(tier, keys[0])


async def test_fs_a_cancelled_read_waits_for_the_hashing_thread(
    tmp_path: Path, auth_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, offload_all: None
) -> None:
    keys = [key(i) for i in range(4)]
    gate = Gate()
    async with opened(tmp_path, **auth_env) as tier:
        await write_keys(tier, keys)
        monkeypatch.setattr(fs_reads, "_check_slice", gate.wrap(fs_reads._check_slice))
        into = [bytearray(BLOCK) for _ in keys]
        task = asyncio.ensure_future(tier.read_many(keys, [memoryview(b) for b in into]))
        assert await cancel_while_held(task, gate) == [True]
        monkeypatch.undo()
        monkeypatch.setattr(auth, "OFFLOAD_MIN_BYTES", 0)
        monkeypatch.setattr(auth, "OFFLOAD_MIN_CPUS", 1)
        for k in keys:  # nothing dropped, nothing left pinned
            assert await read_key(tier, k) == block_data(k)


async def test_fs_a_cancelled_write_waits_for_the_hashing_thread(
    tmp_path: Path, auth_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, offload_all: None
) -> None:
    keys = [key(i) for i in range(4)]
    gate = Gate()
    real = fs_writes._seal_slice
    async with opened(tmp_path, **auth_env) as tier:
        monkeypatch.setattr(fs_writes, "_seal_slice", gate.wrap(real))
        data = [memoryview(block_data(k)) for k in keys]
        task = asyncio.ensure_future(tier.write_many(keys, data))
        assert await cancel_while_held(task, gate) == [True]
        monkeypatch.setattr(fs_writes, "_seal_slice", real)
        for k in keys:  # not stored: the write was cancelled before its record
            with pytest.raises(BlockNotFound):
                await read_key(tier, k)
        await write_keys(tier, keys)  # the slots came back
        for k in keys:
            assert await read_key(tier, k) == block_data(k)


async def test_fs_a_failed_check_is_a_miss_and_keeps_the_block(
    tmp_path: Path, auth_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, offload_all: None
) -> None:
    keys = [key(i) for i in range(3)]
    async with opened(tmp_path, **auth_env) as tier:
        await write_keys(tier, keys)

        def broken(*args: Any) -> None:
            raise RuntimeError("hashing thread failed")

        monkeypatch.setattr(fs_reads, "_check_slice", broken)
        into = [bytearray(BLOCK) for _ in keys]
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, [memoryview(b) for b in into])
        assert set(caught.value.errors) == set(keys)
        assert all(isinstance(e, CorruptBlock) for e in caught.value.errors.values())
        assert tier.stats.auth_failures == 0 and tier.stats.corrupt_blocks == 0
        monkeypatch.setattr(fs_reads, "_check_slice", _real_check_slice)
        for k in keys:  # kept: the bytes were never found wrong
            assert await read_key(tier, k) == block_data(k)


async def test_fs_a_failed_tag_fails_the_write_and_stores_nothing(
    tmp_path: Path, auth_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch, offload_all: None
) -> None:
    keys = [key(i) for i in range(3)]
    async with opened(tmp_path, **auth_env) as tier:

        def broken(*args: Any) -> None:
            raise RuntimeError("hashing thread failed")

        monkeypatch.setattr(fs_writes, "_seal_slice", broken)
        with pytest.raises(PartialBatchError) as caught:
            await write_keys(tier, keys)
        assert set(caught.value.errors) == set(keys)
        for k in keys:
            with pytest.raises(BlockNotFound):
                await read_key(tier, k)


_real_check_slice = fs_reads._check_slice


# -- the Redis tier -------------------------------------------------------------------------

REDIS_BLOCK = 16384


@pytest.fixture
def redis_auth(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[str, Any]]:
    monkeypatch.setenv(KEY_ENV, SECRET.decode())
    yield {"auth_key_env": KEY_ENV, "block_bytes": REDIS_BLOCK}


@pytest.mark.redis
@pytest.mark.parametrize("mac", MACS)
async def test_redis_values_encoded_off_the_loop_are_the_inline_values(
    redis_server: RedisServer, redis_auth: dict[str, Any], offload_all: None, mac: str
) -> None:
    async with opened_tier(redis_server.url, **redis_auth, auth_mac=mac) as tier:
        keys, blocks = new_keys(12), new_blocks(12, REDIS_BLOCK)
        await tier.write_many(keys, views(blocks))
        layout = tier._require_layout()
        with redis_server.client() as raw:
            stored = [raw.get(layout.redis_key(k)) for k in keys]
        assert stored == [
            layout.encode(k, memoryview(b)) for k, b in zip(keys, blocks, strict=True)
        ]
        out = [bytearray(REDIS_BLOCK) for _ in keys]
        await tier.read_many(keys, views(out))
        assert out == blocks
        assert tier.stats.blocks_read == len(keys)


@pytest.mark.redis
async def test_redis_forged_values_are_misses_off_the_loop(
    redis_server: RedisServer, redis_auth: dict[str, Any], offload_all: None
) -> None:
    async with opened_tier(redis_server.url, **redis_auth) as tier:
        keys, blocks = new_keys(6), new_blocks(6, REDIS_BLOCK)
        await tier.write_many(keys, views(blocks))
        layout = tier._require_layout()
        forger = BlockLayout(
            "x", "y", REDIS_BLOCK, BlockAuthenticator(b"z" * 32, "forger")
        )  # a tag of another key
        with redis_server.client() as raw:
            good = raw.get(layout.redis_key(keys[1]))
            raw.set(layout.redis_key(keys[1]), good[:AUTH_HEADER_LEN] + os.urandom(REDIS_BLOCK))
            forged = forger.encode(keys[3], memoryview(os.urandom(REDIS_BLOCK)))
            raw.set(layout.redis_key(keys[3]), good[:16] + forged[16:])
        out = [bytearray(REDIS_BLOCK) for _ in keys]
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(out))
        assert set(caught.value.errors) == {keys[1], keys[3]}
        assert all(isinstance(e, RejectedValue) for e in caught.value.errors.values())
        assert out[1] == bytes(REDIS_BLOCK) and out[3] == bytes(REDIS_BLOCK)
        assert [out[i] for i in (0, 2, 4, 5)] == [blocks[i] for i in (0, 2, 4, 5)]
        assert tier.stats.corrupt_blocks == 2
        with redis_server.client() as raw:  # deleted, as inline
            assert raw.exists(layout.redis_key(keys[1]), layout.redis_key(keys[3])) == 0


@pytest.mark.redis
async def test_redis_a_cancelled_load_waits_for_the_hashing_thread(
    redis_server: RedisServer,
    redis_auth: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    offload_all: None,
) -> None:
    no_help(monkeypatch)  # every item on a hashing thread, never on the loop itself
    gate = Gate()
    async with opened_tier(redis_server.url, **redis_auth) as tier:
        keys, blocks = new_keys(4), new_blocks(4, REDIS_BLOCK)
        await tier.write_many(keys, views(blocks))
        monkeypatch.setattr(redis_loads, "_check_off_loop", gate.wrap(redis_loads._check_off_loop))
        out = [bytearray(REDIS_BLOCK) for _ in keys]
        task = asyncio.ensure_future(tier.read_many(keys, views(out)))
        assert await cancel_while_held(task, gate) == [True]
        monkeypatch.undo()
        monkeypatch.setattr(auth, "OFFLOAD_MIN_BYTES", 0)
        monkeypatch.setattr(auth, "OFFLOAD_MIN_CPUS", 1)
        out = [bytearray(REDIS_BLOCK) for _ in keys]
        await tier.read_many(keys, views(out))
        assert out == blocks


@pytest.mark.redis
async def test_redis_a_cancelled_store_waits_for_the_hashing_thread(
    redis_server: RedisServer,
    redis_auth: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    offload_all: None,
) -> None:
    no_help(monkeypatch)  # every item on a hashing thread, never on the loop itself
    gate = Gate()
    async with opened_tier(redis_server.url, **redis_auth) as tier:
        keys, blocks = new_keys(4), new_blocks(4, REDIS_BLOCK)
        monkeypatch.setattr(redis_layout, "_encode_slice", gate.wrap(redis_layout._encode_slice))
        task = asyncio.ensure_future(tier.write_many(keys, views(blocks)))
        assert await cancel_while_held(task, gate) == [True]
        layout = tier._require_layout()
        with redis_server.client() as raw:  # nothing was sent
            assert raw.exists(*(layout.redis_key(k) for k in keys)) == 0


@pytest.mark.redis
async def test_redis_a_failed_check_is_a_miss_never_a_hit(
    redis_server: RedisServer,
    redis_auth: dict[str, Any],
    monkeypatch: pytest.MonkeyPatch,
    offload_all: None,
) -> None:
    async with opened_tier(redis_server.url, **redis_auth) as tier:
        keys, blocks = new_keys(3), new_blocks(3, REDIS_BLOCK)
        await tier.write_many(keys, views(blocks))

        def broken(*args: Any) -> None:
            raise RuntimeError("hashing thread failed")

        monkeypatch.setattr(redis_loads, "_check_off_loop", broken)
        out = [bytearray(REDIS_BLOCK) for _ in keys]
        with pytest.raises(PartialBatchError) as caught:
            await tier.read_many(keys, views(out))
        assert set(caught.value.errors) == set(keys)
        assert tier.stats.blocks_read == 0


def tag_threads_on_a_small_machine(monkeypatch: pytest.MonkeyPatch) -> set[int]:
    """Batches big enough to hand over, on a 2-CPU machine under a 4-CPU rule; returns the set
    that collects the ids of the threads computing tags."""
    monkeypatch.setattr(auth, "OFFLOAD_MIN_BYTES", 0)
    monkeypatch.setattr(auth, "usable_cpus", lambda: 2)
    monkeypatch.setattr(auth, "OFFLOAD_MIN_CPUS", 4)
    threads: set[int] = set()
    real_tag = BlockAuthenticator.tag

    def tag(self: BlockAuthenticator, *args: Any) -> bytes:
        threads.add(threading.get_ident())
        return real_tag(self, *args)

    monkeypatch.setattr(BlockAuthenticator, "tag", tag)
    return threads


@pytest.mark.redis
async def test_redis_tags_stay_on_the_loop_on_a_small_machine(
    redis_server: RedisServer, redis_auth: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Under ``OFFLOAD_MIN_CPUS`` CPUs the hand-over does not pay: inline tags."""
    threads = tag_threads_on_a_small_machine(monkeypatch)
    async with opened_tier(redis_server.url, **redis_auth) as tier:
        keys, blocks = new_keys(8), new_blocks(8, REDIS_BLOCK)
        await tier.write_many(keys, views(blocks))
        out = [bytearray(REDIS_BLOCK) for _ in keys]
        await tier.read_many(keys, views(out))
        assert out == blocks
    assert threads == {threading.get_ident()}


async def test_fs_tags_stay_on_the_loop_on_a_small_machine(
    tmp_path: Path, auth_env: dict[str, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    threads = tag_threads_on_a_small_machine(monkeypatch)
    keys = [key(i) for i in range(8)]
    async with opened(tmp_path, **auth_env) as tier:
        await write_keys(tier, keys)
        into = [bytearray(BLOCK) for _ in keys]
        await tier.read_many(keys, [memoryview(b) for b in into])
        assert [bytes(b) for b in into] == [block_data(k) for k in keys]
    assert threads == {threading.get_ident()}
