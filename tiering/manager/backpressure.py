"""Back-pressure: when a secondary tier is behind. One rule, applied by both managers.

Every job in flight holds primary rows until its tier answers: a cascade its
pins, a promotion its reserved rows. A tier is *behind* when ``more`` rows
would take its jobs in flight past its share of the primary tier
(``cascade_max_pinned_fraction``) *and* its oldest job has waited longer than
a tier that keeps up takes (:data:`BEHIND_AFTER_S`). Our manager
(:mod:`tiering.manager.cascade`) and our tiers under vLLM's manager
(:mod:`tiering.integrations.vllm.backpressure`) then drop the tier's cascades
and answer its hits as misses, so a slow tier costs its own hit rate, never the
primary tier's room.

A tier that answers within :data:`BEHIND_AFTER_S` is never behind, whatever it
has in flight: its pins are released before the engine needs the rows, and a
scheduler that runs steps back to back (a replay) would otherwise drop blocks
a real engine keeps. One job always goes through (nothing in flight is never
behind), so a tier with a tiny share still makes progress.
"""

from __future__ import annotations

from collections.abc import Callable

#: A tier whose oldest job in flight is younger than this keeps up.
BEHIND_AFTER_S = 0.05


class JobsInFlight:
    """One tier's jobs submitted and not yet answered: the rows they hold, and since when.

    Owned by the thread that submits the tier's jobs and collects their results.
    """

    def __init__(self) -> None:
        self._jobs: dict[int, tuple[int, float]] = {}  # job id -> (rows, submitted at)
        self.blocks = 0

    def started(self, job_id: int, blocks: int, at: float) -> None:
        self._jobs[job_id] = (blocks, at)
        self.blocks += blocks

    def finished(self, job_id: int) -> None:
        """Forget a job (one not started is ignored)."""
        entry = self._jobs.pop(job_id, None)
        if entry is not None:
            self.blocks -= entry[0]

    def behind(self, more: int, budget: int, clock: Callable[[], float]) -> bool:
        """Whether ``more`` rows would pass ``budget`` while the oldest job is old (see above)."""
        if not self.blocks or self.blocks + more <= budget:
            return False
        oldest = next(iter(self._jobs.values()), None)
        return oldest is not None and clock() - oldest[1] > BEHIND_AFTER_S
