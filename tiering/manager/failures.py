"""Rate-limited logging of failed secondary-tier jobs.

A dead tier fails every job it is given; one log line per tier per interval (with
a count of what was suppressed) keeps it from flooding the logs. Routine failures
- blocks that left a bounded or shared tier since the lookup - are logged at INFO.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

# Every part logs as "tiering.manager", the name operators filter on.
logger = logging.getLogger("tiering.manager")


class FailureLog:
    """One log line per tier per interval about failed jobs, so a dead tier cannot flood logs."""

    def __init__(self, interval_s: float) -> None:
        self._interval_s = interval_s
        self._next_at: dict[str, float] = {}
        self._suppressed: Counter[str] = Counter()

    def failed(self, tier: str, what: str, error: str | None, *, routine: bool = False) -> None:
        """Log a failed job; ``routine`` ones (blocks gone from a tier) at INFO."""
        if routine:
            logger.info("tier %s: %s failed: %s", tier, what, error or "no reason given")
            return
        now = time.monotonic()
        if now < self._next_at.get(tier, 0.0):
            self._suppressed[tier] += 1
            return
        more = self._suppressed.pop(tier, 0)
        logger.warning(
            "tier %s: %s failed: %s%s",
            tier,
            what,
            error or "no reason given",
            f" (and {more} more failures since the last report)" if more else "",
        )
        self._next_at[tier] = now + self._interval_s
