"""``RejectionLog``: one log line per reason a stored value is rejected, rate limited.

A forger rewriting values, or a misconfigured engine sharing the namespace,
can make every load fail verification: one warning per value would flood the
log. Each reason is logged the first time, then at most once per interval
with the number seen since. Loop-thread state of one tier.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from tiers.redis.errors import RejectedValue

#: What each reason means for the operator, appended to its log line.
_ADVICE = {
    "unauthenticated": "written without this tier's auth key: another writer, or an engine "
    "with another key, shares the namespace",
    "checksum": "the payload does not match its checksum (damaged, or rewritten)",
    "foreign": "the value belongs to another key or layout",
    "malformed": "not a value this tier writes",
    "wrong_type": "the key holds a non-string value",
}


class RejectionLog:
    """Logs rejected values at most once per ``interval_s`` per reason."""

    def __init__(
        self,
        logger: logging.Logger,
        where: str,
        interval_s: float = 60.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._logger = logger
        self._where = where
        self._interval_s = interval_s
        self._clock = clock
        self._next_at: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def note(self, rejected: RejectedValue) -> None:
        """Count ``rejected``; log it if its reason was not logged within the interval."""
        kind = rejected.kind
        since = self._admit(kind)
        if since is None:
            return
        self._logger.warning(
            "%s: rejected a stored value (%s: %s); not served, and deleted unless "
            "rewritten since: %s%s",
            self._where,
            kind,
            _ADVICE.get(kind, "failed verification"),
            rejected,
            _more(since),
        )

    def note_delete_failure(self, where: str, count: int, error: object) -> None:
        """Rejected values could not be deleted (e.g. ACLs without ``EVAL``); rate limited."""
        since = self._admit("delete-failed")
        if since is None:
            return
        self._logger.warning(
            "%s: could not delete %d rejected value(s) (they stay misses for this tier): %s%s",
            where,
            count,
            error,
            _more(since),
        )

    def _admit(self, kind: str) -> int | None:
        """How many ``kind`` events were suppressed since the last line, or None to stay quiet."""
        now = self._clock()
        if now < self._next_at.get(kind, float("-inf")):
            self._suppressed[kind] = self._suppressed.get(kind, 0) + 1
            return None
        self._next_at[kind] = now + self._interval_s
        return self._suppressed.pop(kind, 0)


def _more(since: int) -> str:
    return f" ({since} more since the last such line)" if since else ""
