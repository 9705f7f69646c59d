"""Play vLLM's scheduler against an ``OffloadingManager``, for tests and benchmarks.

:class:`SchedulerDriver` calls only the scheduler-facing API of vLLM 0.33's
``OffloadingManager`` (``on_new_request``, ``lookup``, ``prepare_store``,
``complete_store``, ``prepare_load``, ``complete_load``,
``on_request_finished``, ``on_schedule_end``, ``has_pending_work``), always
under ``manager.lock``, in the order vLLM's ``OffloadingConnectorScheduler``
does. Direct reads and writes of the primary tier's rows stand in for the
GPU <-> CPU copies of the worker.
"""

from __future__ import annotations

import hashlib
import itertools
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadKey,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.factory import OffloadingSpecFactory

Rows = npt.NDArray[np.uint8]
#: Writes a block's bytes into its primary row (the "GPU -> CPU" copy).
FillRow = Callable[[OffloadKey, Rows], None]
#: Checks a loaded block's primary row (the "CPU -> GPU" copy) while it is pinned.
CheckRow = Callable[[OffloadKey, Rows], None]


def offloading_config(
    secondary_tiers: Sequence[dict[str, Any]],
    *,
    block_bytes: int,
    num_chunks: int,
    model: str = "kv-tiering/test-model",
    enable_kv_cache_events: bool = False,
    extra_config: dict[str, Any] | None = None,
) -> Any:
    """The ``OffloadingConfig`` vLLM 0.33 hands an ``OffloadingSpec`` for one worker.

    ``extra_config`` is ``kv_connector_extra_config`` (what a user writes in
    ``--kv-transfer-config``); the tiering spec and the primary tier's size are
    filled in unless given. One KV-cache group of 16-token blocks, one chunk
    per block, a single worker.
    """
    extra: dict[str, Any] = {
        "spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": num_chunks * block_bytes,
        "eviction_policy": "lru",
        "secondary_tiers": [dict(t) for t in secondary_tiers],
    }
    extra.update(extra_config or {})
    return OffloadingConfig(
        groups=(
            OffloadingGroupConfig(
                tokens_per_block=16, layer_names=("model.layers.0.self_attn.attn",), group_id=0
            ),
        ),
        worker_kv_bytes_per_block=block_bytes,
        enable_kv_cache_events=enable_kv_cache_events,
        extra_config=extra,
        engine_id=f"kvtiering-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16", max_model_len=4096),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0,
            world_size=1,
            tp_size=1,
            pp_size=1,
            pcp_size=1,
            dcp_size=1,
            data_parallel_index=0,
            data_parallel_size=1,
            data_parallel_rank_local=None,
            is_parallelism_agnostic=True,
        ),
    )


def build_manager(config: Any) -> Any:
    """vLLM's own ``TieringOffloadingManager``, built the way vLLM builds it.

    ``OffloadingSpecFactory.create_spec(config).get_manager()``: the spec named
    by ``spec_name``, its CPU primary tier in a shared-memory region, and every
    ``secondary_tiers`` entry created by vLLM's ``SecondaryTierFactory``.
    """
    return OffloadingSpecFactory.create_spec(config).get_manager()


def chained_keys(salt: str, count: int, group_idx: int = 0) -> list[OffloadKey]:
    """``count`` keys of one prompt: each block hash chains on the previous, as vLLM's do."""
    keys: list[OffloadKey] = []
    digest = hashlib.sha256(salt.encode()).digest()
    for i in range(count):
        digest = hashlib.sha256(digest + i.to_bytes(4, "little")).digest()
        keys.append(make_offload_key(digest, group_idx))
    return keys


def block_pattern(key: OffloadKey, nbytes: int) -> Rows:
    """Deterministic bytes of ``nbytes`` derived from ``key`` (different for every key)."""
    seed = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return np.random.default_rng(seed).integers(0, 256, size=nbytes, dtype=np.uint8)


@dataclass(frozen=True, slots=True)
class PrefixLookup:
    """Result of one maximal-prefix lookup: ``hits`` leading keys found."""

    hits: int
    pending: bool  # some found key is not readable yet (HIT_PENDING / RETRY): look again
    missed: bool  # stopped at a MISS


class SchedulerDriver:
    """Drives one vLLM ``OffloadingManager`` the way the engine's scheduler does."""

    def __init__(self, manager: Any, *, poll_interval_s: float = 0.0002) -> None:
        self.manager = manager
        self.poll_interval_s = poll_interval_s
        primary = manager.primary_tier
        self.rows: Rows = np.asarray(primary.get_kv_memoryview()).view(np.uint8)
        self.num_chunks = int(self.rows.shape[0])
        self.row_bytes = int(self.rows.shape[1])
        self.steps = 0
        #: ``get_load_source`` of each block the last :meth:`load` loaded (vLLM's
        #: ``CacheHitSource``: which tier served it, kept across promotion).
        self.last_load_sources: list[Any] = []
        self._ids = itertools.count()

    def lock(self) -> AbstractContextManager[Any]:
        lock: AbstractContextManager[Any] = self.manager.lock
        return lock

    def release_rows(self) -> None:
        """Drop the numpy view of the primary buffer (vLLM unmaps it at shutdown)."""
        self.rows = np.empty((0, 0), dtype=np.uint8)

    # -- one scheduler step ------------------------------------------------------------

    def new_request(self, name: str, kv_transfer_params: dict[str, Any] | None = None) -> Any:
        """A fresh ``ReqContext`` announced to the manager (caller holds the lock)."""
        ctx = ReqContext(req_id=f"{name}-{next(self._ids)}", kv_transfer_params=kv_transfer_params)
        self.manager.on_new_request(ctx)
        return ctx

    def end_step(self, new_req_ids: Sequence[str] = ()) -> None:
        """``on_schedule_end`` (caller holds the lock)."""
        self.steps += 1
        self.manager.on_schedule_end(
            ScheduleEndContext(new_req_ids=tuple(new_req_ids), preempted_req_ids=())
        )

    def step(self) -> None:
        """One idle engine step: lets the manager collect results and flush work."""
        with self.lock():
            self.end_step()

    def pending(self) -> bool:
        with self.lock():
            return bool(self.manager.has_pending_work())

    def run_until_idle(self, timeout_s: float = 60.0) -> int:
        """Step until ``has_pending_work()`` is False; returns the number of steps taken."""
        for steps, _ in enumerate(self._until(timeout_s, "the manager to finish its transfers")):
            with self.lock():
                if not self.manager.has_pending_work():
                    return steps
                self.end_step()
        raise AssertionError("unreachable")

    def lookup_prefix(self, keys: Sequence[OffloadKey], ctx: Any) -> PrefixLookup:
        """Maximal-prefix lookup like the connector's (caller holds the lock)."""
        hits, pending = 0, False
        for key in keys:
            result = self.manager.lookup(key, ctx)
            if result is LookupResult.MISS:
                return PrefixLookup(hits, pending, True)
            pending |= result is not LookupResult.HIT
            hits += 1
        return PrefixLookup(hits, pending, False)

    # -- whole requests ----------------------------------------------------------------

    def store(
        self,
        name: str,
        keys: Sequence[OffloadKey],
        fill: FillRow,
        timeout_s: float = 60.0,
    ) -> list[OffloadKey]:
        """Offload ``keys`` as one request; returns the keys the primary tier took.

        Retries ``prepare_store`` each step while it returns None (the primary
        tier is full of pinned chunks: vLLM's own backpressure).
        """
        with self.lock():
            ctx = self.new_request(name)
            new_ids = [ctx.req_id]
        try:
            for _ in self._until(timeout_s, f"prepare_store of {len(keys)} keys"):
                with self.lock():
                    out = self.manager.prepare_store(list(keys), ctx)
                    if out is None:
                        self.end_step(new_ids)
                        new_ids = []
                        continue
                    stored = list(out.keys_to_store)
                    for key, row in zip(stored, out.store_spec.block_ids, strict=True):
                        fill(key, self.rows[int(row)])
                    if stored:  # the connector completes only stores it prepared
                        self.manager.complete_store(stored, ctx)
                    return stored
            raise AssertionError("unreachable")
        finally:
            with self.lock():
                self.manager.on_request_finished(ctx)
                self.end_step(new_ids)

    def evict_primary(self, name: str = "filler") -> int:
        """Evict every block from the primary tier with a filler request; returns how many.

        The filler's chunks are released again with ``complete_store(success=False)``.
        Fails if any chunk is still pinned (a transfer in flight).
        """
        filler = chained_keys(f"{name}-{next(self._ids)}", self.num_chunks)
        with self.lock():
            ctx = self.new_request(name)
            out = self.manager.prepare_store(filler, ctx)
            if out is None:
                raise AssertionError("cannot evict the primary tier: chunks are still pinned")
            self.manager.complete_store(out.keys_to_store, ctx, success=False)
            self.manager.on_request_finished(ctx)
            self.end_step([ctx.req_id])
            return len(out.evicted_keys)

    def load(
        self,
        name: str,
        keys: Sequence[OffloadKey],
        check: CheckRow,
        timeout_s: float = 60.0,
    ) -> int:
        """Look ``keys`` up as one request until resolved, then load the hit prefix.

        ``check`` sees each loaded block's primary row while it is pinned.
        Returns the number of leading keys that were loaded.
        """
        with self.lock():
            ctx = self.new_request(name)
            new_ids = [ctx.req_id]
        try:
            for _ in self._until(timeout_s, f"lookups of {len(keys)} keys to resolve"):
                with self.lock():
                    found = self.lookup_prefix(keys, ctx)
                    if found.pending:
                        self.end_step(new_ids)
                        new_ids = []
                        continue
                    hit_keys = list(keys[: found.hits])
                    self.last_load_sources = [
                        self.manager.get_load_source(k, ctx) for k in hit_keys
                    ]
                    if hit_keys:
                        spec = self.manager.prepare_load(hit_keys, ctx)
                        try:
                            for key, row in zip(hit_keys, spec.block_ids, strict=True):
                                check(key, self.rows[int(row)])
                        finally:
                            self.manager.complete_load(hit_keys, ctx)
                    return found.hits
            raise AssertionError("unreachable")
        finally:
            with self.lock():
                self.manager.on_request_finished(ctx)
                self.end_step(new_ids)

    def _until(self, timeout_s: float, what: str) -> Iterator[None]:
        """Yield until the caller returns; sleeps between rounds; fails after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        first = True
        while True:
            if not first:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"gave up waiting {timeout_s} s for {what}")
                time.sleep(self.poll_interval_s)
            first = False
            yield


def fill_pattern(key: OffloadKey, row: Rows) -> None:
    """:data:`FillRow` writing :func:`block_pattern` bytes."""
    row[:] = block_pattern(key, row.size)


class PatternChecker:
    """:data:`CheckRow` comparing rows with :func:`block_pattern`; counts good and bad blocks."""

    def __init__(self) -> None:
        self.good = 0
        self.bad: list[OffloadKey] = []

    def __call__(self, key: OffloadKey, row: Rows) -> None:
        if np.array_equal(row, block_pattern(key, row.size)):
            self.good += 1
        else:
            self.bad.append(key)
