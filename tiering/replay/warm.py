"""A replay that starts on a warm cache: which of the workload's blocks the secondary tiers
already hold when the run starts (a persistent ``root_dir`` from an earlier run), and the
unlimited reference that starts with the same blocks, so the comparison stays fair.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence

from tiering.core.keys import NO_CONTEXT
from tiering.replay.blockdata import block_key
from tiering.replay.offline import HitRate
from tiering.replay.replayer import ReplayStack
from tiering.replay.trace import DEFAULT_BLOCK_TOKENS, Request

#: How long to wait for tiers that answer "being checked" (shared tiers) before counting a
#: block as absent.
DEFAULT_CHECK_TIMEOUT_S = 5.0
_POLL_S = 0.005


def blocks_held_at_start(stack: ReplayStack) -> int:
    """Blocks the secondary tiers hold before the first request."""
    return sum(tier.blocks_held for tier in stack.stats().secondary)


def cached_at_start(
    stack: ReplayStack,
    hash_ids: Iterable[int],
    *,
    timeout_s: float = DEFAULT_CHECK_TIMEOUT_S,
) -> set[int]:
    """The blocks among ``hash_ids`` that some secondary tier already holds.

    Asks each tier holding anything, without moving data; a tier still
    checking after ``timeout_s`` counts as not holding the block.
    """
    stats = stack.stats().secondary
    tiers = [
        tier
        for (_, tier), tier_stats in zip(stack.secondary, stats, strict=True)
        if tier_stats.blocks_held > 0
    ]
    if not tiers:
        return set()
    found: set[int] = set()
    unsure: list[int] = []
    for hash_id in hash_ids:
        key = block_key(hash_id)
        answers = [tier.lookup(key, NO_CONTEXT) for tier in tiers]
        if True in answers:
            found.add(hash_id)
        elif None in answers:
            unsure.append(hash_id)
    deadline = time.monotonic() + timeout_s
    while unsure and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        still: list[int] = []
        for hash_id in unsure:
            key = block_key(hash_id)
            answers = [tier.lookup(key, NO_CONTEXT) for tier in tiers]
            if True in answers:
                found.add(hash_id)
            elif None in answers:
                still.append(hash_id)
        unsure = still
    return found


def unlimited_hit_rate_from(
    requests: Sequence[Request],
    initially_cached: Iterable[int],
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> HitRate:
    """Prefix hits of an unbounded cache that starts holding ``initially_cached``."""
    seen = set(initially_cached)
    hit_tokens = total_tokens = hit_blocks = total_blocks = 0
    for request in requests:
        hits = 0
        for hash_id in request.hash_ids:
            if hash_id not in seen:
                break
            hits += 1
        hit_tokens += min(hits * block_tokens, request.input_length)
        total_tokens += request.input_length
        hit_blocks += hits
        total_blocks += len(request.hash_ids)
        seen.update(request.hash_ids)
    return HitRate(hit_tokens, total_tokens, hit_blocks, total_blocks)
