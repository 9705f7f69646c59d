"""Offline analysis of a trace, independent of the tiering stack.

* :func:`unlimited_hit_rate`: the token-weighted prefix hit rate of a cache that
  never forgets (the ceiling any capacity can reach, and the replay's correctness
  anchor);
* :func:`simulate_policy`: a single cache of ``capacity`` blocks run by one of the
  framework's eviction policies (the same classes the primary tier uses);
* :func:`simulate_belady`: Belady's MIN, the offline optimum that evicts the block
  needed furthest in the future (or declines to cache a block needed later than
  everything cached). Trace block ids are prefix hashes, so a block is never needed
  later than its parent, and MIN keeps the cache prefix-closed: every block it hits
  is a prefix hit. Its hit count is the most any policy of the same capacity gets.

All three count a request's hits as the leading blocks found in the cache (a prefix
hit), weighted by the tokens each block covers.
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from tiering.policies import (
    AdmissionPolicy,
    EvictionPolicy,
    LRUPolicy,
    PolicyChoice,
    make_policy,
    resolve_admission,
)
from tiering.policies.request import RequestContext, access_with, insert_with
from tiering.replay.trace import DEFAULT_BLOCK_TOKENS, Request

#: Blocks offloaded per store call: one prefill chunk of vLLM's default 8192-token
#: batch at 512-token blocks. A request longer than that is stored chunk by chunk.
DEFAULT_STORE_CHUNK_BLOCKS = 16


@dataclass(frozen=True, slots=True)
class HitRate:
    """Token- and block-weighted prefix hits of one simulated cache over a trace."""

    hit_tokens: int
    total_tokens: int
    hit_blocks: int
    total_blocks: int

    @property
    def token_hit_rate(self) -> float:
        return self.hit_tokens / self.total_tokens if self.total_tokens else 0.0

    @property
    def block_hit_rate(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


class _Tally:
    def __init__(self) -> None:
        self.hit_tokens = self.total_tokens = self.hit_blocks = self.total_blocks = 0

    def add(self, request: Request, prefix_hits: int, block_tokens: int) -> None:
        self.hit_tokens += min(prefix_hits * block_tokens, request.input_length)
        self.total_tokens += request.input_length
        self.hit_blocks += prefix_hits
        self.total_blocks += len(request.hash_ids)

    def result(self) -> HitRate:
        return HitRate(self.hit_tokens, self.total_tokens, self.hit_blocks, self.total_blocks)


def unlimited_hit_rate(
    requests: Sequence[Request], block_tokens: int = DEFAULT_BLOCK_TOKENS
) -> HitRate:
    """Prefix hits of an unbounded cache: a block hits iff it was seen before."""
    seen: set[int] = set()
    tally = _Tally()
    for request in requests:
        hits = 0
        for hash_id in request.hash_ids:
            if hash_id not in seen:
                break
            hits += 1
        tally.add(request, hits, block_tokens)
        seen.update(request.hash_ids)
    return tally.result()


def simulate_policy(
    requests: Sequence[Request],
    capacity_blocks: int,
    policy_name: str | PolicyChoice,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    store_chunk_blocks: int = DEFAULT_STORE_CHUNK_BLOCKS,
    decode_touches: bool = False,
) -> HitRate:
    """Prefix hits of one cache of ``capacity_blocks`` run by an eviction policy.

    ``policy_name`` is any setting :func:`~tiering.policies.resolve_policy` accepts.

    Each request drives the policy the way vLLM's connector drives the CPU primary
    tier (:class:`~tiering.primary.CPUPrimaryTier`): the leading cached blocks hit;
    every cached block of the request is touched (the first block ending most
    recently used); then the blocks after the hit are stored in prefill chunks of
    ``store_chunk_blocks``. A chunk's blocks not cached yet evict the policy's
    victims among blocks outside the chunk (or, when too few are evictable, the
    chunk is not stored) and are inserted last block first.

    Policies that take request context
    (:class:`~tiering.policies.request.RequestAwarePolicy`) get it with every touch and
    store (the request's index, the block's position); others get plain keys. With
    ``decode_touches`` the request's cached blocks are also touched once per decoded
    block (``output_length / block_tokens`` times), as vLLM's connector does: a key-only
    policy counts each touch as a use, a request-aware one counts the request once.
    """
    if store_chunk_blocks <= 0:
        raise ValueError(f"store_chunk_blocks must be positive, got {store_chunk_blocks}")
    policy = make_policy(policy_name, capacity_blocks)
    tally = _Tally()
    for index, request in enumerate(requests):
        ids = request.hash_ids
        hits = 0
        for hash_id in ids:
            if hash_id not in policy:
                break
            hits += 1
        tally.add(request, hits, block_tokens)
        for position in range(len(ids) - 1, -1, -1):  # ignored for blocks not cached
            access_with(policy, ids[position], RequestContext(index, position))
        for start in range(hits, len(ids), store_chunk_blocks):
            _store_chunk(policy, capacity_blocks, ids, start, store_chunk_blocks, index)
        if decode_touches:
            for _ in range(-(-request.output_length // block_tokens)):
                for position in range(len(ids) - 1, -1, -1):
                    access_with(policy, ids[position], RequestContext(index, position))
    return tally.result()


def _store_chunk(
    policy: EvictionPolicy[Hashable],
    capacity: int,
    ids: Sequence[int],
    start: int,
    length: int,
    request: int | None = None,
) -> None:
    """What ``CPUPrimaryTier.prepare_store`` + ``complete_store`` do to the policy.

    Stores ``ids[start : start + length]``; ``request`` (the request's index), when
    given, is passed with each block's position to request-aware policies.
    """
    chunk: dict[int, int] = {}  # distinct ids, in order -> position
    for position in range(start, min(start + length, len(ids))):
        chunk.setdefault(ids[position], position)
    missing = [hash_id for hash_id in chunk if hash_id not in policy]
    shortfall = len(missing) - (capacity - len(policy))
    if shortfall > 0:
        protected = sum(1 for hash_id in chunk if hash_id in policy)
        if shortfall > len(policy) - protected:
            return  # the store is refused: nothing changes
        policy.evict(shortfall, lambda key: key not in chunk)
    for hash_id in reversed(missing):
        context = None if request is None else RequestContext(request, chunk[hash_id])
        insert_with(policy, hash_id, context)


@dataclass(frozen=True, slots=True)
class StackHitRate:
    """Prefix hits of a primary cache over a secondary one, and what was written below."""

    hits: HitRate
    primary_hit_blocks: int  # blocks served by the primary cache
    secondary_hit_blocks: int  # blocks served by the secondary cache (promoted)
    blocks_written: int  # blocks cascaded into the secondary cache

    def bytes_written_per_hit_token(self, block_bytes: int) -> float:
        """Bytes written to the secondary tier per token served from cache (0 without hits)."""
        hit_tokens = self.hits.hit_tokens
        return self.blocks_written * block_bytes / hit_tokens if hit_tokens else 0.0


def simulate_stack(
    requests: Sequence[Request],
    primary_blocks: int,
    secondary_blocks: int,
    policy: str | PolicyChoice = "lru",
    admission: str | PolicyChoice = "all",
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
    store_chunk_blocks: int = DEFAULT_STORE_CHUNK_BLOCKS,
) -> StackHitRate:
    """A primary cache (``policy``) over an LRU secondary cache, with cascade ``admission``.

    Mirrors the manager: a request's leading blocks found in either cache hit
    (those only in the secondary are promoted into the primary); every cached
    block is touched (and the admission policy's ``on_use`` answer, blocks still
    in the primary, is cascaded); the rest is stored into the primary in chunks as
    :func:`simulate_policy` does, and the admitted part of each stored chunk is
    cascaded. A cascade of a block the secondary holds writes nothing.
    """
    if primary_blocks <= 0 or secondary_blocks <= 0:
        raise ValueError("primary_blocks and secondary_blocks must be positive")
    primary = make_policy(policy, primary_blocks)
    secondary: LRUPolicy[int] = LRUPolicy(secondary_blocks)
    gate: AdmissionPolicy[int] = resolve_admission(admission).build(primary_blocks)
    tally = _Tally()
    written = primary_hits = secondary_hits = 0

    def cascade(keys: Sequence[int]) -> int:
        count = 0
        for key in keys:
            if key in secondary:
                continue
            if len(secondary) >= secondary_blocks:
                secondary.evict(1, lambda _k: True)
            secondary.insert(key)
            count += 1
        return count

    for request in requests:
        ids = request.hash_ids
        hits = 0
        promoted: list[int] = []
        for hash_id in ids:
            if hits == primary_blocks:  # every block loaded is pinned in the CPU tier at once
                break
            if hash_id in primary:
                primary_hits += 1
            elif hash_id in secondary:
                secondary_hits += 1
                promoted.append(hash_id)
            else:
                break
            hits += 1
        tally.add(request, hits, block_tokens)
        for hash_id in reversed(ids):
            primary.access(hash_id)
            secondary.access(hash_id)
        written += cascade(gate.on_use([k for k in ids[:hits] if k in primary]))
        if promoted:  # promotions land in the primary tier; nothing is written below
            _store_chunk(primary, primary_blocks, promoted, 0, len(promoted))
        for start in range(hits, len(ids), store_chunk_blocks):
            chunk = ids[start : start + store_chunk_blocks]
            missing = [k for k in dict.fromkeys(chunk) if k not in primary]
            _store_chunk(primary, primary_blocks, ids, start, store_chunk_blocks)
            stored = [k for k in missing if k in primary]
            if stored:
                written += cascade(gate.admit(stored))
    return StackHitRate(tally.result(), primary_hits, secondary_hits, written)


def _next_uses(requests: Sequence[Request]) -> list[int]:
    """For each block access (in trace order), the index of that block's next access."""
    total = sum(len(request.hash_ids) for request in requests)
    never = total  # later than every access
    next_use = [never] * total
    last_seen: dict[int, int] = {}
    position = total
    for request in reversed(requests):
        for hash_id in reversed(request.hash_ids):
            position -= 1
            next_use[position] = last_seen.get(hash_id, never)
            last_seen[hash_id] = position
    return next_use


def simulate_belady(
    requests: Sequence[Request],
    capacity_blocks: int,
    block_tokens: int = DEFAULT_BLOCK_TOKENS,
) -> HitRate:
    """Prefix hits of Belady's MIN (with bypass) on a cache of ``capacity_blocks``."""
    if capacity_blocks <= 0:
        raise ValueError(f"capacity_blocks must be positive, got {capacity_blocks}")
    next_use = _next_uses(requests)
    never = len(next_use)
    cached: dict[int, int] = {}  # block id -> its current next use
    # Max-heap of (-next use, block id); entries whose next use changed are stale.
    heap: list[tuple[int, int]] = []
    tally = _Tally()
    position = 0
    for request in requests:
        hits = 0
        prefix = True
        for hash_id in request.hash_ids:
            upcoming = next_use[position]
            position += 1
            if hash_id in cached:
                hits += prefix
                cached[hash_id] = upcoming
                heapq.heappush(heap, (-upcoming, hash_id))
                continue
            prefix = False
            if upcoming == never:
                continue  # never needed again: caching it cannot help
            if len(cached) >= capacity_blocks:
                while -heap[0][0] != cached.get(heap[0][1], -1):
                    heapq.heappop(heap)  # stale entry
                furthest = -heap[0][0]
                if furthest <= upcoming:
                    continue  # everything cached is needed sooner: bypass
                del cached[heapq.heappop(heap)[1]]
            cached[hash_id] = upcoming
            heapq.heappush(heap, (-upcoming, hash_id))
        tally.add(request, hits, block_tokens)
    return tally.result()
