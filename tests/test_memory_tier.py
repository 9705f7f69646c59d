"""The in-memory tier: the conformance kit, bounds, eviction and removal reports."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.runtime_support import key
from tiering.copy import bulk
from tiering.core.errors import BlockNotFound, ConfigError, PartialBatchError
from tiering.core.keys import OffloadKey
from tiering.testing.conformance import conformance_tests
from tiering.tier import TierContext
from tiers.memory import ExampleTier, MemoryTier

# Memory does not survive aclose: the kit's persistence check does not apply.
NOT_PERSISTENT = ("persistence",)
globals().update(conformance_tests(MemoryTier, prefix="test_unbounded_", skip=NOT_PERSISTENT))
globals().update(
    conformance_tests(
        lambda: MemoryTier(capacity_blocks=1000, eviction_policy="lru"),
        prefix="test_lru_",
        skip=NOT_PERSISTENT,
    )
)
globals().update(
    conformance_tests(
        lambda: MemoryTier(capacity_bytes=1000 * 16384, eviction_policy="arc"),
        prefix="test_arc_",
        skip=NOT_PERSISTENT,
    )
)
# The seed's "example" type, as configured by the seed's sample config.
globals().update(
    conformance_tests(
        lambda: ExampleTier(custom_param=67), prefix="test_example_", skip=NOT_PERSISTENT
    )
)
# Large blocks: batches that reach the yield threshold are copied in several bulk calls.
globals().update(
    conformance_tests(
        lambda: MemoryTier(capacity_blocks=300),
        prefix="test_large_blocks_",
        skip=NOT_PERSISTENT,
        block_bytes=512 << 10,
        concurrency=8,
    )
)

BLOCK = 64


async def opened(**options: object) -> tuple[MemoryTier, list[OffloadKey]]:
    tier = MemoryTier(**options)  # type: ignore[arg-type]
    removed: list[OffloadKey] = []
    tier._bind_removed_sink(lambda keys: removed.extend(keys))
    await tier.open(TierContext(block_bytes=BLOCK))
    return tier, removed


def block(i: int) -> memoryview:
    return memoryview(bytes([i % 256]) * BLOCK)


async def test_bounded_tier_evicts_least_recently_used_and_reports_it() -> None:
    tier, removed = await opened(capacity_blocks=3)
    for i in range(3):
        await tier.write(key(i), block(i))
    await tier.touch([key(0)])
    into = bytearray(BLOCK)
    await tier.read(key(1), memoryview(into))  # a read is a use too
    await tier.write(key(3), block(3))
    assert removed == [key(2)]
    assert not await tier.contains(key(2))
    assert tier.num_blocks == 3
    with pytest.raises(BlockNotFound):
        await tier.read(key(2), memoryview(into))


async def test_capacity_bytes_becomes_whole_blocks_at_open() -> None:
    tier, _ = await opened(capacity_bytes=BLOCK * 5 + 7)
    assert tier.capacity_blocks == 5
    with pytest.raises(ConfigError, match="holds no block"):
        await opened(capacity_bytes=BLOCK - 1)


async def test_delete_frees_room_and_overwrite_does_not_evict() -> None:
    tier, removed = await opened(capacity_blocks=2)
    await tier.write(key(1), block(1))
    await tier.write(key(2), block(2))
    await tier.write(key(2), block(9))  # overwrite: no eviction
    await tier.delete(key(1))
    await tier.write(key(3), block(3))
    assert removed == []
    assert set(await tier.list_keys()) == {key(2), key(3)}


async def test_wrong_buffer_size_is_rejected() -> None:
    tier, _ = await opened()
    with pytest.raises(ValueError, match="blocks are 64"):
        await tier.write(key(1), memoryview(bytes(10)))


def test_bad_options_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="not both"):
        MemoryTier(capacity_blocks=1, capacity_bytes=4096)
    with pytest.raises(ConfigError, match="positive"):
        MemoryTier(capacity_blocks=0)
    with pytest.raises(ConfigError, match="integer"):
        MemoryTier(capacity_bytes=1.5)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="eviction_policy"):
        MemoryTier(eviction_policy="fifo")


@settings(max_examples=60)
@given(
    capacity=st.integers(1, 6),
    policy=st.sampled_from(["lru", "arc"]),
    ops=st.lists(st.tuples(st.sampled_from(["write", "delete", "touch"]), st.integers(0, 9))),
)
async def test_held_blocks_never_exceed_capacity_and_removals_are_reported(
    capacity: int, policy: str, ops: Sequence[tuple[str, int]]
) -> None:
    tier, removed = await opened(capacity_blocks=capacity, eviction_policy=policy)
    model: dict[OffloadKey, int] = {}
    for op, i in ops:
        k = key(i)
        if op == "write":
            await tier.write(k, block(i))
            model[k] = i
        elif op == "delete":
            await tier.delete(k)
            model.pop(k, None)
        else:
            await tier.touch([k])
        for gone in removed:
            model.pop(gone, None)
        removed.clear()
        assert tier.num_blocks <= capacity
        assert set(await tier.list_keys()) == set(model)
    for k, i in model.items():
        into = bytearray(BLOCK)
        await tier.read(k, memoryview(into))
        assert into == bytes(block(i))


@pytest.mark.parametrize("bound", [None, 3])
async def test_a_batch_larger_than_the_tier_keeps_its_last_blocks_intact(bound: int | None) -> None:
    # Slots evicted and reused within one batch: the queued copies run in order.
    tier, removed = await opened(capacity_blocks=bound)
    keys = [key(i) for i in range(7)]
    await tier.write_many(keys, [block(i) for i in range(7)])
    held = set(await tier.list_keys())
    assert held == set(keys[-(bound or 7) :])
    assert set(removed) == set(keys) - held
    into = [bytearray(BLOCK) for _ in held]
    ordered = sorted(held)
    await tier.read_many(ordered, [memoryview(b) for b in into])
    for k, got in zip(ordered, into, strict=True):
        assert got == bytes(block(keys.index(k)))


@pytest.mark.parametrize("bound", [None, 4])
async def test_reading_into_a_read_only_buffer_is_refused(bound: int | None) -> None:
    tier, _ = await opened(capacity_blocks=bound)
    await tier.write(key(1), block(1))
    with pytest.raises(ValueError, match="read-only"):
        await tier.read(key(1), block(0))
    with pytest.raises(PartialBatchError) as info:
        await tier.read_many([key(1)], [block(0)])
    assert isinstance(info.value.errors[key(1)], ValueError)


@pytest.mark.parametrize("bound", [None, 4])
async def test_a_failed_bulk_copy_leaves_written_keys_absent_and_read_keys_held(
    bound: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    tier, _ = await opened(capacity_blocks=bound)
    await tier.write(key(1), block(1))

    def refuse(*args: object) -> None:
        raise OSError(14, "injected bulk copy failure")

    monkeypatch.setattr("tiers.memory_stores.copy_regions", refuse)
    with pytest.raises(PartialBatchError) as info:
        await tier.write_many([key(2), key(3)], [block(2), block(3)])
    assert set(info.value.errors) == {key(2), key(3)} and not info.value.succeeded
    with pytest.raises(OSError, match="injected"):
        await tier.write(key(4), block(4))
    with pytest.raises(OSError, match="injected"):
        await tier.read(key(1), memoryview(bytearray(BLOCK)))
    assert set(await tier.list_keys()) == {key(1)}
    monkeypatch.undo()
    into = bytearray(BLOCK)
    await tier.read(key(1), memoryview(into))
    assert into == bytes(block(1))


@pytest.mark.parametrize("mode", bulk.MODES)
async def test_both_bulk_copy_paths_round_trip(mode: str) -> None:
    bulk._reset_for_tests(mode)
    try:
        tier, _ = await opened(capacity_blocks=50)
        keys = [key(i) for i in range(40)]
        await tier.write_many(keys, [block(i) for i in range(40)])
        into = [bytearray(BLOCK) for _ in keys]
        await tier.read_many(keys, [memoryview(b) for b in into])
        assert [bytes(b) for b in into] == [bytes(block(i)) for i in range(40)]
    finally:
        bulk._reset_for_tests(None)


async def test_a_bounded_tier_refuses_writes_after_aclose() -> None:
    """Its arena is unmapped by then: a copy into it crashed the process."""
    from tiering.core.errors import TierClosedError

    tier = MemoryTier(capacity_blocks=4)
    await tier.open(TierContext(block_bytes=4096))
    await tier.write(key(1), memoryview(bytearray(4096)))
    await tier.aclose()
    with pytest.raises(TierClosedError):
        await tier.write(key(2), memoryview(bytearray(4096)))


async def test_a_batch_over_the_capacity_reports_only_the_blocks_it_no_longer_holds() -> None:
    """A is evicted by the batch's first writes, then written again by its last one: held,
    so never reported removed (contains() and the removals must agree)."""
    tier = MemoryTier(capacity_blocks=2)
    removed: list[OffloadKey] = []
    tier._bind_removed_sink(removed.extend)
    await tier.open(TierContext(block_bytes=64))
    a, b, c, d = (OffloadKey(bytes([letter]) * 8) for letter in b"ABCD")
    await tier.write(a, memoryview(b"a" * 64))
    await tier.write_many([b, c, d, a], [memoryview(bytes([x]) * 64) for x in b"bcda"])
    held = set(await tier.list_keys())
    assert held == {d, a}
    assert not held & set(removed) and set(removed) == {b, c}


async def test_a_capacity_no_machine_has_is_a_config_error_naming_it() -> None:
    tier = MemoryTier(capacity_blocks=10**15)
    with pytest.raises(ConfigError, match="capacity_blocks=1000000000000000"):
        await tier.open(TierContext(block_bytes=1 << 20))
