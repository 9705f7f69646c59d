"""Presence resolution, touch forwarding and removal reports of a tier's loop-thread service.

Owns how the presence view changes outside jobs: batched ``contains_many``
checks of unsettled keys (and, for a shared tier, the ageing of its answers),
forwarding queued ``touch`` calls to the tier, the tier's ``report_removed``
(blocks leave the view, *removed* events), and the bounded event queue.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
from collections.abc import Sequence

from tiering.core.keys import OffloadKey
from tiering.runtime.service_state import _RESOLVE_BATCH, _ServiceState, logger


class _PresenceKeeping(_ServiceState):
    """Presence resolution, touches and removals (a part of ``TierService``)."""

    # -- presence resolution, touch, removals ---------------------------------------------

    async def _resolve_forever(self) -> None:
        """Answer ``contains`` for unsettled keys in batches; age a shared tier's answers.

        Cancellation: stops (shutdown).
        """
        wakeup = self._resolve_wakeup
        assert wakeup is not None
        present = self.present
        period = None if present.ttl_s is None else max(0.01, present.ttl_s / 4)
        while True:
            if period is None:
                await wakeup.wait()
            else:
                with contextlib.suppress(TimeoutError):
                    async with asyncio.timeout(period):
                        await wakeup.wait()
                # Aged answers are asked again; checksums stay (see StoredDigests).
                present.expire()
            wakeup.clear()
            while self._to_resolve:
                await self._resolve_some()

    def _learn_present(self, key: OffloadKey) -> None:
        """``key`` is readable in the tier (a shared tier may forget older answers for room).

        Forgotten answers are asked again when needed; their checksums stay.
        """
        self.present.add(key)

    async def _resolve_some(self) -> None:
        batch: list[OffloadKey] = []
        for key in list(self._to_resolve):
            del self._to_resolve[key]
            if key in self._claims:
                continue  # the operation holding it settles it (and re-queues if still unsure)
            if key not in self.unsettled:
                continue
            batch.append(key)
            if len(batch) == _RESOLVE_BATCH:
                break
        if not batch:
            return
        assert self._loop is not None
        mine = self._loop.create_future()
        for key in batch:
            self._claims[key] = mine
        answers: list[bool] | None = None
        try:
            async with asyncio.timeout(self.job_timeout_s):
                answers = await self._contains_all(batch)
        except Exception as exc:
            logger.warning(
                "tier %s: checking presence of %d blocks failed (%r); treating them as absent",
                self.name,
                len(batch),
                exc,
            )
        finally:
            self._settle_resolved(batch, answers)
            for key in batch:
                if self._claims.get(key) is mine:
                    del self._claims[key]
            mine.set_result(None)

    async def _contains_all(self, keys: list[OffloadKey]) -> list[bool]:
        answers: list[bool] = []
        for start in range(0, len(keys), self._max_batch):
            chunk = keys[start : start + self._max_batch]
            await self._limiter.acquire(len(chunk))
            try:
                answers.extend(await self.tier.contains_many(chunk))
            finally:
                self._limiter.release(len(chunk))
        return answers

    def _settle_resolved(self, keys: list[OffloadKey], answers: list[bool] | None) -> None:
        now = time.monotonic()
        if self.shared:
            self._prune_absent(now)
        for i, key in enumerate(keys):
            self.unsettled.discard(key)
            if answers is not None and answers[i]:
                self._learn_present(key)
                self.absent_at.pop(key, None)
            else:
                self.present.discard(key)
                if self.shared:
                    self.absent_at.pop(key, None)  # re-insert at the end (pruning order)
                    self.absent_at[key] = now

    def _prune_absent(self, now: float) -> None:
        """Drop expired absent answers (oldest first: the dict is in insertion order)."""
        absent_at = self.absent_at
        horizon = now - self.shared_absent_ttl_s
        expired = []
        for key, when in absent_at.items():
            if when >= horizon:
                break
            expired.append(key)
        for key in expired:
            del absent_at[key]

    async def _touch_all(self) -> None:
        """Forward queued touches in batches. Cancellation: stops (shutdown)."""
        while self._to_touch:
            keys, self._to_touch = self._to_touch, []
            if not self.shared:
                keys = [k for k in keys if k in self.present]
            if not keys:
                continue
            try:
                async with asyncio.timeout(self.job_timeout_s):  # inline: keeps mailbox order
                    await self.tier.touch(keys)
            except Exception as exc:
                logger.warning("tier %s: touch of %d blocks failed: %r", self.name, len(keys), exc)

    def _on_removed(self, keys: Sequence[OffloadKey]) -> None:
        """The tier's ``report_removed``: the blocks are gone for lookups; emit an event."""
        if threading.get_ident() != self._thread_id and self._loop is not None:
            # Misplaced call (e.g. from an executor thread): move it to the loop.
            self._loop.call_soon_threadsafe(self._on_removed, list(keys))
            return
        now = time.monotonic()
        removed = [k for k in keys if k in self.present]
        claims = self._claims
        # A private tier's removed key can only come back through our own store; a
        # shared tier's may come back written by anyone, so its checksum stays.
        digests = None if self.shared else self._digests
        for key in keys:
            self.present.discard(key)
            if digests is not None:
                digests.forget(key)
            if key in claims:  # e.g. evicted by a later write of the same batch
                self._removed_during_op.add(key)
            if self.shared:
                self.absent_at[key] = now
        if removed:
            self.counters.blocks_removed += len(removed)
            self._add_event(removed, removed=True)

    def _add_event(self, keys: list[OffloadKey], *, removed: bool) -> None:
        if len(self.events) >= self.max_events:
            self.counters.events_dropped += len(keys)
            return
        self.events.append((keys, removed))
