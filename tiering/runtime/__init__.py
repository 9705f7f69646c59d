"""The async tier runtime: any :class:`~tiering.tier.AsyncTier` behind the seed's sync facade.

- :class:`AsyncTierManager` (``facade``): the scheduler-facing ``SecondaryTierManager``.
- :class:`TierStats` (``stats``): its immutable statistics snapshot.
- :class:`LoopThread` (``loop_thread``): a named event-loop thread on anyio's blocking portal.

See ``docs/runtime.md`` for threads, hand-offs, deadlines, cancellation and shutdown.
"""

from tiering.runtime.facade import AsyncTierManager, Presence
from tiering.runtime.loop_thread import LoopThread, WrongThreadError
from tiering.runtime.stats import TierStats

__all__ = ["AsyncTierManager", "LoopThread", "Presence", "TierStats", "WrongThreadError"]
