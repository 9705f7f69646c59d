"""The simulated GPU prefix cache in front of the offloading manager.

vLLM keeps finished requests' KV blocks on the GPU until it needs the memory, and a
new request reuses the longest cached prefix. This models that as an LRU of block ids
with a fixed number of blocks; it holds no bytes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class GPUPrefixCache:
    """An LRU set of ``capacity_blocks`` block ids (0 disables the GPU cache)."""

    def __init__(self, capacity_blocks: int) -> None:
        if capacity_blocks < 0:
            raise ValueError(f"capacity_blocks must be >= 0, got {capacity_blocks}")
        self.capacity_blocks = capacity_blocks
        self._blocks: OrderedDict[int, None] = OrderedDict()
        self.evictions = 0

    def prefix_hits(self, hash_ids: Sequence[int]) -> int:
        """Number of leading blocks of ``hash_ids`` held on the GPU."""
        hits = 0
        for hash_id in hash_ids:
            if hash_id not in self._blocks:
                break
            hits += 1
        return hits

    def admit(self, hash_ids: Sequence[int]) -> None:
        """Record a request's blocks as resident and most recently used, evicting LRU ones.

        The request's first block becomes the most recent: vLLM frees a
        finished request's blocks tail first, so under pressure a cached
        prefix shrinks from its end and its start (what the next request can
        reuse) stays longest.
        """
        if self.capacity_blocks == 0:
            return
        blocks = self._blocks
        for hash_id in reversed(hash_ids):
            if hash_id in blocks:
                blocks.move_to_end(hash_id)
            else:
                blocks[hash_id] = None
        while len(blocks) > self.capacity_blocks:
            blocks.popitem(last=False)
            self.evictions += 1

    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, hash_id: object) -> bool:
        return hash_id in self._blocks
