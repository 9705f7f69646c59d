"""Back-pressure for our tiers under vLLM's manager, on unless the operator configures vLLM's.

vLLM's manager asks a tier's ``bp_detector.should_store(num_blocks)`` before each
cascade (vLLM #50045) and drops the store when it says no, counting it in
``vllm:kv_offload_tiering_backpressure_{stores,blocks}_dropped``. vLLM builds a
detector only when ``backpressure`` is configured; without one a tier that falls
behind keeps every cascade's primary chunks pinned until it answers, and the CPU
tier stalls. So where vLLM gives our tier no detector, the tier installs
:class:`PinnedShareDetector`, the rule our own manager applies
(:mod:`tiering.manager.backpressure`): a cascade is dropped when the tier's jobs in
flight (cascades and promotions) would pin more than
``cascade_max_pinned_fraction`` of the CPU tier (0.25 by default) *and* the
oldest has waited longer than a tier that keeps up takes; and while that holds,
the tier answers its lookups MISS, since a promotion would wait behind the same
backlog holding a CPU chunk. A ``backpressure`` config of vLLM's replaces it.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector, DropStorePolicy

from tiering.manager.backpressure import JobsInFlight


class PinnedShareDetector(BackpressureDetector):  # type: ignore[misc]  # vLLM is untyped
    """vLLM's detector interface over the pinned-share rule (see the module docstring).

    ``dropped_blocks`` counts every block it refused (vLLM's metric counts them
    too, from the policy); ``refused_hits`` the lookups the tier answered MISS
    instead of HIT because a promotion would have waited behind its backlog.
    """

    def __init__(
        self,
        jobs: JobsInFlight,
        budget_blocks: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(policy=DropStorePolicy())
        self._jobs = jobs
        self.budget_blocks = max(1, budget_blocks)
        self._clock = clock
        self._behind = False
        self.dropped_blocks = 0
        self.refused_hits = 0

    def behind(self, num_blocks: int) -> bool:
        """Whether ``num_blocks`` more would find the tier behind (the shared rule)."""
        return self._jobs.behind(num_blocks, self.budget_blocks, self._clock)

    def should_store(self, num_blocks: int) -> bool:
        self._behind = self.behind(num_blocks)
        if self._behind:
            self.policy.on_store_skipped(num_blocks)
            self.dropped_blocks += num_blocks
            return False
        return True

    def should_promote(self) -> bool:
        """False (and counted) when a promotion would wait behind the tier's backlog."""
        if self.behind(1):
            self.refused_hits += 1
            return False
        return True

    def on_store_completed(self, elapsed_s: float, num_bytes: int) -> None:
        """Latency plays no part: the rule is what the tier has pinned, and for how long."""

    def is_under_pressure(self) -> bool:
        return self._behind

    def reset(self) -> None:
        self._behind = False
        self.policy.reset()

    @property
    def stats(self) -> dict[str, float]:
        return {
            "blocks_in_flight": float(self._jobs.blocks),
            "budget_blocks": float(self.budget_blocks),
            "dropped_blocks": float(self.dropped_blocks),
            "refused_hits": float(self.refused_hits),
        }
