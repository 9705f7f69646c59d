"""The checks of what a tier stores: bytes, presence, batches, deletion, persistence.

Each check here takes a :class:`~tiering.testing.conformance.kit.Kit`, opens
fresh tiers from the factory and verifies every block it reads back in full.
Checks that verify bytes use enough keys (32 and more) that a tier corrupting
a fraction of its keys fails the same checks whatever the seed;
``many_distinct_keys`` writes thousands of keys to find rare corruption and
hash-slot collisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable

from tiering.core.errors import BlockNotFound, CorruptBlock, PartialBatchError
from tiering.testing.conformance.kit import Kit, Skip, TrackedTier, gather_all, show_key

#: Keys per check that verifies bytes: a tier corrupting half its keys passes with p = 2**-32.
KEYS_PER_CHECK = 32

#: Keys never written that ``many_distinct_keys`` asks about.
_ABSENT_KEYS = 256

Check = Callable[[Kit], Awaitable[None]]


def with_tier(fn: Callable[[Kit, TrackedTier], Awaitable[None]]) -> Check:
    """A check taking an opened tier: open a fresh one, run, always close it."""

    async def run(kit: Kit) -> None:
        tier = await kit.new_tier()
        try:
            await fn(kit, tier)
        finally:
            await tier.aclose()

    run.__name__ = run.__qualname__ = fn.__name__
    run.__doc__ = fn.__doc__
    return run


@with_tier
async def round_trip(kit: Kit, tier: TrackedTier) -> None:
    """Bytes written are the bytes read; ``contains`` agrees."""
    for key in kit.keys(kit.within_capacity(tier, KEYS_PER_CHECK)):
        data = kit.data(key)
        await tier.write(key, memoryview(data))
        if not await tier.contains(key):
            raise kit.fail(f"key {show_key(key)}: contains() is False right after write()")
        await kit.expect(tier, key, data)
        absent = kit.key()
        answer = await tier.contains_many([key, absent])
        if answer != [True, False]:
            raise kit.fail(
                f"contains_many([written {show_key(key)}, absent {show_key(absent)}]) "
                f"returned {answer}, not [True, False]"
            )


@with_tier
async def missing_key(kit: Kit, tier: TrackedTier) -> None:
    """A key never written is absent: ``contains`` is False and ``read`` raises BlockNotFound."""
    for key in kit.keys(KEYS_PER_CHECK):
        if await tier.contains(key):
            raise kit.fail(f"key {show_key(key)}: contains() is True for a key never written")
        try:
            got = await kit.read_back(tier, key)
        except BlockNotFound:
            continue
        zeros = "" if any(got) else " (it filled the buffer with zeros)"
        raise kit.fail(
            f"key {show_key(key)}: read() of a key never written did not raise BlockNotFound{zeros}"
        )


@with_tier
async def overwrite(kit: Kit, tier: TrackedTier) -> None:
    """A second write replaces the block."""
    for key in kit.keys(kit.within_capacity(tier, KEYS_PER_CHECK)):
        await tier.write(key, memoryview(kit.data(key, 0)))
        await tier.write(key, memoryview(kit.data(key, 1)))
        await kit.expect(tier, key, kit.data(key, 1), "read() after an overwrite")


@with_tier
async def concurrent_distinct_keys(kit: Kit, tier: TrackedTier) -> None:
    """``concurrency`` writes and reads at once, and the batch forms, keep each key's bytes."""
    n = kit.concurrency(tier)
    keys = kit.keys(n)
    blocks = [kit.data(k) for k in keys]
    await gather_all(tier.write(k, memoryview(d)) for k, d in zip(keys, blocks, strict=True))
    await kit.verify_all(tier, keys, blocks)
    # The batch forms, too (in a bounded tier the first keys may make room: they are reported).
    more = kit.keys(n)
    more_blocks = [kit.data(k) for k in more]
    await tier.write_many(more, [memoryview(d) for d in more_blocks])
    outs = [bytearray(kit.options.block_bytes) for _ in range(n)]
    await tier.read_many(more, [memoryview(o) for o in outs])
    for key, out, data in zip(more, outs, more_blocks, strict=True):
        if out != data:
            raise kit.mismatch(key, data, out, "read_many() after write_many()")
    present = await tier.contains_many(more)
    for key, answer in zip(more, present, strict=True):
        if not answer:
            raise kit.fail(f"key {show_key(key)}: contains_many() is False after write_many()")


@with_tier
async def batch_partial_failure(kit: Kit, tier: TrackedTier) -> None:
    """``read_many`` with an absent key raises PartialBatchError naming what succeeded."""
    present = kit.keys(kit.within_capacity(tier, 8))
    absent = kit.key()
    blocks = [kit.data(k) for k in present]
    await gather_all(tier.write(k, memoryview(d)) for k, d in zip(present, blocks, strict=True))
    keys = [*present[:4], absent, *present[4:]]
    outs = [bytearray(kit.options.block_bytes) for _ in keys]
    try:
        await tier.read_many(keys, [memoryview(o) for o in outs])
    except PartialBatchError as exc:
        error = exc
    else:
        raise kit.fail(
            f"read_many() with an absent key ({show_key(absent)}) did not raise PartialBatchError"
        )
    if absent in error.succeeded:
        raise kit.fail(f"PartialBatchError.succeeded has the absent key {show_key(absent)}")
    if not isinstance(error.errors.get(absent), BlockNotFound):
        raise kit.fail(
            f"key {show_key(absent)}: the absent key's error in PartialBatchError is "
            f"{error.errors.get(absent)!r}, not BlockNotFound"
        )
    for key, out, data in zip(present, outs[:4] + outs[5:], blocks, strict=True):
        if key not in error.succeeded:
            raise kit.fail(f"key {show_key(key)}: PartialBatchError.succeeded lacks it")
        if out != data:
            raise kit.mismatch(key, data, out, "read_many() with an absent key")


@with_tier
async def delete(kit: Kit, tier: TrackedTier) -> None:
    """A deleted block is gone; deleting an absent key is no error."""
    key = kit.key()
    await tier.write(key, memoryview(kit.data(key)))
    try:
        await tier.delete(key)
    except NotImplementedError as exc:
        raise Skip(f"delete not supported: {exc}") from None
    if await tier.contains(key):
        raise kit.fail(f"key {show_key(key)}: contains() is True after delete()")
    try:
        await kit.read_back(tier, key)
    except BlockNotFound:
        pass
    else:
        raise kit.fail(f"key {show_key(key)}: read() after delete() did not raise BlockNotFound")
    await tier.delete(kit.key())  # absent: no error


@with_tier
async def touch_and_list(kit: Kit, tier: TrackedTier) -> None:
    """``touch`` of present and absent keys is no error; ``list_keys`` returns bytes keys."""
    key = kit.key()
    await tier.write(key, memoryview(kit.data(key)))
    await tier.touch([key, kit.key()])
    for listed_key in await tier.list_keys():
        if not isinstance(listed_key, bytes):
            raise kit.fail(f"list_keys() yielded {type(listed_key).__name__}, not bytes")


async def close_idempotent(kit: Kit) -> None:
    """``aclose`` twice is no error, nor closing a tier that never opened."""
    tier = await kit.new_tier()
    key = kit.key()
    await tier.write(key, memoryview(kit.data(key)))
    await tier.aclose()
    await tier.aclose()
    unopened = await kit.new_tier(open_it=False)
    await unopened.aclose()


async def persistence(kit: Kit) -> None:
    """(``persistent=True``) blocks written before ``aclose`` are listed and readable anew."""
    if not kit.options.persistent:
        raise Skip("the tier is not declared persistent (KitOptions.persistent)")
    tier = await kit.new_tier()
    try:
        keys = kit.keys(kit.within_capacity(tier, KEYS_PER_CHECK))
        blocks = [kit.data(k) for k in keys]
        await kit.write_all(tier, keys, blocks)
    finally:
        await tier.aclose()
    again = await kit.new_tier()
    try:
        listed = set(await again.list_keys())
        for key in keys:
            if key not in listed and bytes(key) not in kit.removed:
                raise kit.fail(f"key {show_key(key)}: written before aclose(), not listed after")
            if not await again.contains(key) and bytes(key) not in kit.removed:
                raise kit.fail(f"key {show_key(key)}: written before aclose(), not contained after")
        await kit.verify_all(again, keys, blocks)
    finally:
        await again.aclose()


async def layouts_kept_apart(kit: Kit) -> None:
    """(``persistent=True``) blocks written under one layout fingerprint are never listed,
    contained or served by a tier opened under another (another model's KV bytes)."""
    if not kit.options.persistent:
        raise Skip("the tier is not declared persistent (KitOptions.persistent)")
    tier = await kit.new_tier()
    try:
        keys = kit.keys(kit.within_capacity(tier, 4))
        await kit.write_all(tier, keys, [kit.data(k) for k in keys])
    finally:
        await tier.aclose()
    other = await kit.new_tier(open_it=False)
    fingerprint = f"{kit.options.layout_fingerprint}-another-layout"
    await other.open(dataclasses.replace(kit.context(), layout_fingerprint=fingerprint))
    try:
        listed = set(await other.list_keys())
        for key in keys:
            if key in listed or await other.contains(key):
                raise kit.fail(
                    f"key {show_key(key)}: written under another layout fingerprint, "
                    "listed or contained under this one"
                )
            try:
                await other.read(key, memoryview(bytearray(kit.options.block_bytes)))
            except (BlockNotFound, CorruptBlock):
                continue
            raise kit.fail(
                f"key {show_key(key)}: bytes written under another layout fingerprint served"
            )
    finally:
        await other.aclose()


@with_tier
async def many_distinct_keys(kit: Kit, tier: TrackedTier) -> None:
    """Thousands of keys keep their own bytes; keys never written stay absent."""
    keys = kit.keys(kit.within_capacity(tier, kit.options.distinct_keys))
    blocks = [kit.data(k) for k in keys]
    await kit.write_all(tier, keys, blocks)
    for start in range(0, len(keys), 512):
        chunk = keys[start : start + 512]
        for key, present in zip(chunk, await tier.contains_many(chunk), strict=True):
            if not present and bytes(key) not in kit.removed:
                raise kit.fail(
                    f"key {show_key(key)}: contains_many() is False for a block written and "
                    f"never reported removed ({len(keys)} keys written)"
                )
    absent = kit.keys(_ABSENT_KEYS)
    for key, present in zip(absent, await tier.contains_many(absent), strict=True):
        if present:
            raise kit.fail(
                f"key {show_key(key)}: contains_many() is True for a key never written "
                f"(after {len(keys)} other keys were written: do keys share slots?)"
            )
    await kit.verify_all(tier, keys, blocks)
