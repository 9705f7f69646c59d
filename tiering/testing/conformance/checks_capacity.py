"""The check of a bounded tier: it holds what it declares and reports what it evicts.

A tier with a capacity (``KitOptions.capacity_blocks`` or its own
``capacity_blocks`` attribute) must make room by evicting, and tell the
framework about every block it dropped through
:meth:`~tiering.tier.AsyncTier.report_removed`; otherwise lookups keep
answering hits for blocks that are gone. ``eviction_reported`` overfills a
fresh tier and checks every key written: present with its own bytes, or
absent *and* reported removed.
"""

from __future__ import annotations

from tiering.core.errors import BlockNotFound
from tiering.testing.conformance.checks_data import with_tier
from tiering.testing.conformance.kit import Kit, Skip, TrackedTier, show_key


@with_tier
async def eviction_reported(kit: Kit, tier: TrackedTier) -> None:
    """Overfilled, a bounded tier holds at most its capacity and reports every eviction."""
    capacity = kit.capacity(tier)
    if capacity is None:
        raise Skip(
            "the tier declares no capacity (KitOptions.capacity_blocks or a "
            "capacity_blocks attribute): treated as unbounded"
        )
    keys = kit.keys(capacity + max(16, capacity // 4))
    blocks = [kit.data(k) for k in keys]
    await kit.write_all(tier, keys, blocks)
    present: list[bool] = []
    for start in range(0, len(keys), 512):
        present += await tier.contains_many(keys[start : start + 512])
    held = sum(present)
    if held > capacity:
        raise kit.fail(
            f"the tier holds {held} blocks after {len(keys)} writes, more than its declared "
            f"capacity of {capacity} blocks"
        )
    for key, data, is_present in zip(keys, blocks, present, strict=True):
        reported = bytes(key) in kit.removed
        if not is_present and not reported:
            raise kit.fail(
                f"key {show_key(key)}: evicted (contains() is False) but never reported with "
                f"report_removed(); {len(kit.removed)} of {len(keys) - held} evictions reported "
                f"(capacity {capacity}, {len(keys)} keys written)"
            )
        if is_present and reported:
            raise kit.fail(
                f"key {show_key(key)}: reported removed (report_removed) but contains() is "
                "still True"
            )
        if is_present:
            await kit.expect(tier, key, data, "read() of a block the tier kept")
            continue
        try:
            got = await kit.read_back(tier, key)
        except BlockNotFound:
            continue
        raise kit.fail(
            f"key {show_key(key)}: evicted and reported removed, but read() returned "
            f"{'its own' if got == data else 'other'} bytes instead of raising BlockNotFound"
        )
