"""Errors specific to the filesystem tier."""

from __future__ import annotations

from tiering.core.errors import TieringError


class TierFullError(TieringError):
    """No slot could be found for a block: every slot is being written or read.

    Raised for the blocks of a write that did not get a slot; the store fails
    (the framework retries later) and nothing is overwritten.
    """

    def __init__(self, key: bytes, capacity_slots: int, batch_blocks: int) -> None:
        why = (
            f"a batch of {batch_blocks} blocks is larger than the tier's {capacity_slots} slots"
            if batch_blocks > capacity_slots
            else f"all {capacity_slots} slots are being written or read right now"
        )
        super().__init__(f"no slot for block {key.hex()}: {why}")
        self.key = key


class RootInUseError(TieringError, RuntimeError):
    """Another process (or another tier in this one) has the root directory open."""
