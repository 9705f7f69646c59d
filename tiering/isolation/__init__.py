"""Opt-in process isolation for a secondary tier (issue 20.4).

:class:`IsolatedTierManager` is :class:`~tiering.runtime.AsyncTierManager`'s
facade with the tier's event loop in a child process: ``ring`` (the
shared-memory message rings), ``wakeup`` (coalesced cross-process wake-ups),
``mirror`` (the lookup view, recorded in the child and replayed in the
scheduler's process), ``child`` (the tier's process) and ``manager`` (the
scheduler side). See ``docs/runtime.md``, "Isolation".
"""

from tiering.isolation.manager import IsolatedTierManager

__all__ = ["IsolatedTierManager"]
