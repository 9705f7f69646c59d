"""The copy-engine interface shared by the CUDA and the host implementations.

An engine executes :class:`~tiering.copy.plan.TransferPlan` s asynchronously,
in submission order within each :class:`~tiering.copy.plan.Lane`, and orders
jobs of different lanes that touch the same blocks (a load submitted after a
store of the same CPU block sees the stored bytes). ``submit`` never waits for
a copy; the returned :class:`CopyJob` is polled (``done``), waited on
(``wait``) or awaited from an asyncio loop (``wait_async``).
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass

from tiering.copy.layout import KVLayout
from tiering.copy.plan import Lane, TransferPlan

#: Back-off of ``CopyJob.wait_async`` polling: first sleep and cap, in seconds.
POLL_FIRST_S = 20e-6
POLL_MAX_S = 1e-3


@dataclass(frozen=True, slots=True)
class CopyOutcome:
    """How a finished job ended. ``seconds`` is the copy time (0.0 if it never ran)."""

    success: bool
    seconds: float = 0.0
    error: str | None = None


class CopyJob(ABC):
    """One submitted transfer. Owned by the thread that submitted it."""

    def __init__(self, plan: TransferPlan) -> None:
        self.plan = plan

    @property
    def lane(self) -> Lane:
        return self.plan.lane

    @property
    def num_bytes(self) -> int:
        return self.plan.total_bytes

    @abstractmethod
    def done(self) -> bool:
        """True once the job finished, successfully or not. Never blocks."""

    @abstractmethod
    def outcome(self) -> CopyOutcome:
        """The result of a finished job; raises ``RuntimeError`` if it is still running."""

    def wait(self, timeout: float | None = None) -> bool:
        """Block until the job finished or ``timeout`` seconds passed; True if finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        delay = POLL_FIRST_S
        while not self.done():
            if deadline is not None and time.monotonic() >= deadline:
                return False
            time.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        return True

    async def wait_async(self) -> CopyOutcome:
        """Wait for the job from an asyncio loop without blocking the loop.

        The default polls :meth:`done` with an exponential back-off from 20 us
        to 1 ms. Cancellation only stops the waiting: the copy itself runs on.
        """
        delay = POLL_FIRST_S
        while not self.done():
            await asyncio.sleep(delay)
            delay = min(delay * 2, POLL_MAX_S)
        return self.outcome()


class CopyEngine(ABC):
    """Moves blocks between the KV-cache tensors and the primary tier's host buffer."""

    #: Short name shown in logs and benchmarks ("host", "cuda").
    kind: str = "abstract"

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        #: Jobs :meth:`shutdown` reported failed whose copies may still be running
        #: (a CUDA DMA cannot be stopped): while non-zero, the host buffer must
        #: stay mapped.
        self.jobs_left_running = 0

    @abstractmethod
    def submit(self, plan: TransferPlan) -> CopyJob:
        """Start the copies of ``plan`` on its lane and return at once.

        Errors found while enqueuing (before any byte moved or after some did)
        do not raise: they make the returned job finish as failed.
        Raises :class:`~tiering.core.errors.TierClosedError` after :meth:`shutdown`.
        """

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> None:
        """Let every submitted job finish (up to ``timeout`` seconds), then release resources.

        Jobs still unfinished at the deadline finish as failed. Idempotent.
        """
