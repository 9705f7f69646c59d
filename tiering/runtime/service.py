"""The loop-thread side of a secondary tier: jobs, key claims, presence, resolution, events.

This module owns the service's life cycle (``open``, ``aclose``) and the
entry points the facade's mailbox calls (``start_job``, ``request_resolve``,
``touch``); the rest is split by responsibility: ``service_state`` (the
state and job records), ``resolver`` (presence resolution, touches,
removals), ``transfer`` (batch calls, row views, verification) and
``jobs_runner`` (claims, deadlines, stores, loads, results).

Everything here runs on the tier's event-loop thread, and this object is the
only writer of the state the scheduler thread reads without a lock (the
*published* state, safe to read under the GIL because each read is one
atomic operation on a set, dict or deque):

``present``      keys known to be readable in the tier (lookup True); for a shared
                 tier, recent knowledge (see :mod:`tiering.runtime.presence`)
``unsettled``    keys whose presence is being checked (lookup None)
``absent_at``    shared tiers: keys found absent, with when (lookup False for a while)
``events``       ``(keys, removed)`` pairs waiting for ``take_events``
``results``      finished ``JobResult`` objects waiting for ``get_finished``

Rules it enforces for every tier:

* at most ``tier.max_concurrency`` block operations at once (a weighted
  limiter; jobs are split into batch calls of at most that many keys);
* never two operations on the same key at once: a job *claims* its keys and
  waits for earlier claims on any of them. A load of a key whose store is in
  flight therefore waits for the store and then reads it (within the load's
  own deadline);
* every job has a deadline; at the deadline its operations are cancelled and
  it fails. A tier that ignores cancellation past ``cancel_grace_s`` is
  logged (it broke its contract), and its job is reported only when the
  operation really ends: until then it may still touch the job's primary
  rows, and a job stays in flight while any of its rows is still held;
* a key whose write did not end cleanly (error, cancellation) is *unsettled*:
  lookups answer None until ``contains`` says what is there.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Sequence

from tiering.core.keys import OffloadKey
from tiering.runtime.jobs_runner import _JobRunner
from tiering.runtime.service_state import _Job as _Job  # re-exported: the facade builds jobs
from tiering.runtime.service_state import logger
from tiering.tier import TierContext

#: Recovered keys learnt per turn of the loop at open.
_SEED_CHUNK = 65536
#: An open that takes more than this share of its deadline is one WARNING.
SLOW_OPEN_SHARE = 0.5


class TierService(_JobRunner):
    """Runs one :class:`AsyncTier` on the current event loop for a facade (loop thread only)."""

    # -- life cycle --------------------------------------------------------------------------

    async def open(self, context: TierContext, timeout_s: float | None = None) -> None:
        """Open the tier and seed the presence view from ``list_keys``.

        ``timeout_s`` is the caller's deadline for this call (``open_timeout_s``): an open
        that took more than half of it is one WARNING, while it still fits. A tier's open
        grows with the blocks it holds (an fs tier replays its journal: about 2.4 us per
        block, ``benchmarks/fs_reopen.py``), so a growing tier would otherwise fail to
        start one day without notice.

        Cancellation (open deadline): propagates; the facade then closes the tier.
        """
        started = time.monotonic()
        self._loop = asyncio.get_running_loop()
        self._thread_id = threading.get_ident()
        self._resolve_wakeup = asyncio.Event()
        self.tier._bind_removed_sink(self._on_removed)
        await self.tier.open(context)
        recovered = list(await self.tier.list_keys())
        for start in range(0, len(recovered), _SEED_CHUNK):
            self.present.add_many(recovered[start : start + _SEED_CHUNK])
            await asyncio.sleep(0)  # a big recovered index must not stall the loop
        self._resolver = self._loop.create_task(
            self._resolve_forever(), name=f"{self.name}-resolve"
        )
        took = time.monotonic() - started
        if timeout_s is not None and took > SLOW_OPEN_SHARE * timeout_s:
            logger.warning(
                "tier %s took %.1f s to open, %.0f%% of open_timeout_s (%g s): a tier holding "
                "more blocks may not open in time; raise open_timeout_s",
                self.name,
                took,
                100 * took / timeout_s,
                timeout_s,
            )

    async def close_tier_only(self, timeout_s: float) -> None:
        """Close the tier after a failed open (bounded). Cancellation: abandons the close."""
        try:
            await asyncio.wait_for(self.tier.aclose(), max(0.001, timeout_s))
        except Exception:
            logger.exception("tier %s: aclose after a failed open raised", self.name)

    async def aclose(self, budget_s: float) -> None:
        """Drain in-flight jobs, cancel what is left, stop helpers, close the tier.

        Half of ``budget_s`` goes to letting jobs finish, the rest to
        cancellation and ``tier.aclose``. Cancellation: stops waiting; the
        loop thread's own close then cancels what is left.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        self._closing = True
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=budget_s / 2)
            for task in pending:
                task.cancel()
            if pending:
                grace = max(0.001, min(self.cancel_grace_s, (deadline - loop.time()) / 2))
                await asyncio.wait(pending, timeout=grace)
        # Jobs still running ignored cancellation: report them failed now.
        for job in list(self._jobs.values()):
            self._publish(job, self._failure(job, f"cancelled: tier {self.name} shut down"))
        helpers = [t for t in (self._resolver, self._toucher) if t is not None and not t.done()]
        for task in helpers:
            task.cancel()
        if helpers:
            await asyncio.wait(helpers, timeout=max(0.001, min(1.0, deadline - loop.time())))
        try:
            await asyncio.wait_for(self.tier.aclose(), max(0.001, deadline - loop.time()))
        except TimeoutError:
            logger.error("tier %s: aclose did not finish within the shutdown budget", self.name)
        except Exception:
            logger.exception("tier %s: aclose raised", self.name)

    # -- entry points from the mailbox (loop thread) ----------------------------------------

    def start_job(self, job: _Job) -> None:
        """Start a job handed over by the scheduler thread."""
        loop = self._loop
        assert loop is not None
        if self._closing:
            self._publish(job, self._failure(job, f"cancelled: tier {self.name} shut down"))
            return
        self._jobs[job.meta.job_id] = job
        job.task = loop.create_task(self._run_job(job))
        # Relative to now: the deadline is on time.monotonic(), whatever clock the loop uses.
        job.timer = loop.call_later(max(0.0, job.deadline - time.monotonic()), self._expire, job)

    def request_resolve(self, key: OffloadKey) -> None:
        """Find out whether ``key`` is in the (shared) tier; the lookup view gets the answer."""
        if key in self.present or self._closing:
            return
        self.unsettled.add(key)
        self._to_resolve[key] = None
        assert self._resolve_wakeup is not None
        self._resolve_wakeup.set()

    def touch(self, keys: Sequence[OffloadKey]) -> None:
        """Queue keys for ``tier.touch`` (batched; metadata only, so it takes no claims)."""
        if self._closing:
            return
        self._to_touch.extend(keys)
        if self._toucher is None or self._toucher.done():
            assert self._loop is not None
            self._toucher = self._loop.create_task(self._touch_all(), name=f"{self.name}-touch")
