"""``ReconnectGate``: fail fast while the server is down, probe it at growing intervals."""

from __future__ import annotations

import time
from collections.abc import Callable


class ReconnectGate:
    """Tracks whether the server is reachable and when to try it again.

    While the server is up every operation goes through. After a failure that
    means "unreachable" the gate closes: operations are refused at once (no
    one waits out a connect timeout) until the retry time, when one round of
    operations is let through as a probe. A failed probe doubles the wait, up
    to ``max_delay_s``; any success opens the gate and resets the wait.

    Plain synchronous state owned by the tier's loop thread.
    """

    def __init__(
        self,
        first_delay_s: float,
        max_delay_s: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < first_delay_s <= max_delay_s:
            raise ValueError(
                f"need 0 < first_delay_s <= max_delay_s, got {first_delay_s}, {max_delay_s}"
            )
        self._first_delay_s = first_delay_s
        self._max_delay_s = max_delay_s
        self._clock = clock
        self._down = False
        self._delay_s = first_delay_s
        self._next_probe_at = 0.0
        self._probe_admitted = False

    @property
    def is_down(self) -> bool:
        """Whether the last outcome seen was "unreachable"."""
        return self._down

    def seconds_until_probe(self) -> float:
        """How long operations will still be refused (0 when up or a probe is due)."""
        if not self._down:
            return 0.0
        return max(0.0, self._next_probe_at - self._clock())

    def admit(self) -> bool:
        """Whether an operation may try the server now.

        When a probe is due this admits the caller and pushes the next probe
        time out, so concurrent callers keep failing fast while it is out.
        """
        if not self._down:
            return True
        now = self._clock()
        if now < self._next_probe_at:
            return False
        self._next_probe_at = now + self._delay_s
        self._probe_admitted = True
        return True

    def record_success(self) -> bool:
        """The server answered. Returns True if this ends an outage."""
        was_down = self._down
        self._down = False
        self._probe_admitted = False
        self._delay_s = self._first_delay_s
        return was_down

    def record_unreachable(self) -> bool:
        """The server could not be reached. Returns True if this starts an outage."""
        now = self._clock()
        if self._down:
            # Only a failed probe backs off further: operations that were already in
            # flight when the outage began report it too, and must not compound the wait.
            if self._probe_admitted:
                self._probe_admitted = False
                self._delay_s = min(self._delay_s * 2, self._max_delay_s)
                self._next_probe_at = now + self._delay_s
            return False
        self._down = True
        self._delay_s = self._first_delay_s
        self._next_probe_at = now + self._delay_s
        return True
