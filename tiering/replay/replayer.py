"""The replay loop: a simulated GPU prefix cache driving the real tiering stack.

Per request, as vLLM's scheduler and offloading connector would:

1. the GPU prefix cache serves the leading blocks it holds;
2. every block of the request is touched (marked recently used), and the manager
   is asked about the rest of the prefix, block by block. A block in
   a secondary tier answers None while it is promoted; the loop steps the manager
   (its per-step poll) until every promotion landed or the promotion timeout
   passed, then re-checks the prefix it will load;
3. ``prepare_load`` pins those blocks, the "GPU" reads every row and verifies it
   byte for byte against the block's deterministic contents, ``complete_load``;
4. the blocks after the hit are "computed" in prefill chunks (``store_chunk_blocks``,
   one scheduler step each): ``prepare_store`` reserves primary rows, the GPU side
   writes the bytes into them, ``complete_store`` makes them readable (and cascades
   them to the secondary tiers). A store refused because in-flight cascades pin the
   whole primary tier is retried while they finish (bounded: ``store_wait_s``), as
   the time an engine spends computing would have let them finish;
5. the manager is stepped once (one scheduler step per request).

Wall time is split between the simulated GPU side (prefix cache, filling and
verifying bytes) and the tier work (every manager call, stepping and waiting for
promotions), so the tier figures can be trusted.

This module owns that loop (:class:`Replayer`) and what it drives
(:class:`ReplayStack`); what it counts is :class:`~tiering.replay.totals.ReplayTotals`
(importable from here too).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tiering.core.contract import OffloadingManager, PrepareStoreOutput
from tiering.core.errors import ContractError
from tiering.core.jobs import SecondaryTierManager
from tiering.core.keys import NO_CONTEXT, OffloadKey
from tiering.core.specs import BlockIDsLoadStoreSpec
from tiering.core.stats import ManagerStats
from tiering.replay.blockdata import BlockContents, block_key, word_rows
from tiering.replay.gpu_cache import GPUPrefixCache
from tiering.replay.offline import DEFAULT_STORE_CHUNK_BLOCKS
from tiering.replay.totals import (
    CPU,
    GPU,
    PHASE_DRAIN,
    PHASE_GPU,
    PHASE_PROMOTION_WAIT,
    PHASE_STORE_STALL,
    PHASE_TIER,
    HitTally,
    Mismatch,
    ReplayTotals,
)
from tiering.replay.trace import DEFAULT_BLOCK_TOKENS, Request

_POLL_SLEEP_MIN_S = 20e-6
_POLL_SLEEP_MAX_S = 1e-3
_MAX_MISMATCH_EXAMPLES = 10


@dataclass(frozen=True, slots=True)
class ReplayStack:
    """What the replay drives: the manager, its primary buffer and its secondary tiers.

    ``step`` is the manager's per-step poll, ``stats`` its statistics snapshot.
    ``secondary`` names each secondary tier (its stats name) with its
    ``SecondaryTierManager``, in lookup order.
    """

    manager: OffloadingManager
    kv_view: memoryview
    block_bytes: int
    secondary: Sequence[tuple[str, SecondaryTierManager]]
    step: Callable[[], object]
    stats: Callable[[], ManagerStats]
    shutdown: Callable[[], None]


class Replayer:
    """Replays requests through a :class:`ReplayStack` with a GPU prefix cache in front."""

    def __init__(
        self,
        stack: ReplayStack,
        *,
        gpu_blocks: int,
        block_tokens: int = DEFAULT_BLOCK_TOKENS,
        promotion_timeout_s: float = 10.0,
        drain_timeout_s: float = 60.0,
        should_stop: Callable[[], bool] | None = None,
        store_chunk_blocks: int = DEFAULT_STORE_CHUNK_BLOCKS,
        store_wait_s: float = 5.0,
    ) -> None:
        if promotion_timeout_s <= 0:
            raise ValueError(f"promotion_timeout_s must be positive, got {promotion_timeout_s}")
        if store_chunk_blocks <= 0:
            raise ValueError(f"store_chunk_blocks must be positive, got {store_chunk_blocks}")
        if store_wait_s < 0:
            raise ValueError(f"store_wait_s must be >= 0, got {store_wait_s}")
        self.store_chunk_blocks = store_chunk_blocks
        self.store_wait_s = store_wait_s
        self.stack = stack
        self.gpu = GPUPrefixCache(gpu_blocks)
        self.block_tokens = block_tokens
        self.promotion_timeout_s = promotion_timeout_s
        self.drain_timeout_s = drain_timeout_s
        self.contents = BlockContents(stack.block_bytes)
        self.rows = word_rows(stack.kv_view, stack.block_bytes)
        self.totals = ReplayTotals()
        self._stop_requested = False
        self._should_stop = should_stop

    def request_stop(self) -> None:
        """Ask the loop to stop after the current request (safe from a signal handler)."""
        self._stop_requested = True

    # -- the loop -------------------------------------------------------------------------

    def run(
        self,
        requests: Sequence[Request],
        on_progress: Callable[[ReplayTotals], None] | None = None,
        progress_every: int = 1,
    ) -> ReplayTotals:
        """Replay ``requests`` in order, then let in-flight tier jobs finish (bounded).

        Returns the totals; ``interrupted`` is set when :meth:`request_stop` (or the
        ``should_stop`` callable given at construction) ended the loop early.
        ``on_progress`` is called every ``progress_every`` requests and at the end.
        """
        totals = self.totals
        totals.requests_total = len(requests)
        for place in (GPU, CPU, *(name for name, _ in self.stack.secondary)):
            totals.hit(place)
        start = time.perf_counter()
        try:
            for index, request in enumerate(requests):
                if self._stop_requested or (self._should_stop is not None and self._should_stop()):
                    totals.interrupted = True
                    break
                self._replay_one(index, request)
                totals.requests_done += 1
                if on_progress is not None and totals.requests_done % progress_every == 0:
                    on_progress(totals)
            totals.draining = True
            if on_progress is not None:
                on_progress(totals)
            with totals.clock.phase(PHASE_DRAIN):
                totals.drained = self._drain()
        finally:
            totals.wall_s = time.perf_counter() - start
        if on_progress is not None:
            on_progress(totals)
        return totals

    def _replay_one(self, index: int, request: Request) -> None:
        totals = self.totals
        clock = totals.clock
        perf = time.perf_counter

        t0 = perf()
        ids = request.hash_ids
        tokens = request.block_tokens(self.block_tokens)
        totals.total_tokens += request.input_length
        totals.total_blocks += len(ids)
        gpu_hits = self.gpu.prefix_hits(ids)
        gpu_tally = totals.hit(GPU)
        for position in range(gpu_hits):
            gpu_tally.add(tokens[position])
        rest_ids = ids[gpu_hits:]
        all_keys = [block_key(hash_id) for hash_id in ids]
        keys = all_keys[gpu_hits:]
        t1 = perf()
        clock.add(PHASE_GPU, t1 - t0)

        # As vLLM's connector does when it looks a request up: every block is recent.
        self.stack.manager.touch(all_keys, NO_CONTEXT)
        clock.add(PHASE_TIER, perf() - t1)
        found, sources = self._lookup_prefix(keys)
        loaded = self._load(index, rest_ids[:found], keys[:found], sources)
        for position, source in enumerate(sources[:loaded]):
            totals.hit(source).add(tokens[gpu_hits + position])

        t2 = perf()
        self.gpu.admit(ids)
        clock.add(PHASE_GPU, perf() - t2)

        self._store(rest_ids[loaded:], keys[loaded:])

        t3 = perf()
        self.stack.step()
        clock.add(PHASE_TIER, perf() - t3)

    # -- lookup and promotions ------------------------------------------------------------

    def _walk(self, keys: Sequence[OffloadKey]) -> tuple[int, list[int]]:
        """Look keys up in order until the first False.

        Returns the number of keys before that False and the positions among
        them answered None (being promoted).
        """
        lookup = self.stack.manager.lookup
        pending: list[int] = []
        for position, key in enumerate(keys):
            answer = lookup(key, NO_CONTEXT)
            if answer is False:
                return position, pending
            if answer is None:
                pending.append(position)
        return len(keys), pending

    def _source_of(self, key: OffloadKey) -> str:
        """The secondary tier a promotion of ``key`` comes from.

        The manager promotes from the first tier, in order, that holds the block; a
        tier still finding out (None) is the best guess when none says True.
        """
        unsure: str | None = None
        for name, tier in self.stack.secondary:
            answer = tier.lookup(key, NO_CONTEXT)
            if answer is True:
                return name
            if answer is None and unsure is None:
                unsure = name
        if unsure is not None:
            return unsure
        return self.stack.secondary[0][0] if self.stack.secondary else CPU

    def _lookup_prefix(self, keys: Sequence[OffloadKey]) -> tuple[int, list[str]]:
        """How many leading keys are loadable now, and where each came from."""
        totals = self.totals
        clock = totals.clock
        perf = time.perf_counter
        t0 = perf()
        reach, pending = self._walk(keys)
        sources = [CPU] * reach
        if pending:
            # Attribute each promotion to its tier before it lands (then it is a CPU hit).
            for position in pending:
                sources[position] = self._source_of(keys[position])
            wait_start = perf()
            deadline = wait_start + self.promotion_timeout_s
            pause = _POLL_SLEEP_MIN_S
            while pending:
                self.stack.step()
                reach, pending = self._walk(keys)
                if reach > len(sources):
                    sources.extend([CPU] * (reach - len(sources)))
                for position in pending:
                    if sources[position] == CPU:
                        sources[position] = self._source_of(keys[position])
                if not pending:
                    break
                if perf() >= deadline:
                    totals.promotion_timeouts += len(pending)
                    reach = pending[0]
                    break
                # Let the tiers' loop threads run: a busy poll would hold the GIL.
                time.sleep(pause)
                pause = min(pause * 2, _POLL_SLEEP_MAX_S)
            waited = perf() - wait_start
            totals.promotion_latency.add(waited)
            clock.add(PHASE_PROMOTION_WAIT, waited)
            # The promotions may have evicted blocks found earlier: re-check the prefix.
            confirmed, still_pending = self._walk(keys[:reach])
            if still_pending:
                confirmed = min(confirmed, still_pending[0])
            totals.lost_before_load += reach - confirmed
            reach = confirmed
        del sources[reach:]
        clock.add(PHASE_TIER, perf() - t0)
        return reach, sources

    # -- loads and stores -----------------------------------------------------------------

    def _load(
        self,
        index: int,
        hash_ids: Sequence[int],
        keys: Sequence[OffloadKey],
        sources: Sequence[str],
    ) -> int:
        """Load and verify the found blocks; returns how many leading ones verified."""
        if not keys:
            return 0
        totals = self.totals
        clock = totals.clock
        manager = self.stack.manager
        perf = time.perf_counter
        t0 = perf()
        try:
            spec = manager.prepare_load(keys, NO_CONTEXT)
        except ContractError:
            # The manager refused what its lookup had just offered: count it, load nothing.
            totals.load_errors += len(keys)
            clock.add(PHASE_TIER, perf() - t0)
            return 0
        t1 = perf()
        clock.add(PHASE_TIER, t1 - t0)
        block_ids = _block_ids(spec)
        verified = len(keys)
        contents, rows = self.contents, self.rows
        for position, (hash_id, row) in enumerate(zip(hash_ids, block_ids, strict=True)):
            if not contents.matches(hash_id, rows[row]):
                totals.mismatches += 1
                if len(totals.mismatch_examples) < _MAX_MISMATCH_EXAMPLES:
                    totals.mismatch_examples.append(Mismatch(index, hash_id, sources[position]))
                verified = min(verified, position)
        totals.verified_blocks += len(keys)
        t2 = perf()
        clock.add(PHASE_GPU, t2 - t1)
        manager.complete_load(keys)
        t3 = perf()
        clock.add(PHASE_TIER, t3 - t2)
        totals.load_latency.add(t3 - t0)
        totals.blocks_loaded += len(keys)
        totals.blocks_promoted_used += sum(1 for s in sources[:verified] if s != CPU)
        return verified

    def _store(self, hash_ids: Sequence[int], keys: Sequence[OffloadKey]) -> None:
        """Offload freshly computed blocks, one prefill chunk (and scheduler step) at a time."""
        chunk = self.store_chunk_blocks
        for start in range(0, len(keys), chunk):
            if start:
                t0 = time.perf_counter()
                self.stack.step()
                self.totals.clock.add(PHASE_TIER, time.perf_counter() - t0)
            self._store_chunk(hash_ids[start : start + chunk], keys[start : start + chunk])

    def _store_chunk(self, hash_ids: Sequence[int], keys: Sequence[OffloadKey]) -> None:
        """prepare_store, write the reserved rows as the GPU worker would, complete_store."""
        totals = self.totals
        clock = totals.clock
        manager = self.stack.manager
        perf = time.perf_counter
        t0 = perf()
        output = manager.prepare_store(keys, NO_CONTEXT)
        if output is None:
            output = self._wait_for_room(keys)
        t1 = perf()
        clock.add(PHASE_TIER, t1 - t0)
        if output is None:
            totals.store_rejected_blocks += len(keys)
            return
        to_store = output.keys_to_store
        if not to_store:
            totals.store_latency.add(t1 - t0)
            return
        id_of = dict(zip(keys, hash_ids, strict=True))
        block_ids = _block_ids(output.store_spec)
        contents, rows = self.contents, self.rows
        for key, row in zip(to_store, block_ids, strict=True):
            contents.fill(id_of[key], rows[row])
        t2 = perf()
        clock.add(PHASE_GPU, t2 - t1)
        manager.complete_store(to_store, True)
        t3 = perf()
        clock.add(PHASE_TIER, t3 - t2)
        totals.store_latency.add(t3 - t0)
        totals.blocks_stored += len(to_store)

    def _wait_for_room(self, keys: Sequence[OffloadKey]) -> PrepareStoreOutput | None:
        """Retry a refused store while tier jobs that pin primary blocks are in flight.

        The replay runs requests back to back, far faster than an engine computes
        them; when cascades to slow tiers pin the whole primary tier, an engine
        would have spent that time computing. Waiting (at most ``store_wait_s``,
        and only while jobs are in flight) keeps the hit rates about capacity,
        not about the replay's pace; the time waited is reported as stalls.
        """
        if self.store_wait_s <= 0:
            return None
        totals = self.totals
        perf = time.perf_counter
        start = perf()
        deadline = start + self.store_wait_s
        pause = _POLL_SLEEP_MIN_S
        output: PrepareStoreOutput | None = None
        refusals = 1  # the one that brought us here
        while perf() < deadline and self.stack.stats().jobs_in_flight:
            time.sleep(pause)
            pause = min(pause * 2, _POLL_SLEEP_MAX_S)
            self.stack.step()
            output = self.stack.manager.prepare_store(keys, NO_CONTEXT)
            if output is not None:
                break
            refusals += 1
        # Counted as dropped by the manager each time; at most one of them was a drop.
        totals.retried_refusal_blocks += len(keys) * (refusals - (output is None))
        waited = perf() - start
        totals.store_stalls.add(waited)
        totals.clock.add(PHASE_STORE_STALL, waited)
        return output

    def _drain(self) -> bool:
        """Step the manager until no tier job is in flight (bounded); True if drained."""
        deadline = time.perf_counter() + self.drain_timeout_s
        pause = _POLL_SLEEP_MIN_S
        while True:
            self.stack.step()
            if self.stack.stats().jobs_in_flight == 0:
                return True
            if time.perf_counter() >= deadline:
                return False
            time.sleep(pause)
            pause = min(pause * 2, _POLL_SLEEP_MAX_S)


def _block_ids(spec: object) -> list[int]:
    if not isinstance(spec, BlockIDsLoadStoreSpec):
        raise TypeError(f"expected a spec with block ids from the CPU primary tier, got {spec!r}")
    return [int(b) for b in spec.block_ids.tolist()]


__all__ = [
    "Replayer",
    "ReplayStack",
    # defined in tiering.replay.totals, importable from here as before
    "CPU",
    "GPU",
    "PHASE_DRAIN",
    "PHASE_GPU",
    "PHASE_PROMOTION_WAIT",
    "PHASE_STORE_STALL",
    "PHASE_TIER",
    "HitTally",
    "Mismatch",
    "ReplayTotals",
]
