"""Results: collecting finished jobs from every tier, and draining them at shutdown.

Results are polled once per scheduler step, before any eviction decision, and
whenever a lookup asks about a key on its way. Each result goes to the layer of
its job (cascade or promotion); a result for a job that is not in flight is
counted and logged, never acted on. At shutdown the manager waits a bounded time
for jobs in flight, then releases what unanswered jobs still hold.
"""

from __future__ import annotations

import dataclasses
import logging
import time

from tiering.core.jobs import JobResult, SecondaryTierManager
from tiering.manager.promotion import PromotionMixin
from tiering.manager.state import JobKind
from tiering.manager.statistics import Holdings

# Every part logs as "tiering.manager", the name operators filter on.
logger = logging.getLogger("tiering.manager")


class ResultsMixin(PromotionMixin):
    """Result collection and shutdown draining."""

    def _poll(self, landed_only: bool = False) -> int:
        """Collect every tier's finished jobs and act on them. Returns how many.

        ``landed_only`` (the polls within a step, e.g. a lookup of a key on its
        way): skip the tiers that say (``has_finished``) no result is waiting. The
        step's own poll asks every tier with jobs in flight, which is also when
        our tiers offer a due garbage collection to their loop thread.
        """
        if not self._jobs:
            return 0
        finished = 0
        for position, tier in enumerate(self._tiers):
            if not self._tier_counters[position].jobs_in_flight:
                continue
            try:
                if landed_only:
                    waiting = getattr(tier, "has_finished", None)
                    if waiting is not None and not waiting():
                        continue
                results = list(tier.get_finished())
            except Exception:
                self._internal_error(f"get_finished of tier {self._tier_counters[position].name}")
                continue
            for result in results:
                finished += self._on_result(position, result)
        return finished

    def _on_result(self, position: int, result: JobResult) -> int:
        job = self._jobs.get(result.job_id)
        if job is None or job.tier != position:
            self._unexpected_results += 1
            logger.error(
                "tier %s returned a result for job %s, which %s",
                self._tier_counters[position].name,
                result.job_id,
                "is not in flight" if job is None else "was submitted to another tier",
            )
            return 0
        del self._jobs[result.job_id]
        self._tier_counters[position].jobs_in_flight -= 1
        try:
            if job.kind is JobKind.CASCADE:
                self._finish_cascade(job, result)
            else:
                self._finish_promotion(job, result)
        except Exception:
            self._internal_error(f"handling the result of {job.kind.value} job {result.job_id}")
        return 1

    def _drain(self, deadline: float) -> None:
        while True:
            self._poll()
            remaining = deadline - time.monotonic()
            if not self._jobs or remaining <= 0:
                return
            busy = {job.tier for job in self._jobs.values()}
            waited = False
            for position in sorted(busy):
                drain = getattr(self._tiers[position], "drain", None)
                if callable(drain):
                    try:
                        drain(max(0.0, deadline - time.monotonic()))
                        waited = True
                    except TimeoutError:
                        waited = True  # the deadline passed: the loop above gives up
                    except Exception:
                        self._internal_error(f"drain of tier {self._tier_counters[position].name}")
            if not waited:
                time.sleep(min(0.001, max(0.0, remaining)))

    def _collect_after_shutdown(self, position: int, tier: SecondaryTierManager) -> None:
        """Take results a tier produced while shutting down (e.g. cancelled jobs)."""
        if not self._tier_counters[position].jobs_in_flight:
            return
        # Ours keep what their shutdown produced; another SecondaryTierManager may still
        # answer get_finished.
        take = getattr(tier, "results_after_shutdown", None) or tier.get_finished
        try:
            results = list(take())
        except Exception:
            return  # a closed tier may refuse; its jobs are abandoned below
        for result in results:
            self._on_result(position, result)

    def _abandon_jobs(self) -> None:
        """Release what jobs that never answered still hold (their tiers are shut down)."""
        for job_id, job in list(self._jobs.items()):
            self._on_result(job.tier, JobResult(job_id, False, error="abandoned at shutdown"))

    def shutdown(self) -> None:
        """Drain in-flight jobs (at most ``shutdown_timeout_s``), then shut every tier down.

        Staged promotions are dropped; jobs still unanswered at the deadline
        are abandoned after their tier has shut down (which cancels them and
        joins its thread), and their pins are released. Idempotent.
        """
        if self._closed:
            return
        self._closed = True
        held: Holdings | None = None
        try:
            self._end_of_step()
            self._drop_staged()
            self._drain(time.monotonic() + self._shutdown_timeout_s)
            held = self._holdings()
        finally:
            for position, tier in enumerate(self._tiers):
                try:
                    tier.shutdown()
                except Exception:
                    self._internal_error(f"shutdown of tier {self._tier_counters[position].name}")
                self._collect_after_shutdown(position, tier)
            self._abandon_jobs()
            tiers_held = held or Holdings.unknown(len(self._tiers))
            # The primary tier is still up: its figures after every pin was released.
            self._final_stats = self._stats_from(
                dataclasses.replace(
                    tiers_held,
                    primary_ready=self._primary.num_ready(),
                    primary_pinned=self._primary.num_pinned(),
                )
            )
            self._metrics.publish(self._final_stats)
            self._metrics.close()
            self._primary.shutdown()
